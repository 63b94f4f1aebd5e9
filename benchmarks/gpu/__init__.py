"""``python -m benchmarks.gpu`` (``__main__.py``) and ``ps_probe.py``, the ps push/pull job it
launches by path. Its GPT runs are ``benchmarks.gpt.runs``, shared with ``benchmarks.gpt``."""
