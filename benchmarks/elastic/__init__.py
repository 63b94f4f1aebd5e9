"""``python -m benchmarks.elastic`` (``__main__.py``); ``job.py``, clusterflow's job (the
all-reduce job that grows, and the records run's counter); ``ddp_job.py``, the peer's
plain DDP job under torchrun's elastic mode; ``shared.py``, the model, batches and step
log both jobs use."""
