"""``python -m benchmarks.scale`` (``__main__.py``) and the parts only it uses.

* ``hosts.py``: the data plane, per-worker steps/s on emulated hosts; ``agent.py`` is
  one host's process there (``python -m benchmarks.scale.agent``).
* ``tf_peer.py``: TensorFlow's ParameterServerStrategy on the same hosts, run in a
  Python that has TensorFlow and nothing else of ours (so this file imports nothing).
* ``control.py``: the control plane, one manager and 1,000 simulated tasks.
* ``allreduce.py``: clusterflow's all-reduce algorithms on hosts that share a link.
* ``plots.py``: the PNG plots (``--plots DIR``, or ``python -m benchmarks.scale.plots``).
"""
