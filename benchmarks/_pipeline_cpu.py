"""Where a pipeline stage's CPU goes in a step, by part, for one schedule of
``benchmarks.pipeline``.

``benchmarks.pipeline``'s ``bubble_vs_theory`` counts as idle all of a step that is not
a chunk's forward or backward; on a shared machine most of that is waiting for a core,
which no schedule removes. This counts the stage's own CPU instead (``time.thread_time``
of its main thread, and of the whole process), per step, over ``--steps`` steps after a
warm-up, in the benchmark's setting (2 stages, the same MLP, batch and micro-batches):

* ``forward``, ``backward``: inside torch's ``forward_one_chunk``/``backward_one_chunk``;
* ``schedule``: the rest of the schedule's step (the runtime's actions: posting and
  waiting for sends and receives, the loss, the gradient scaling);
* ``outside``: the rest of the training step (``zero_grad``, the optimizer step, the
  last stage's outputs sent or received, the loss for the loop);
* ``threads``: every other thread of the process (gloo's).

    python -m benchmarks._pipeline_cpu [--schedule 1f1b] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import one_thread_per_process, run_ranks
from benchmarks.pipeline import BATCH, SCHEDULES, STAGES, WIDTH, _mlp


def _worker(rank: int, port: int, plan: tuple[str, int], conn: Connection | None) -> None:
    schedule, steps = plan
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

    from clusterflow.strategies.pipeline import sync
    from clusterflow.strategies.pipeline.strategy import PipelineStrategy

    spent = {"forward": 0.0, "backward": 0.0, "engine": 0.0}

    def counted(owner: Any, name: str, part: str) -> None:
        method = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[part] += time.thread_time() - start

        setattr(owner, name, wrapper)

    stage_base: Any = _PipelineStageBase
    counted(stage_base, "forward_one_chunk", "forward")
    counted(stage_base, "backward_one_chunk", "backward")
    counted(sync.SyncEngine, "step", "engine")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    kind, microbatches, two_bw, overlap = SCHEDULES[schedule]
    strategy = PipelineStrategy(kind, microbatches=microbatches, two_bw=two_bw, overlap=overlap)
    with strategy.scope():
        model = _mlp()
    step = strategy.train_step(
        model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.001)
    )
    for _ in range(5):
        step(x, y, 1.0)
    dist.barrier()
    for part in spent:
        spent[part] = 0.0
    wall, main, process = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        step(x, y, 1.0)
    main, process = time.thread_time() - main, time.process_time() - process
    wall = time.perf_counter() - wall
    dist.barrier()
    chunks = spent["forward"] + spent["backward"]
    parts = {
        "wall": wall,
        "forward": spent["forward"],
        "backward": spent["backward"],
        "schedule": spent["engine"] - chunks,
        "outside": main - spent["engine"],
        "threads": process - main,
    }
    gathered: list[Any] = [None] * STAGES
    dist.all_gather_object(gathered, {k: v / steps * 1e3 for k, v in parts.items()})
    if conn is not None:
        conn.send(gathered)
    strategy._drain()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks._pipeline_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    one_thread_per_process()
    stages = run_ranks(_worker, STAGES, (args.schedule, args.steps))
    print(f"{args.schedule}: CPU per step of each stage's process, ms (wall: the step)")
    for rank, parts in enumerate(stages):
        print(f"stage {rank}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
