"""TorchRec's side of ``benchmarks.embeddings``: run by the peer venv's python, not ours.

``python -m benchmarks._torchrec_peer ROWS,... BATCH`` starts two gloo ranks that
train the same DLRM-like model with ``DistributedModelParallel``, every table sharded
table-wise (``ShardingType.TABLE_WISE``: TorchRec refuses row-wise on CPU; fused Adagrad
in backward, as TorchRec trains tables), the dense layers data-parallel. It prints
``ready``; then each line ``N`` on stdin runs N steps on both ranks and prints ``start
end`` (the window of both ranks, each past a barrier first); ``quit`` ends it.
Imports only torch, torchrec and numpy: clusterflow is not installed in that venv.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

DIM = 64
DENSE_IN = 13


def top_mlp(tables: int) -> Any:
    """The dense tower over the dense features and ``tables`` pooled embeddings (both
    sides of the benchmark build it here)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(DENSE_IN + DIM * tables, 256),
        nn.ReLU(),
        nn.Linear(256, 64),
        nn.ReLU(),
        nn.Linear(64, 1),
    )


def batches(rank: int, rows: list[int], batch: int, count: int) -> list[Any]:
    """Rank ``rank``'s ``count`` batches: zipf ids per table, dense features, labels.
    ``benchmarks.embeddings`` trains ours on these very batches (the same seeds)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(100 + rank)
    out = []
    for _ in range(count):
        ids = [torch.from_numpy((rng.zipf(1.1, batch) - 1) % r) for r in rows]
        dense = torch.from_numpy(rng.standard_normal((batch, DENSE_IN)).astype("float32"))
        label = torch.from_numpy((rng.random(batch) < 0.3).astype("float32"))
        out.append((ids, dense, label))
    return out


def _rank(rank: int, port: int, rows: list[int], batch: int, pipe: Any) -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)  # the planner's advice, once per rank and table
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    names = [f"t{i}" for i in range(len(rows))]

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"]
                    )
                    for n, r in zip(names, rows, strict=True)
                ],
                device=torch.device("meta"),
            )
            self.mlp = top_mlp(len(rows))

        def forward(self, kjt: Any, dense: torch.Tensor) -> torch.Tensor:
            pooled = self.ebc(kjt).values()
            return self.mlp(torch.cat([dense, pooled], 1)).squeeze(1)

    model = DLRM()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.05})
    # Row-wise is what the issue names, but TorchRec's planner refuses it on CPU
    # ("allowed sharding types: data_parallel, table_wise, column_wise,
    # table_column_wise"); table-wise is its CPU model parallelism (all-to-all per step).
    sharding = os.environ.get("TORCHREC_SHARDING", ShardingType.TABLE_WISE.value)
    constraints = {n: ParameterConstraints(sharding_types=[sharding]) for n in names}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    data = batches(rank, rows, batch, 4)
    keys = [f"f_{n}" for n in names]

    def step(i: int) -> None:
        ids, dense, label = data[i % len(data)]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.cat(ids),
            lengths=torch.ones(len(rows) * batch, dtype=torch.int32),
        )
        loss = nn.functional.binary_cross_entropy_with_logits(dmp(kjt, dense), label)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()

    step(0)
    i = 1
    pipe.send("ready")
    while (n := pipe.recv()) is not None:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            step(i)
            i += 1
        dist.barrier()
        pipe.send((start, time.perf_counter()))
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    rows = [int(r) for r in sys.argv[1].split(",")]
    batch = int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank, args=(rank, port, rows, batch, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for pipe in pipes:
        pipe.recv()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        for pipe in pipes:
            pipe.send(int(line))
        spans = [pipe.recv() for pipe in pipes]
        print(f"{min(s for s, _ in spans)} {max(e for _, e in spans)}", flush=True)
    for pipe in pipes:
        pipe.send(None)
    for proc in procs:
        proc.join(30)


if __name__ == "__main__":
    main()
