"""``python -m benchmarks.tune`` (``__main__.py``) and ``job.py``, its one-core trial
(``python -m benchmarks.tune.job``)."""
