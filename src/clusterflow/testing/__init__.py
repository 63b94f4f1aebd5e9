"""Emulated hosts for tests and benchmarks: network namespaces on a bridge, links shaped by tc.

``EmulatedHosts(n, LinkShape.parse("10gbit"))`` makes ``n`` hosts on this machine, each
with its own private address and a shaped full-duplex link, so clusterflow's addresses,
auth and timeouts run as across real machines, and moving bytes costs link time, not
only CPU. Partitions (``cut``/``heal``) and re-shaping serve the hostile-conditions
tests. Needs root and iproute2; nothing in ``src/`` imports this package: a start on
``--backend hosts`` loads ``hosts_backend.py`` (each task in its host), which registers
its launcher with ``backends/kinds.py``.
"""

from __future__ import annotations

from clusterflow.testing.netns import (
    SUBNET,
    EmulatedHosts,
    HarnessError,
    Host,
    available,
    netem_available,
    sweep_stale,
)
from clusterflow.testing.tc import LinkShape, parse_rate, parse_time

__all__ = [
    "SUBNET",
    "EmulatedHosts",
    "HarnessError",
    "Host",
    "LinkShape",
    "available",
    "netem_available",
    "parse_rate",
    "parse_time",
    "sweep_stale",
]
