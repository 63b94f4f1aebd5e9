"""``python -m benchmarks.recovery`` (``__main__.py``) and ``job.py``, the job it kills."""
