"""The ``hier`` part of ``benchmarks.scale``: hierarchical against flat all-reduce.

N replicas on H = N / k emulated hosts of k replicas each (as ``--replicas-per-host k``
lays them out: contiguous ranks a host), every host's one link shaped at 10 Gbit/s
(scaled as in ``_scale_hosts``) and shared by its k replicas; traffic between replicas of
one host stays inside the host, unshaped, as between GPUs of one machine. Two sides on
the same gloo group and model (``_scale_hosts.WIDTH``), in alternating windows:

* ``flat``: ``MultiWorkerMirroredStrategy``, gloo's ring over all N ranks;
* ``hier``: the same with ``CommunicationOptions(hierarchical=True)``
  (``collective/hierarchy.py``): inside each host, across the H leaders, back inside.

Compute is EMULATED, as in the data plane. The key ``hier_vs_flat_10g`` is the median
over rounds of per-replica steps/s, hierarchical over flat.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks._common import Spread, alternate
from benchmarks._scale_hosts import (
    BUCKET_BYTES,
    COMPUTE_S,
    LINK_BIT,
    SCALE,
    WIDTH,
    Agent,
    fan,
)

PORT = 29400


def run(n: int, per_host: int, steps: int, rounds: int, verbose: bool) -> dict[str, Spread]:
    """Per-replica steps/s of ``flat`` and ``hier`` at ``n`` replicas, ``per_host`` a host."""
    from clusterflow.testing import EmulatedHosts, LinkShape

    if n % per_host:
        raise SystemExit(f"benchmark failed: {n} replicas do not fill hosts of {per_host}")
    log_dir = Path(tempfile.mkdtemp(prefix="cf-hier-"))
    hosts = EmulatedHosts(n // per_host, LinkShape(rate_bit=LINK_BIT // SCALE), prefix="cfhier")
    agents: list[Agent] = []
    failed = True
    try:
        agents = [Agent(h, log_dir, replica=r) for h in hosts.hosts for r in range(per_host)]
        for agent in agents:
            agent.recv()  # the greeting
        fan(
            agents,
            "dist_init",
            lambda i: {"rank": i, "local_rank": i % per_host, "local_world": per_host},
            master=agents[0].address,
            port=PORT,
            world=n,
        )
        for name, hierarchical in (("flat", False), ("hier", True)):
            fan(
                agents,
                "ring_join",
                name=name,
                width=WIDTH,
                bf16=False,
                bucket_bytes=BUCKET_BYTES,
                hierarchical=hierarchical,
            )
        rates: dict[str, list[float]] = {"flat": [], "hier": []}

        def window(side: str) -> float:
            spans = fan(agents, "window", name=side, steps=steps, compute_s=COMPUTE_S)
            rate = sum(steps / (end - start) for start, end, _ in spans) / n
            rates[side].append(rate)
            return rate

        for side in rates:  # untimed: connections, first buckets
            fan(agents, "warm", name=side, steps=1, compute_s=COMPUTE_S)
        alternate(
            {side: (lambda s=side: window(s)) for side in rates},
            rounds,
            verbose=verbose,
            warmup=False,
        )
        fan(agents, "dist_destroy")
        failed = False
    finally:
        for agent in agents:
            agent.close()
        hosts.close()
        if failed or verbose:
            print(f"hier agents' logs: {log_dir}", flush=True)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    ratios = [h / f for h, f in zip(rates["hier"], rates["flat"], strict=True)]
    print(
        f"{n} replicas on {n // per_host} hosts of {per_host}: per-replica steps/s "
        f"flat ring {Spread.of(rates['flat']).median:.2f}, hierarchical "
        f"{Spread.of(rates['hier']).median:.2f}",
        flush=True,
    )
    return {
        "flat": Spread.of(rates["flat"]),
        "hier": Spread.of(rates["hier"]),
        "hier_vs_flat_10g": Spread.of(ratios),
    }
