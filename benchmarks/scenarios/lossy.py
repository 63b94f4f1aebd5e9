"""Sync training over slow, lossy links: the same final parameters, and what it costs.

Three emulated hosts: host 0 serves ps task 0, hosts 1 and 2 run ``worker:0`` (the chief)
and ``worker:1`` of a sync ``ParameterServerStrategy``. Each step's batch is a function of
the step and the replica, so the run is deterministic: on a clean 1 Gbit/s link and on 20 Mbit/s
links losing 1% of packets (every host's link, both ways) whose hosts send with 50 ms
of delay and 0.1% of frames reordered (the issue's numbers; the userspace relay of
``clusterflow.testing.relay``, as this kernel has no ``sch_netem``), the final
parameters must agree (TCP hides loss and reordering from ZeroMQ; only time is lost).
Both runs go through the relays, so the ratio of steps per second after the first five,
lossy / clean, is the network's cost, not the relay's.

``tests/integration/test_hostile_lossy.py`` holds each run to more than agreement: the
ps made exactly ``STEPS`` sync steps of two pushes each and dropped nothing, the lossy
links did lose packets, and the final parameters are those of ``reference()``, the same
steps done in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterflow.testing import EmulatedHosts, LinkShape

ROOT = Path(__file__).resolve().parents[2]
PS_PORT = 7410
STEPS = 30
WARMUP = 5
ROWS = 8
TIMEOUT_S = 400.0
LR = 0.1
MOMENTUM = 0.9
CLEAN = LinkShape.parse("1gbit")
LOSSY = LinkShape.parse("20mbit", "50ms", 0.01, reorder=0.001)
"""Issue 19's slow and lossy link: 50 ms one-way delay, 1% loss, 0.1% reordering."""
LOSSY_TRIES = 3
"""Lossy runs at most, until one of them lost a packet (``runs``)."""


@dataclass(frozen=True, slots=True)
class Run:
    final: list[float]
    """The chief's parameters after the last step, flattened."""
    steps_per_s: float
    stats: dict[str, int]
    """The ps's counters at the end (``ParameterServerStrategy.ps_stats``; zero ones left out)."""
    lost_packets: int
    """Packets the hosts' links dropped during the run (``EmulatedHosts.link_stats``)."""


@dataclass(frozen=True, slots=True)
class Comparison:
    clean: Run
    lossy: Run

    def figures(self) -> dict[str, float]:
        diff = max(abs(a - b) for a, b in zip(self.clean.final, self.lossy.final, strict=True))
        return {
            "lossy_max_param_diff": diff,
            "lossy_throughput_ratio": self.lossy.steps_per_s / self.clean.steps_per_s,
        }


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, replica: int) -> tuple[Any, Any]:
    """Replica ``replica``'s batch at ``step``: a function of both, so runs repeat."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(ROWS, 6, generator=gen), torch.randint(0, 3, (ROWS,), generator=gen)


def reference() -> list[float]:
    """The final parameters of the same ``STEPS`` sync steps in one process: each step's
    gradient is the mean of the two replicas' (what the ps applies), SGD with momentum."""
    import torch
    import torch.nn.functional as F

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        grads = []
        for replica in range(2):
            x, y = _batch(step, replica)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def _env(workdir: Path, hosts: EmulatedHosts, index: int | None) -> dict[str, str]:
    spec = {
        "ps": [f"{hosts[0].address}:{PS_PORT}"],
        "worker": [f"{hosts[1].address}:7501", f"{hosts[2].address}:7502"],
    }
    task = {"type": "worker", "index": index} if index is not None else {"type": "ps", "index": 0}
    env = {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": spec, "task": task}),
        "CLUSTERFLOW_SECRET": (workdir / "secret").read_text().strip(),
        "OMP_NUM_THREADS": "1",
    }
    for name in ("CLUSTERFLOW_MANAGER", "CLUSTERFLOW_SECRET_FILE", "CLUSTERFLOW_AUTH"):
        env.pop(name, None)
    return env


def _lost(hosts: EmulatedHosts) -> int:
    return sum(hosts.link_stats(i).get("lost_packets", 0) for i in range(len(hosts)))


def _one(hosts: EmulatedHosts, workdir: Path) -> Run:
    from clusterflow.rpc import Credentials

    lost_before = _lost(hosts)
    workdir.mkdir(parents=True)
    Credentials.generate().to_file(workdir / "secret")
    ps = hosts[0].popen(
        [sys.executable, "-m", "clusterflow.ps"],
        env=_env(workdir, hosts, None),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "ps.err", "w"),  # noqa: SIM115 (the process keeps it)
    )
    try:
        workers = [
            hosts[1 + i].popen(
                [sys.executable, "-m", "benchmarks.scenarios.lossy", str(workdir)],
                env=_env(workdir, hosts, i),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=open(workdir / f"worker{i}.err", "w"),  # noqa: SIM115
            )
            for i in range(2)
        ]
        for i, worker in enumerate(workers):
            if worker.wait(TIMEOUT_S) != 0:
                err = (workdir / f"worker{i}.err").read_text().strip().splitlines()
                raise RuntimeError(f"worker {i} failed: {err[-1] if err else '?'}")
    finally:
        ps.terminate()
        ps.wait(30)
    result = json.loads((workdir / "final.json").read_text())
    return Run(
        result["final"],
        (STEPS - WARMUP) / result["seconds"],
        result["stats"],
        _lost(hosts) - lost_before,
    )


def runs(workdir: Path) -> Comparison:
    """One clean run, then a lossy run, on the same three hosts.

    The links drop each packet with a probability of 1% (a random cBPF filter, which
    cannot be seeded), and a run of this small model sends about 350 packets (345-351
    in three runs, 3-4 of them lost), so about 3% of lossy runs lose none (0.99^350;
    seen once in a suite run). Such a run proves nothing about loss and is run again,
    up to ``LOSSY_TRIES`` times (all lossless: about 3e-5). The run kept is the first
    that lost a packet, else the last, which the test then refuses: links that lose
    nothing three times running are not lossy.
    """
    with EmulatedHosts(3, CLEAN, prefix="hostilel", relay=True) as hosts:
        clean = _one(hosts, workdir / "clean")
        for i in range(3):
            hosts.reshape(i, LOSSY)
        for attempt in range(LOSSY_TRIES):
            lossy = _one(hosts, workdir / f"lossy{attempt}")
            if lossy.lost_packets:
                break
    return Comparison(clean, lossy)


def compare(workdir: Path) -> dict[str, float]:
    """One clean run, one lossy run on the same hosts; their agreement and speed ratio."""
    return runs(workdir).figures()


def _work(workdir: Path) -> None:
    import torch
    import torch.nn.functional as F

    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    torch.set_num_threads(1)
    strategy = ParameterServerStrategy(mode="sync", deadline_s=120)
    with strategy.scope():
        model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    replica = strategy.worker_index

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    started = time.monotonic()
    for step in range(STEPS):
        if step == WARMUP:  # creating variables and the optimizer is not the link's cost
            started = time.monotonic()
        strategy.run(train, _batch(step, replica))
    seconds = time.monotonic() - started
    strategy.pull_values()
    if strategy.is_chief:
        final = [float(v) for p in model.parameters() for v in p.detach().flatten()]
        (stats,) = strategy.ps_stats()
        (workdir / "final.json").write_text(
            json.dumps({"final": final, "seconds": seconds, "stats": stats})
        )
    strategy.close()


if __name__ == "__main__":
    _work(Path(sys.argv[1]))
