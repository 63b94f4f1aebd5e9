"""``python -m benchmarks.ray`` (``__main__.py``) and ``probe.py``, the job it launches by path."""
