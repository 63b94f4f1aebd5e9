"""``python -m benchmarks.dashboard`` (``__main__.py``) and ``job.py``, the training it watches."""
