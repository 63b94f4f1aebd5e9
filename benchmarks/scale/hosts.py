"""The data-plane half of ``benchmarks.scale``: per-worker steps/s on emulated hosts.

Every worker and every ps shard is a process on its own emulated host
(``clusterflow.testing``: a network namespace with a private address, its link shaped
by tc). **Bytes and link rate are scaled down together** (``SCALE``): a 10 Gbit/s link
carrying a model of 100 MB is emulated as a 10/SCALE Gbit/s link carrying 100/SCALE MB.
Every transfer then takes the time it takes at full size, while the two cores of this
machine move SCALE times fewer bytes: measured here, one Python TCP stream over a veth
moves about 2 Gbit/s with a whole core, so at full size the CPU, not the link, would set
every figure. What is not scaled: per-message costs (RPC, Python, the kernel), which are
real and so count against every design here more than they would at full size.

Compute is **emulated** (``agent.Emulated``): a step sleeps its compute time, as a
GPU computes while the CPU waits. Communication is real: clusterflow's RPC and ps, gloo.

Sides at each size N (N workers, each on its own host):
* ``async{S}``: ``ParameterServerStrategy`` async, S ps shards (S hosts), pushes
  overlapped with the next step (the default);
* ``sync``: the same, sync mode, ``SYNC_SHARDS`` shards;
* ``ring``: ``MultiWorkerMirroredStrategy`` over gloo's ring;
* ``ddp``: hand-written ``DistributedDataParallel`` on the same group.
At the largest size and at every size from ``EXTRAS_FROM`` on, also: ``async_slow`` and
``ddp_slow`` (the last worker computes 20% longer: a straggler) and ``ring_heavy`` and
``ring_heavy_bf16`` (a model of 4x the bytes per compute, fp32 against bf16 compression).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Spread, alternate

REPO = Path(__file__).resolve().parents[2]
SCALE = 200
"""Link rate and bytes are divided by this (module docstring)."""
LINK_BIT = 10_000_000_000
"""The emulated line rate of every host: 10 Gbit/s (shaped at LINK_BIT / SCALE)."""
COMPUTE_S = 0.3
"""Emulated compute per step (a ResNet-50-sized step on one GPU)."""
LAYERS = 8
"""The model's square layers: equal variables, so 1/2/4/8 shards split them evenly."""
WIDTH = 128
"""8 layers of WIDTH x WIDTH fp32: 0.5 MiB, i.e. 100 MiB at full size (ResNet-50's ~25M)."""
HEAVY_WIDTH = 256
"""4x the bytes per compute (400 MiB at full size, ~BERT-base): where bytes dominate."""
BUCKET_BYTES = 25 * 2**20 // SCALE
"""DDP's default 25 MiB bucket, scaled like every other byte."""
SHARDS = (1, 2, 4, 8)
WIDE_SHARDS, WIDE_FROM = 16, 32
"""From 32 workers on, 16 shards too: the measured rule S >= N / 2 (docs/scaling.md). The
8 layers are then each split in two (``MinSizePartitioner``), one half per shard."""
SYNC_SHARDS = 4
STRAGGLER = 1.2
EXTRAS_FROM = 8
"""The straggler and bf16 sides run at this size and above (and at the largest)."""
REPLY_TIMEOUT_S = 300.0


def shard_counts(n: int) -> tuple[int, ...]:
    """The async ps's shard counts measured at ``n`` workers."""
    return (*SHARDS, WIDE_SHARDS) if n >= WIDE_FROM else SHARDS


class AgentFailed(SystemExit):
    pass


class Agent:
    """One host's ``agent`` process: JSON commands in, JSON answers out."""

    def __init__(self, host: Any, log_dir: Path, replica: int = 0) -> None:
        self.host = host
        self.address: str = host.address
        env = dict(os.environ)
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
        # Compute is emulated (a step sleeps its GPU time) on CPU tensors; on a machine
        # with a GPU the strategies would place the model on it (docs/gpu.md) and the
        # emulated step's CPU inputs would not match (seen on an H100 host, 2026-11-27).
        env["CUDA_VISIBLE_DEVICES"] = ""
        self.log = open(log_dir / f"agent-{host.index}-{replica}.log", "w")  # noqa: SIM115
        self.proc = host.popen(
            [sys.executable, "-m", "benchmarks.scale.agent", self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=REPO,
            env=env,
        )

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            if not ready:
                raise AgentFailed(f"benchmark failed: host {self.address} did not answer")
            line = self.proc.stdout.readline()
            if not line:
                raise AgentFailed(
                    f"benchmark failed: host {self.address}'s process died (see {self.log.name})"
                )
            if line.startswith("@@ "):
                reply = json.loads(line[3:])
                if "error" in reply:
                    raise AgentFailed(f"benchmark failed on {self.address}: {reply['error']}")
                return reply["ok"]

    def call(self, op: str, **args: Any) -> Any:
        self.send(op, **args)
        return self.recv()

    def close(self) -> None:
        try:
            self.send("exit")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
        self.log.close()


def fan(agents: list[Agent], op: str, per: Any = None, **args: Any) -> list[Any]:
    """Sends ``op`` to every agent (``per(i)`` adds per-agent arguments), then reads all."""
    for i, agent in enumerate(agents):
        agent.send(op, **args, **(per(i) if per else {}))
    return [agent.recv() for agent in agents]


@dataclass
class Figures:
    """Per-worker steps/s of each side at each size (median over rounds and spread)."""

    per_worker: dict[str, dict[int, Spread]] = field(default_factory=dict)
    cluster: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    """Per side and size, per round: steps/s of the whole cluster (straggler, bf16)."""
    cpu_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per side and size: a worker's CPU per step (ms; median over rounds, mean over
    workers), what the step costs the host's CPU besides the emulated compute."""


class Sweep:
    """The emulated cluster: ``max_workers`` worker hosts and as many ps hosts as the
    most shards measured at that size."""

    def __init__(
        self,
        max_workers: int,
        steps: int,
        rounds: int,
        verbose: bool,
        only: frozenset[str] | None = None,
    ) -> None:
        from clusterflow.rpc import Credentials
        from clusterflow.testing import EmulatedHosts, LinkShape

        self.steps, self.rounds, self.verbose = steps, rounds, verbose
        self.only = only
        self.secret = Credentials.generate().secret.hex()
        self.ports = itertools.count(21000)
        self.log_dir = Path(tempfile.mkdtemp(prefix="cf-scale-"))
        shape = LinkShape(rate_bit=LINK_BIT // SCALE)
        shards = max(self._shards_used(max_workers) or [0])
        self.hosts = EmulatedHosts(max_workers + shards, shape, prefix="cfscale")
        agents = [Agent(h, self.log_dir) for h in self.hosts.hosts]
        for agent in agents:
            agent.recv()  # the greeting: torch imported, ready
        rss = sum(_rss_bytes(a.proc.pid) for a in agents)
        print(f"{len(agents)} host processes started: {rss / 2**30:.1f} GiB resident", flush=True)
        self.workers = agents[:max_workers]
        self.ps = agents[max_workers:]

    def close(self, keep_logs: bool) -> None:
        """Stops the agents and the hosts; the agents' logs are kept (and said where)
        after a failure or with ``--verbose``, else removed."""
        for agent in self.workers + self.ps:
            agent.close()
        self.hosts.close()
        if keep_logs:
            print(f"host agents' logs: {self.log_dir}", flush=True)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _wanted(self, side: str) -> bool:
        return self.only is None or side in self.only

    def _async_counts(self, n: int) -> list[int]:
        """The async ps's shard counts measured at ``n`` workers: those named, at every
        size (so the 1-worker base exists for each), else ``shard_counts``."""
        if self.only is None:
            return list(shard_counts(n))
        return sorted(int(side[5:]) for side in self.only if side.startswith("async"))

    def _shards_used(self, n: int) -> list[int]:
        """The ps hosts' counts the sides measured at ``n`` workers need."""
        return self._async_counts(n) + ([SYNC_SHARDS] if self._wanted("sync") else [])

    # one size ------------------------------------------------------------------------

    def _ps_side(self, name: str, workers: list[Agent], shards: int, **opts: Any) -> list[str]:
        """Starts ``shards`` ps servers and joins ``workers``; returns the server names."""
        port = next(self.ports)
        spec = {
            "ps": [f"{a.address}:{port}" for a in self.ps[:shards]],
            "worker": [f"{a.address}:{port}" for a in workers],
        }
        fan(
            self.ps[:shards],
            "ps_start",
            lambda i: {"index": i},
            name=name,
            spec=spec,
            secret=self.secret,
        )
        fan(
            workers,
            "ps_join",
            lambda i: {"rank": i},
            name=name,
            spec=spec,
            secret=self.secret,
            **opts,
        )
        return [name] * shards

    def size(self, n: int, extras: bool) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
        """Every side's windows at ``n`` workers: per round, each worker's steps/s; and
        each side's CPU per step per worker (ms)."""
        workers = self.workers[:n]
        names: list[str] = []
        for shards in self._async_counts(n):
            split = {"split": shards // LAYERS} if shards > LAYERS else {}
            self._ps_side(f"async{shards}", workers, shards, mode="async", width=WIDTH, **split)
            names.append(f"async{shards}")
        if self._wanted("sync"):
            self._ps_side("sync", workers, SYNC_SHARDS, mode="sync", width=WIDTH)
            names.append("sync")
        collective = [side for side in ("ring", "ddp") if self._wanted(side)]
        if collective:
            port = next(self.ports)
            fan(
                workers,
                "dist_init",
                lambda i: {"rank": i},
                master=workers[0].address,
                port=port,
                world=n,
            )
        if "ring" in collective:
            fan(
                workers,
                "ring_join",
                name="ring",
                width=WIDTH,
                bf16=False,
                bucket_bytes=BUCKET_BYTES,
            )
        if "ddp" in collective:
            fan(workers, "ddp_join", name="ddp", width=WIDTH, bucket_bytes=BUCKET_BYTES)
        names += collective
        sides = {name: name for name in names}
        if extras and self.only is None:
            for bf16 in (False, True):
                name = "ring_heavy_bf16" if bf16 else "ring_heavy"
                fan(
                    workers,
                    "ring_join",
                    name=name,
                    width=HEAVY_WIDTH,
                    bf16=bf16,
                    bucket_bytes=BUCKET_BYTES,
                )
                sides[name] = name
            sides["async_slow"] = f"async{max(SHARDS)}"
            sides["ddp_slow"] = "ddp"
        windows: dict[str, list[list[float]]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}

        def window(side: str, record: bool = True) -> float:
            slow = side.endswith("_slow")

            def per(i: int) -> dict[str, float]:
                factor = STRAGGLER if slow and i == n - 1 else 1.0
                return {"compute_s": COMPUTE_S * factor}

            spans = fan(workers, "window", per, name=sides[side], steps=self.steps)
            rates = [self.steps / (end - start) for start, end, _ in spans]
            if record:
                windows[side].append(rates)
                cpu[side].append(1000 * sum(c for _, _, c in spans) / n / self.steps)
            return sum(rates) / n

        for target in sides.values():  # untimed: connections, first pull, first buckets
            fan(workers, "warm", name=target, steps=1, compute_s=COMPUTE_S)
        alternate(
            {side: (lambda s=side: window(s)) for side in sides},
            self.rounds,
            verbose=self.verbose,
            warmup=False,
        )
        for name in names:
            if name.startswith(("async", "sync")):
                fan(workers, "drop", name=name)
                fan(
                    self.ps[: SYNC_SHARDS if name == "sync" else int(name[5:])],
                    "ps_stop",
                    name=name,
                )
        if collective:
            fan(workers, "dist_destroy")
        return windows, {side: Spread.of(ms).median for side, ms in cpu.items() if ms}


def _rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    kib = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(kib[0]) * 1024 if kib else 0


def run(
    sizes: list[int], steps: int, rounds: int, verbose: bool, only: frozenset[str] | None = None
) -> Figures:
    """Every size's figures; ``only`` names the sides to measure (all by default, and the
    straggler and bf16 sides only then): one side at 32 workers fits a device call where
    all of them did not (docs/gpu.md)."""
    figures = Figures()
    sweep = Sweep(max(sizes), steps, rounds, verbose, only)
    try:
        for n in sizes:
            started = time.perf_counter()
            windows, cpu_ms = sweep.size(n, extras=n == max(sizes) or n >= EXTRAS_FROM)
            for side, ms in cpu_ms.items():
                figures.cpu_ms.setdefault(side, {})[n] = ms
            for side, per_round in windows.items():
                if side.endswith("_slow") or side.startswith("ring_heavy"):
                    figures.cluster.setdefault(side, {})[n] = [sum(r) for r in per_round]
                else:
                    mean = [sum(r) / len(r) for r in per_round]
                    figures.per_worker.setdefault(side, {})[n] = Spread.of(mean)
            print(
                f"{n} workers ({time.perf_counter() - started:.0f} s): "
                + ", ".join(
                    f"{side} {figures.per_worker[side][n].median:.2f}"
                    for side in figures.per_worker
                    if n in figures.per_worker[side]
                )
                + " steps/s per worker; CPU per step per worker: "
                + ", ".join(f"{side} {ms:.0f} ms" for side, ms in cpu_ms.items()),
                flush=True,
            )
    except BaseException:
        sweep.close(keep_logs=True)
        raise
    sweep.close(keep_logs=verbose)
    return figures


def save(figures: Figures, path: Path) -> None:
    """The curves as JSON, so runs of different sizes can be plotted together."""
    data = {
        "per_worker": {
            side: {str(n): [sp.median, sp.low, sp.high, sp.count] for n, sp in curve.items()}
            for side, curve in figures.per_worker.items()
        },
        "cluster": {
            side: {str(n): rounds for n, rounds in by_size.items()}
            for side, by_size in figures.cluster.items()
        },
        "cpu_ms": {side: {str(n): ms for n, ms in c.items()} for side, c in figures.cpu_ms.items()},
    }
    path.write_text(json.dumps(data, indent=1))


def load(paths: list[Path]) -> Figures:
    """Figures merged from ``save`` files; a size measured twice keeps the later file's."""
    figures = Figures()
    for path in paths:
        data = json.loads(path.read_text())
        for side, curve in data["per_worker"].items():
            for n, (median, low, high, count) in curve.items():
                spread = Spread(median, low, high, int(count))
                figures.per_worker.setdefault(side, {})[int(n)] = spread
        for side, by_size in data["cluster"].items():
            for n, rounds in by_size.items():
                figures.cluster.setdefault(side, {})[int(n)] = rounds
        for side, c in data.get("cpu_ms", {}).items():
            for n, ms in c.items():
                figures.cpu_ms.setdefault(side, {})[int(n)] = ms
    return figures
