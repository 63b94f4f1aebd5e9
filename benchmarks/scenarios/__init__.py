"""Hostile-condition scenarios that the tests and ``python -m benchmarks.hostile`` share.

Each module is one scenario on emulated hosts (``clusterflow.testing``), importable by
both sides and launched in its hosts as ``python -m benchmarks.scenarios.NAME``:

* ``lossy``: sync training on clean and on slow, lossy, reordering links.
* ``partition``: a worker cut off from its ps and its dispatcher, relaunched.
* ``start``: cuts from the manager under ``clusterflow start --backend hosts``.

They live here, not in ``src/clusterflow/testing``: a scenario trains (ps, data,
strategies, train), and the harness must stay beside every layer of the product
(tests/unit/test_layers.py); nor in a benchmark's private module, since tests import them.
"""
