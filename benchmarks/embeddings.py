"""Embedding tables on parameter servers (issue 21): bytes, async against sync, TorchRec.

A DLRM-like model: 4 ``nn.EmbeddingBag`` tables of 64 columns (1M, 2M, 5M and 10M rows;
``--quick``: 4 x 1M, said in the output), one id per table and sample drawn from a power
law (Zipf, a=1.1), 13 dense features, an MLP 269-256-64-1, batch 2048 per worker,
Adagrad. Two workers and two ps tasks per side, every process on one torch thread; all
sides start first and stay up, then each round runs one timed window of every side in
turn (the others idle), in an order reversed each round (``benchmarks/common.py``).

* ``bytes_vs_dense``: bytes a worker moves per step for the tables (ids and rows pulled,
  ids and gradient rows pushed) / the bytes of pulling the four tables whole.
* ``async_vs_sync``: samples/s of async updates against sync ones, with worker 1 made
  20% slower (it sleeps a quarter of its step time after each step). Dense layers on the
  ps for both (``dense="ps"``): all-reducing them would tie the workers together.
* ``vs_torchrec``: samples/s of async clusterflow (equal workers) against TorchRec's
  ``DistributedModelParallel`` with row-wise sharding over 2 gloo ranks, fused Adagrad,
  run by the peer venv's python (``CLUSTERFLOW_TORCHREC_PYTHON``, default
  ``.venv-peer/bin/python``: torch 2.13.0, torchrec, fbgemm-gpu-cpu). Without it the key
  is left out, and the output says why.
* ``cache_vs_none`` (printed, not a key): a worker row cache of bounded staleness.

    python -m benchmarks.embeddings [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks._torchrec_peer import DIM, batches, top_mlp
from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    report,
    settle,
)

BATCH = 2048
WORKERS = 2
SLOW = 0.25
"""Worker 1 of the slow sides sleeps this share of its step: 1/1.25 = 80% of the speed."""
ROWS_FULL = [1_000_000, 2_000_000, 5_000_000, 10_000_000]
ROWS_QUICK = [1_000_000] * 4
REPLY_TIMEOUT_S = 600.0
ROOT = Path(__file__).resolve().parents[1]


def _recv(conn: Connection, what: str) -> Any:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise SystemExit(f"benchmark failed: no {what} within {REPLY_TIMEOUT_S:g}s")
    return conn.recv()


def _model(rows: list[int]) -> Any:
    from torch import nn

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(r, DIM, mode="sum") for r in rows)
            self.mlp = top_mlp(len(rows))

        def forward(self, ids: list[Any], dense: Any) -> Any:
            import torch

            offsets = torch.arange(BATCH)
            pooled = [t(i, offsets) for t, i in zip(self.tables, ids, strict=True)]
            return self.mlp(torch.cat([dense, *pooled], 1)).squeeze(1)

    return DLRM()


def _ps_task(conn: Connection, spec: dict[str, list[str]], index: int, secret: bytes) -> None:
    """ps task ``index`` of ``spec``: it knows its peers, so a sync step fans out."""
    import torch

    torch.set_num_threads(1)
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials
    from clusterflow.server import Server

    server = Server(spec, "ps", index, credentials=Credentials(secret))
    PSService(server)
    conn.send(server.target)
    settle()
    conn.recv()


def _worker(
    conn: Connection,
    options: dict[str, Any],
    rank: int,
    where: Any,
    rows: list[int],
    slow: bool,
    barrier: Any,
) -> None:
    """One worker of one side; per request ``n`` it times ``n`` steps; ``None`` ends it."""
    import torch
    import torch.nn.functional as F

    from clusterflow.rpc import Credentials
    from clusterflow.strategies import SimpleClusterResolver
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    torch.set_num_threads(1)
    spec, secret = where
    resolver = SimpleClusterResolver(
        spec, task_type="worker", task_id=rank, credentials=Credentials(secret)
    )
    strategy = ParameterServerStrategy(resolver, table_init="uniform", **options)
    with strategy.scope():
        torch.manual_seed(0)
        model = _model(rows)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    data = batches(rank, rows, BATCH, 4)
    tables = strategy._sparse.tables
    assert tables is not None
    delay = slow and rank == 1

    def step(ids: Any, dense: Any, label: Any) -> None:
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(ids, dense), label).backward()
        opt.step()

    conn.send("ready")
    settle()
    i = 0
    while (n := conn.recv()) is not None:
        barrier.wait()
        moved = tables.stats.bytes_pulled + tables.stats.bytes_pushed
        hits = tables.stats.cache_hits
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            strategy.run(step, data[i % len(data)])
            if delay:
                time.sleep(SLOW * (time.perf_counter() - t0))
            i += 1
        strategy.flush()
        after = tables.stats.bytes_pulled + tables.stats.bytes_pushed
        conn.send((start, time.perf_counter(), (after - moved) / n, tables.stats.cache_hits - hits))
    strategy.close()


class _Side:
    """The two workers (and two ps tasks) of one side, idle on their pipes between windows."""

    def __init__(self, name: str, options: dict[str, Any], rows: list[int], slow: bool) -> None:
        from clusterflow.rpc import Credentials

        ctx = mp.get_context("spawn")
        secret = Credentials.generate().secret
        self.name = name
        # Ports held (bound, never listening) while the ps tasks bind them beside: no
        # window for another process (docs/architecture.md section 3).
        self._held = [_reserve() for _ in range(2)]
        spec = {
            "ps": [f"127.0.0.1:{sock.getsockname()[1]}" for sock in self._held],
            "worker": ["127.0.0.1:1", "127.0.0.1:2"],
        }
        self.ps = [_start(_ps_task, spec, i, secret) for i in range(2)]
        self.barrier = barrier = ctx.Barrier(WORKERS)
        self.pipes: list[Connection] = []
        self.procs = []
        self.bytes_per_step: list[float] = []
        self.cache_hits = 0
        for rank in range(WORKERS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(child, options, rank, (spec, secret), rows, slow, barrier),
                daemon=True,
            )
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def ready(self) -> None:
        for pipe in self.pipes:
            if _recv(pipe, f"{self.name} worker ready") != "ready":
                raise SystemExit(f"benchmark failed: a {self.name} worker did not start")

    def window(self, steps: int) -> float:
        for pipe in self.pipes:
            pipe.send(steps)
        spans = [_recv(pipe, f"{self.name} window") for pipe in self.pipes]
        elapsed = max(s[1] for s in spans) - min(s[0] for s in spans)
        self.bytes_per_step.append(sum(s[2] for s in spans) / len(spans))
        self.cache_hits += sum(s[3] for s in spans)
        return WORKERS * steps * BATCH / elapsed

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(30)
            proc.kill()
        for proc, pipe, _ in self.ps:
            with contextlib.suppress(OSError):
                pipe.send("done")
            proc.join(5)
            proc.kill()
        for sock in self._held:
            sock.close()


def _reserve() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _start(target: Any, *args: Any) -> tuple[Any, Connection, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent, _recv(parent, f"greeting from {target.__name__}")


class _TorchRec:
    """TorchRec's side, in the peer venv's python (``_torchrec_peer.py``)."""

    def __init__(self, python: str, rows: list[int]) -> None:
        self.name = "torchrec"
        self.proc = subprocess.Popen(
            [python, "-m", "benchmarks._torchrec_peer", ",".join(map(str, rows)), str(BATCH)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the TorchRec peer did not start (said {line!r})")

    def window(self, steps: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        start, end = (float(v) for v in self.proc.stdout.readline().split())
        return WORKERS * steps * BATCH / (end - start)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _peer_python() -> tuple[str | None, str]:
    """The peer venv's python, or None and why not."""
    python = os.environ.get("CLUSTERFLOW_TORCHREC_PYTHON") or str(ROOT / ".venv-peer/bin/python")
    if not Path(python).exists():
        return None, f"no TorchRec venv at {python} (set CLUSTERFLOW_TORCHREC_PYTHON)"
    probe = subprocess.run(
        [python, "-c", "import torchrec, fbgemm_gpu, torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"torchrec does not import in {python}: {last}"
    return python, f"TorchRec peer: {python} (torch {probe.stdout.strip()})"


def main() -> None:
    args = parser("embeddings", __doc__).parse_args()
    one_thread_per_process()
    load = MachineLoad()
    rows = ROWS_QUICK if args.quick else ROWS_FULL
    rounds = args.rounds or (5 if args.quick else 9)
    steps = 6 if args.quick else 20
    if args.quick:
        print(f"--quick: 4 tables of {rows[0]:,} rows (the full run: {ROWS_FULL})")
    python, why = _peer_python()
    print(why)
    sides: dict[str, Any] = {
        "async_slow": _Side("async_slow", {"mode": "async"}, rows, slow=True),
        "sync_slow": _Side("sync_slow", {"mode": "sync"}, rows, slow=True),
        "async": _Side("async", {"mode": "async"}, rows, slow=False),
        "async_cache": _Side(
            "async_cache",
            {"mode": "async", "row_cache_steps": 4, "row_cache_rows": 4096},
            rows,
            slow=False,
        ),
    }
    if python is not None:
        sides["torchrec"] = _TorchRec(python, rows)
    try:
        for side in list(sides.values()):
            try:
                side.ready()
            except RuntimeError as exc:
                print(f"vs_torchrec left out: {exc}")
                side.stop()
                del sides[side.name]
        rates = alternate(
            {name: (lambda s=side: s.window(steps)) for name, side in sides.items()},
            rounds,
            verbose=args.verbose,
        )
    finally:
        for side in sides.values():
            side.stop()
    table_bytes = sum(rows) * DIM * 4
    per_step = Spread.of(sides["async"].bytes_per_step[-rounds:])
    print(
        f"DLRM-like, batch {BATCH}/worker, {steps} steps a window, median samples/s over "
        f"{rounds} rounds: "
        + ", ".join(f"{k} {Spread.of(v).median:,.0f}" for k, v in rates.items())
    )
    print(f"table bytes moved per worker step: {per_step} of {table_bytes:,} (tables whole)")
    cached = Spread.of(sides["async_cache"].bytes_per_step[-rounds:])
    print(
        f"row cache (4 steps, 4096 rows/table): bytes/step {cached.median:,.0f} against "
        f"{per_step.median:,.0f}; samples/s cache_vs_none "
        f"{ratio(rates['async_cache'], rates['async'])}"
    )
    figures: dict[str, Spread] = {
        "bytes_vs_dense": Spread.of(
            b / table_bytes for b in sides["async"].bytes_per_step[-rounds:]
        ),
        "async_vs_sync": ratio(rates["async_slow"], rates["sync_slow"]),
    }
    if "torchrec" in rates:
        figures["vs_torchrec"] = ratio(rates["async"], rates["torchrec"])
    report("embeddings", figures, load.describe())


if __name__ == "__main__":
    main()
