"""``python -m benchmarks.gpt`` (``__main__.py``) and ``runs.py``, which starts one GPT run
under clusterflow or torchrun; ``benchmarks.gpu`` uses it too. Standard library only here:
the GPU machine may lack the benchmarks' other tools."""
