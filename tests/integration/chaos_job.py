"""The jobs of the chaos suite: ``python chaos_job.py SCENARIO OUT`` under ``clusterflow start``.

Each scenario trains deterministically (every batch is a function of the step and the
replica), checkpoints with ``Checkpointer`` and resumes from whatever the manager
restores, so a run with any number of SIGKILLs must end where an uninterrupted one ends.
Each step appends a line to ``OUT/steps.log`` (O_APPEND: whole lines from any process):
the test kills only after the run made progress since its last kill. The chief writes
the final parameters to ``OUT/final.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOTAL_STEPS = 300
CHECKPOINT_EVERY = 10
ROWS = 8  # per replica and step


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(ROWS, 6, generator=gen), torch.randint(0, 3, (ROWS,), generator=gen)


def reference(replicas: int) -> list[float]:
    """One process, uninterrupted, on the global batch of every step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(TOTAL_STEPS):
        parts = [batch(step, r) for r in range(replicas)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return flat(model)


def flat(model: nn.Module) -> list[float]:
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def compute() -> None:
    """A fixed amount of work, as a real step's forward and backward would take."""
    a = torch.ones(128, 128)
    for _ in range(30):
        a = torch.tanh(a @ a / 128)


def progress(out: Path, what: str) -> None:
    fd = os.open(out / "steps.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.environ.get('CLUSTERFLOW_TASK')} {what}\n".encode())
    finally:
        os.close(fd)


def sync_ps(out: Path) -> None:
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train.cut import Checkpointer

    strategy = ParameterServerStrategy(mode="sync")
    with strategy.scope():
        model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(strategy, model=model, every_steps=CHECKPOINT_EVERY)
    ckpt.restore()
    # Sync steps are global: every replica computes step v on the values of version v.
    step = strategy.global_step()
    replica = strategy.worker_index

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    while step < TOTAL_STEPS:
        compute()
        strategy.run(train, batch(step, replica))
        step += 1
        progress(out, f"step {step}")
        ckpt.maybe_save(step)
    strategy.pull_values()
    if strategy.is_chief:
        (out / "final.json").write_text(json.dumps(flat(model)))
    strategy.close()


def allreduce(out: Path) -> None:
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy
    from clusterflow.train.cut import Checkpointer

    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=30))
    with strategy.scope():
        model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(strategy, model=model, optimizer=opt, every_steps=CHECKPOINT_EVERY)
    step = ckpt.restore()

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    while step < TOTAL_STEPS:
        compute()
        strategy.run(train, batch(step, strategy.rank))
        step += 1
        progress(out, f"step {step}")
        ckpt.maybe_save(step)
    if strategy.is_chief:
        (out / "final.json").write_text(json.dumps(flat(model)))
    strategy.shutdown()


class Counts(nn.Module):
    """One counter per record (a step adds 1 to the records of its batch), and one
    counter of applied steps per ps shard (both halves of ``applied`` get 1 per step)."""

    def __init__(self, records: int) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(records))
        self.applied = nn.Parameter(torch.zeros(2))


def async_ps(out: Path, path: str, records: int, epochs: int) -> None:
    """A custom loop (``TrainingSession``): the batch's own split keys, no key of ours."""
    from clusterflow.data import distributed_dataset
    from clusterflow.ps.placement import FixedShardsPartitioner
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import TrainingSession

    strategy = ParameterServerStrategy(mode="async", variable_partitioner=FixedShardsPartitioner(2))
    with strategy.scope():
        model = Counts(records)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = distributed_dataset(
        path, batch_size=10, split_size=10, seed=5, epochs=epochs, wait_for_all_acks=True
    )

    def add_one(ids: torch.Tensor) -> None:
        opt.zero_grad()
        # SGD at lr 1: counts[ids] += 1 and applied += 1
        (-model.counts[ids].sum() - model.applied.sum()).backward()
        opt.step()

    with TrainingSession(strategy=strategy, model=model, data=data, report_figures=False) as s:
        for item in data:
            compute()
            s.run_step(add_one, item.data["id"], completes=item)
            progress(out, f"split {item.keys}")
    data.close()
    if strategy.is_chief:
        stats = strategy.ps_stats()
        (out / "final.json").write_text(
            json.dumps(
                {
                    "counts": model.counts.detach().tolist(),
                    "applied": model.applied.detach().tolist(),
                    "ps_stats": stats,
                }
            )
        )
    strategy.close()


# Through fit(): a counter per record, SGD at lr 1, a gradient of -1 at counts[id] -------

FIT_CHECKPOINT_EVERY = 3


class Counter(nn.Module):
    """``counts[i]`` is how often record ``i``'s update was applied (times ``scale``)."""

    def __init__(self, records: int) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.zeros(records))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        compute()
        return self.counts[ids]


class TableCounter(nn.Module):
    """``table[i]`` counts record ``i``'s applied updates: an embedding table on the ps."""

    def __init__(self, records: int) -> None:
        super().__init__()
        self.table = nn.Embedding(records, 1, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        compute()
        return self.table(ids).squeeze(1)


LEADER_WAIT_S = 120.0


def _start_with_the_leader(out: Path, leader: bool) -> None:
    """The first incarnation's other workers start training once the leader does.

    The kills of these runs wait for a checkpoint of the leader's own (``before_kill``),
    and the leader cuts them only from steps it takes. Tasks forked from a warm
    interpreter start in a fraction of a second, and a leader a second or two behind
    (it restores, and tells the manager its folder, before its first step) found every
    split leased by the other two: it took no step, the run ended after 0 kills. Later
    incarnations find the mark and do not wait.
    """
    mark = out / "leader-training"
    if leader:
        mark.touch()
        return
    deadline = time.monotonic() + LEADER_WAIT_S
    while not mark.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no leader started within {LEADER_WAIT_S:g} s")
        time.sleep(0.05)  # a poll of the mark, the condition waited for


def fit_counts(
    out: Path,
    scenario: str,
    path: str,
    records: int,
    epochs: int,
    batch_size: int = 10,
    directory: str | None = None,
) -> None:
    """``clusterflow.fit`` with a data-service client and a Checkpoint hook, as a user
    writes it; the chief writes every record's count to ``final.json``.

    ``batch_size`` above the split size (10) makes every batch span several splits;
    ``directory`` keeps the checkpoints in a folder of the job's own instead of the
    cluster's (the manager learns it from the chief)."""
    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.train import Checkpoint, Hook

    strategy: Any
    if scenario == "fit_allreduce":
        from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy

        strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=30))
        scale = 2.0  # the all-reduce averages the two replicas' gradients
    else:
        from clusterflow.strategies.parameter_server import ParameterServerStrategy

        if scenario == "fit_embedding_ps":
            # The counters are rows of a table sharded over the ps tasks (issue 21).
            strategy = ParameterServerStrategy(mode="async", table_init="zeros")
        elif scenario == "fit_sync_ps":
            # Two replicas, one backup: each step takes the first push, the other is late
            # and its split goes back to the data service.
            strategy = ParameterServerStrategy(mode="sync", backup_workers=1)
        else:
            strategy = ParameterServerStrategy(mode="async")
        scale = 1.0
    with strategy.scope():
        model = TableCounter(records) if scenario == "fit_embedding_ps" else Counter(records)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = distributed_dataset(
        path,
        batch_size=batch_size,
        split_size=10,
        seed=7,
        epochs=epochs,
        wait_for_all_acks=scenario != "fit_allreduce",
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )

    class Logged(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            progress(out, f"step {info.step}")

    def loss_fn(outputs: torch.Tensor, _ids: torch.Tensor) -> torch.Tensor:
        return -outputs.sum() * scale

    if directory is not None:
        _start_with_the_leader(out, strategy.is_chief)
    clusterflow.fit(
        model,
        loss_fn,
        opt,
        data,
        strategy=strategy,
        epochs=epochs,
        hooks=[Checkpoint(directory, every_steps=FIT_CHECKPOINT_EVERY), Logged()],
    )
    data.close()
    if strategy.is_chief:
        if isinstance(model, TableCounter):
            from clusterflow.strategies.embedding import read_table

            counts = read_table(model.table).squeeze(1).tolist()
        else:
            counts = model.counts.detach().tolist()
        (out / "final.json").write_text(json.dumps({"counts": counts}))
    if scenario == "fit_allreduce":
        strategy.shutdown()
    else:
        strategy.close()


def main() -> None:
    torch.set_num_threads(1)
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if scenario == "sync_ps":
        sync_ps(out)
    elif scenario == "allreduce":
        allreduce(out)
    elif scenario == "async_ps":
        async_ps(out, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif scenario.startswith("fit_"):
        batch_size = int(sys.argv[6]) if len(sys.argv) > 6 else 10
        directory = sys.argv[7] if len(sys.argv) > 7 else None
        fit_counts(
            out, scenario, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), batch_size, directory
        )
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
