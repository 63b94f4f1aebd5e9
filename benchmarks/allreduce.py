"""All-reduce training: MultiWorkerMirroredStrategy against hand-written DDP, same run.

Two worker processes, one torch thread each, batch 128 per worker of synthetic MNIST-
shaped data (784 features, 10 classes), SGD. Each worker forms the gloo group by hand
(``init_process_group``, as a DDP script does) and trains, in alternating timed windows:

* raw: ``DistributedDataParallel(model)`` with torch's defaults, a plain loop;
* ours: the same model created in ``MultiWorkerMirroredStrategy().scope()`` (the strategy
  adopts the group), one ``strategy.run(step)`` per step;
* ours, bf16: the same with ``CommunicationOptions(compression=BF16)`` (large MLP only);
* alone: the model without DDP, each worker on its own: the ceiling without communication.

on the MLPs 784-512-512-10 and 784-4096-4096-10. Figures are samples/s over both
workers. Each RESULT ratio is the median, over rounds, of the two sides' windows of the
same round (``key=median key_min=... key_max=...``); the samples/s printed are each
side's median window.

    python -m benchmarks.allreduce [--quick] [--rounds N]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    report,
    run_ranks,
)

WORKERS = 2
BATCH = 128  # per worker


@dataclass(frozen=True)
class Plan:
    small_rounds: int
    small_steps: int
    """Steps per timed window of the small MLP (about 17 ms each here)."""
    large_rounds: int
    large_steps: int
    """Steps per timed window of the large MLP (about 400 ms each here)."""
    warmup: int


def _mlp(hidden: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def _worker(rank: int, port: int, plan: Plan, conn: Connection | None) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(WORKERS),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORKERS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from clusterflow.strategies import (
        CommunicationOptions,
        Compression,
        MultiWorkerMirroredStrategy,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # by hand, as a DDP script; the strategies adopt it
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, 784, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)

    def looped(model: Any, steps: int, shares: list[float], run: Any = None) -> Any:
        """The side's window: samples/s of both workers; this rank's share of a core
        (its CPU time over the window's wall time) goes to ``shares``."""
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        def window(n: int) -> float:
            dist.barrier()
            cpu = time.process_time()
            start = time.perf_counter()
            for _ in range(n):
                if run is None:
                    step()
                else:
                    run(step)
            dist.barrier()
            elapsed = time.perf_counter() - start
            shares.append((time.process_time() - cpu) / elapsed)
            return WORKERS * BATCH * n / elapsed

        window(plan.warmup)
        shares.clear()
        return lambda: window(steps)

    figures: dict[str, dict[str, list[float]]] = {}
    shares: dict[str, dict[str, list[float]]] = {}
    strategies: list[Any] = []
    for size, hidden, steps, rounds in (
        ("small", 512, plan.small_steps, plan.small_rounds),
        ("large", 4096, plan.large_steps, plan.large_rounds),
    ):
        share = shares[size] = {name: [] for name in ("alone", "raw", "ours", "bf16")}
        sides = {
            # No all-reduce at all: each worker trains alone. The ceiling, to show how much
            # of a step the communication costs.
            "alone": looped(_mlp(hidden), steps, share["alone"]),
            "raw": looped(DistributedDataParallel(_mlp(hidden)), steps, share["raw"]),
        }
        strategy = MultiWorkerMirroredStrategy()
        strategies.append(strategy)
        with strategy.scope():
            model = _mlp(hidden)
        sides["ours"] = looped(model, steps, share["ours"], strategy.run)
        if size == "large":
            bf16 = MultiWorkerMirroredStrategy(CommunicationOptions(compression=Compression.BF16))
            strategies.append(bf16)
            with bf16.scope():
                compressed = _mlp(hidden)
            sides["bf16"] = looped(compressed, steps, share["bf16"], bf16.run)
        # Both workers run the same sequence of windows (every window starts and ends
        # with a barrier); each side was warmed up when it was made.
        figures[size] = alternate(sides, rounds, warmup=False)
    if conn is not None:
        conn.send((figures, shares))
    for strategy in strategies:
        strategy.shutdown()  # they adopted the group: this stops only their heartbeats
    dist.destroy_process_group()


def main() -> None:
    args = parser("allreduce", __doc__).parse_args()
    one_thread_per_process()
    load = MachineLoad()
    # Short windows, many rounds: each round gives one ratio per pair of sides.
    plan = (
        Plan(small_rounds=8, small_steps=30, large_rounds=4, large_steps=3, warmup=2)
        if args.quick
        else Plan(small_rounds=30, small_steps=40, large_rounds=12, large_steps=4, warmup=4)
    )
    if args.rounds:
        plan = replace(plan, small_rounds=args.rounds, large_rounds=args.rounds)
    figures, shares = run_ranks(_worker, WORKERS, plan)
    for size, model in (("small", "784-512-512-10"), ("large", "784-4096-4096-10")):
        best = {name: Spread.of(values).median for name, values in figures[size].items()}
        print(
            f"MLP {model}, median windows: raw DDP {best['raw']:,.0f} samples/s, strategy "
            f"{best['ours']:,.0f}"
            + (f", strategy bf16 {best['bf16']:,.0f}" if "bf16" in best else "")
            + f" (no all-reduce at all: {best['alone']:,.0f})"
        )
        # Where a ratio moves with the load, this shows whether the sides got the same
        # CPU: under contention a rank waiting in an all-reduce loses its core.
        print(
            "  median share of a core rank 0 used in its windows: "
            + ", ".join(
                f"{name} {Spread.of(v[-len(figures[size][name]) :]).median:.0%}"
                for name, v in shares[size].items()
                if v
            )
        )
    spreads = {
        "vs_ddp": ratio(figures["small"]["ours"], figures["small"]["raw"]),
        "vs_ddp_large": ratio(figures["large"]["ours"], figures["large"]["raw"]),
        "bf16_vs_ddp_fp32": ratio(figures["large"]["bf16"], figures["large"]["raw"]),
    }
    report("allreduce", spreads, load.describe())


if __name__ == "__main__":
    main()
