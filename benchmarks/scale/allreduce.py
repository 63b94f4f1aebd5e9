"""The ``allreduce`` part of ``benchmarks.scale``: clusterflow's all-reduce algorithms.

N replicas on H = N / k emulated hosts of k replicas each (as ``--replicas-per-host k``
lays them out: contiguous ranks a host), every host's one link shaped at 10 Gbit/s
(scaled as in ``hosts``) and shared by its k replicas; traffic between replicas of
one host stays inside the host, unshaped, as between GPUs of one machine. Sides on the
same gloo group and model (``hosts.WIDTH``), in alternating windows, each
``MultiWorkerMirroredStrategy`` with one ``CommunicationOptions.algorithm``:

* ``flat``: ``backend``, gloo's ring over all N ranks;
* ``hier``: ``hierarchical`` (``collective/hierarchy.py``): inside each host, across
  the H leaders, back inside.

Compute is EMULATED, as in the data plane. The key ``hier_vs_flat_10g`` is the median
over rounds of per-replica steps/s, hierarchical over the flat ring.

(A recursive halving-doubling all-reduce was measured here too, at f700d0d, and not
kept: docs/scaling.md, "Hierarchical all-reduce, measured".)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.common import Spread, alternate
from benchmarks.scale.hosts import (
    BUCKET_BYTES,
    COMPUTE_S,
    LINK_BIT,
    SCALE,
    WIDTH,
    Agent,
    fan,
)

PORT = 29400


ALGORITHMS = {"flat": "backend", "hier": "hierarchical"}


def run(n: int, per_host: int, steps: int, rounds: int, verbose: bool) -> dict[str, Spread]:
    """Per-replica steps/s of each side at ``n`` replicas, ``per_host`` a host, and each
    side's ratio to ``flat`` (``<side>_vs_flat_10g``)."""
    from clusterflow.testing import EmulatedHosts, LinkShape

    if n % per_host:
        raise SystemExit(f"benchmark failed: {n} replicas do not fill hosts of {per_host}")
    sides = list(ALGORITHMS)
    log_dir = Path(tempfile.mkdtemp(prefix="cf-allreduce-"))
    hosts = EmulatedHosts(n // per_host, LinkShape(rate_bit=LINK_BIT // SCALE), prefix="cfar")
    agents: list[Agent] = []
    failed = True
    rates: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
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
        for side in sides:
            fan(
                agents,
                "ring_join",
                name=side,
                width=WIDTH,
                bf16=False,
                bucket_bytes=BUCKET_BYTES,
                algorithm=ALGORITHMS[side],
            )

        def window(side: str) -> float:
            spans = fan(agents, "window", name=side, steps=steps, compute_s=COMPUTE_S)
            rate = sum(steps / (end - start) for start, end, _ in spans) / n
            rates[side].append(rate)
            cpu[side].append(1000 * sum(c for _, _, c in spans) / n / steps)
            return rate

        for side in sides:  # untimed: connections, first buckets
            fan(agents, "warm", name=side, steps=1, compute_s=COMPUTE_S)
        alternate(
            {side: (lambda s=side: window(s)) for side in sides},
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
            print(f"all-reduce agents' logs: {log_dir}", flush=True)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    medians = ", ".join(f"{side} {Spread.of(rates[side]).median:.2f}" for side in sides)
    cpu_ms = ", ".join(f"{side} {Spread.of(cpu[side]).median:.0f} ms" for side in sides)
    print(
        f"{n} replicas on {n // per_host} hosts of {per_host}: per-replica steps/s {medians}; "
        f"CPU per step per replica: {cpu_ms}",
        flush=True,
    )
    out = {side: Spread.of(rates[side]) for side in sides}
    for side in sides[1:]:
        ratios = [a / b for a, b in zip(rates[side], rates["flat"], strict=True)]
        out[f"{side}_vs_flat_10g"] = Spread.of(ratios)
    return out
