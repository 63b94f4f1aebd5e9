"""Pipeline schedules on a deep MLP: GPipe, 1F1B and PipeDream, in one run.

GPipe and 1F1B run torch's order with every receive posted ahead (the default), 1F1B
also as torch runs it (``1f1b-serial``); PipeDream is ours.

Two stage processes, one torch thread each (one core each), one pipeline of 2 stages:
an MLP of ``LAYERS`` hidden layers of ``WIDTH`` units, cut by parameters, batch
``BATCH`` in ``MICROBATCHES`` micro-batches, SGD. Each schedule is a
``PipelineStrategy`` of its own over the same process pair; the schedules run in
alternating timed windows (each window starts and ends with a barrier; PipeDream's
micro-batches still in flight at a window's end finish in its next window, as in a run
that never flushes).

Figures (each ratio the median over rounds of the same round's windows):

* ``onef1b_vs_gpipe``, ``pipedream_vs_1f1b``, ``pipedream_2bw_vs_1f1b``: samples/s
  (PipeDream updates once per micro-batch; PipeDream-2BW once per batch, as 1F1B).
* ``pipedream_vs_1f1b_flush``: the same with as many micro-batches as stages
  (``FLUSH_MICROBATCHES``), where 1F1B's flush idles a third of each step.
* ``overlap_vs_serial``: 1F1B with every receive posted at the step's start
  (``overlap=True``, the default) over torch's 1F1B as it is (``overlap=False``);
  ``bubble_serial_vs_theory`` is the latter's bubble.
* ``bubble_vs_theory``: 1F1B's measured idle fraction over ``(p-1)/(m+p-1)``. A stage's
  idle fraction is ``1 - busy / t_window``, ``busy`` the wall time its stage spent in
  torch's ``forward_one_chunk`` and ``backward_one_chunk`` during the window (timed by
  wrapping them in this benchmark's processes); the mean over the stages. What is not
  a chunk's compute (waiting for a neighbour, the schedule's own bookkeeping, the
  optimizer step) counts as idle. Timing the compute inside the run, not alone, keeps
  the figure meaningful when other processes slow both compute and waits alike.
* ``memory_1f1b_vs_gpipe``: the peak bytes of activations saved for backward alive at
  once on a stage (torch's saved-tensor hooks, parameters excluded), the larger of the
  two stages, 1F1B over GPipe.

    python -m benchmarks.pipeline [--quick] [--rounds N]
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    result,
    run_ranks,
)

STAGES = 2
WIDTH = 512
LAYERS = 8
BATCH = 256
MICROBATCHES = 8
FLUSH_MICROBATCHES = STAGES
"""Where PipeDream's missing flush matters: as many micro-batches as stages, so the
flush bubble of 1F1B is (p-1)/(m+p-1) = a third of a step with 2 stages."""
SCHEDULES: dict[str, tuple[str, int, bool, bool]] = {
    # name: (schedule, micro-batches, two_bw, overlap)
    "gpipe": ("gpipe", MICROBATCHES, False, True),
    "1f1b": ("1f1b", MICROBATCHES, False, True),
    "1f1b-serial": ("1f1b", MICROBATCHES, False, False),
    "pipedream": ("pipedream", MICROBATCHES, False, True),
    "pipedream-2bw": ("pipedream", MICROBATCHES, True, True),
    "1f1b-flush": ("1f1b", FLUSH_MICROBATCHES, False, True),
    "pipedream-flush": ("pipedream", FLUSH_MICROBATCHES, False, True),
}


@dataclass(frozen=True)
class Plan:
    rounds: int
    steps: int
    """Steps per timed window."""
    warmup: int


def _mlp() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    for _ in range(LAYERS - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def _worker(rank: int, port: int, plan: Plan, conn: Connection | None) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(STAGES),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(STAGES),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from clusterflow.strategies.pipeline.strategy import PipelineStrategy

    busy = [0.0]

    def timed(method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        return wrapper

    stage_base: Any = _PipelineStageBase
    stage_base.forward_one_chunk = timed(stage_base.forward_one_chunk)
    stage_base.backward_one_chunk = timed(stage_base.backward_one_chunk)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the strategies adopt it
    gen = torch.Generator().manual_seed(0)  # the same batch on both stages
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    steps: dict[str, Any] = {}
    strategies: dict[str, Any] = {}
    for schedule, (kind, microbatches, two_bw, overlap) in SCHEDULES.items():
        strategy = PipelineStrategy(kind, microbatches=microbatches, two_bw=two_bw, overlap=overlap)
        with strategy.scope():
            model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
        steps[schedule] = strategy.train_step(model, loss_fn, optimizer)
        strategies[schedule] = strategy

    busy_shares: dict[str, list[float]] = {s: [] for s in SCHEDULES}

    def side(schedule: str) -> Any:
        step = steps[schedule]

        def window(n: int) -> float:
            dist.barrier()
            busy[0] = 0.0
            start = time.perf_counter()
            for _ in range(n):
                step(x, y, 1.0)
            dist.barrier()
            elapsed = time.perf_counter() - start
            busy_shares[schedule].append(busy[0] / elapsed)
            return BATCH * n / elapsed

        window(plan.warmup)
        busy_shares[schedule].clear()
        return lambda: window(plan.steps)

    sides = {name: side(name) for name in SCHEDULES}
    figures = alternate(sides, plan.rounds, warmup=False)

    idle = [1 - share for share in busy_shares["1f1b"]]
    idle_serial = [1 - share for share in busy_shares["1f1b-serial"]]

    # Peak activation bytes saved for backward, on this stage, in one step.
    memory: dict[str, int] = {}
    params = {
        p.untyped_storage().data_ptr() for s in strategies.values() for p in s._model.parameters()
    }
    for schedule in ("gpipe", "1f1b"):
        live = [0, 0]

        def pack(tensor: torch.Tensor, live: list[int] = live) -> Any:
            if tensor.untyped_storage().data_ptr() in params:
                return tensor
            holder = _Held(tensor)
            size = tensor.untyped_storage().nbytes()
            live[0] += size
            live[1] = max(live[1], live[0])
            weakref.finalize(holder, _release, live, size)
            return holder

        def unpack(packed: Any) -> torch.Tensor:
            return packed.tensor if isinstance(packed, _Held) else packed

        dist.barrier()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            steps[schedule](x, y, 1.0)
        memory[schedule] = live[1]

    gathered: list[Any] = [None] * STAGES
    dist.all_gather_object(gathered, {"idle": idle, "idle_serial": idle_serial, "memory": memory})
    if conn is not None:
        conn.send((figures, gathered))
    for s in strategies.values():
        s._drain()
    dist.barrier()
    dist.destroy_process_group()


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


def _release(live: list[int], size: int) -> None:
    live[0] -= size


def main() -> None:
    args = parser("pipeline", __doc__).parse_args()
    one_thread_per_process()
    load = MachineLoad()
    plan = Plan(rounds=4, steps=4, warmup=2) if args.quick else Plan(rounds=12, steps=6, warmup=3)
    if args.rounds:
        plan = Plan(rounds=args.rounds, steps=plan.steps, warmup=plan.warmup)
    figures, stages = run_ranks(_worker, STAGES, plan)
    median = {name: Spread.of(values).median for name, values in figures.items()}
    print(
        f"MLP {WIDTH}x{LAYERS}, {STAGES} stages, batch {BATCH} in {MICROBATCHES} micro-batches, "
        "median windows: "
        + ", ".join(f"{name} {value:,.0f} samples/s" for name, value in median.items())
    )
    theory = (STAGES - 1) / (MICROBATCHES + STAGES - 1)
    rounds = len(figures["1f1b"])
    bubble, bubble_serial = (
        Spread.of(sum(stage[key][i] for stage in stages) / STAGES / theory for i in range(rounds))
        for key in ("idle", "idle_serial")
    )
    for rank, stage in enumerate(stages):
        print(
            f"stage {rank}: 1F1B idle "
            f"{Spread.of(stage['idle'])}; peak saved activations gpipe "
            f"{stage['memory']['gpipe'] / 2**20:.2f} MiB, "
            f"1f1b {stage['memory']['1f1b'] / 2**20:.2f} MiB"
        )
    print(f"theory: idle (p-1)/(m+p-1) = {theory:.3f}")
    memory = max(s["memory"]["1f1b"] for s in stages) / max(s["memory"]["gpipe"] for s in stages)
    spreads: dict[str, float | Spread] = {
        "onef1b_vs_gpipe": ratio(figures["1f1b"], figures["gpipe"]),
        "pipedream_vs_1f1b": ratio(figures["pipedream"], figures["1f1b"]),
        "pipedream_2bw_vs_1f1b": ratio(figures["pipedream-2bw"], figures["1f1b"]),
        "pipedream_vs_1f1b_flush": ratio(figures["pipedream-flush"], figures["1f1b-flush"]),
        "overlap_vs_serial": ratio(figures["1f1b"], figures["1f1b-serial"]),
        "bubble_vs_theory": bubble,
        "bubble_serial_vs_theory": bubble_serial,
        "memory_1f1b_vs_gpipe": memory,
    }
    print(load.describe(), flush=True)
    result("pipeline", **spreads)


if __name__ == "__main__":
    main()
