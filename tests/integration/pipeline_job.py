"""One replica of the pipeline tests: ``python pipeline_job.py OUT`` (see test_pipeline.py).

Runs every scenario in one launch, since each replica pays torch's import on two cores:
the synchronous schedules against one process (with a checkpoint the stages write and
``load_module`` joins), PipeDream's weight stashes, and PipeDream against 1F1B on the
digits. Writes ``OUT/<scenario>-<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.stage import _PipelineStageBase

import clusterflow as cf
from clusterflow.train.cut import load_module

ROWS, FEATURES, CLASSES = 64, 6, 3


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, CLASSES),
    )


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, FEATURES, generator=gen), torch.randint(
        0, CLASSES, (ROWS,), generator=gen
    )


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def sync_schedules(out: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    from clusterflow.strategies.pipeline import overlap

    def plain_loop_forbidden(ops: Any) -> Any:
        raise AssertionError("the overlap ran where torch's own schedule should have")

    batch_p2p = overlap._batch_p2p  # the plain loop's own name for it (torch's has its own)
    # Every pass torch makes over a stage's gradients to divide them (sync.py's loss
    # carries the 1/m instead).
    divided: list[int] = []
    scale_grads = _PipelineStageBase.scale_grads

    def recorded(stage: Any, factor: int) -> None:
        divided.append(factor)
        scale_grads(stage, factor)

    _PipelineStageBase.scale_grads = recorded  # type: ignore[method-assign]
    # Each forward ("F", micro-batch) and each zeroing of the gradients ("Z", -1), in
    # order: when the step's own preparation ran (overlap.OverlappedSingle.step).
    events: list[tuple[str, int]] = []
    forward_one_chunk = _PipelineStageBase.forward_one_chunk

    def forward(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
        events.append(("F", chunk))
        return forward_one_chunk(stage, chunk, *args, **kwargs)

    _PipelineStageBase.forward_one_chunk = forward  # type: ignore[method-assign]
    runs = (("gpipe", 4), ("1f1b", 2), ("interleaved", 2), ("1f1b-runtime", 2))
    for name, stages in runs:
        schedule = name.removesuffix("-runtime")
        # "-runtime": torch's own schedule runs, as where torch's private calls differ
        # from the overlap's (overlap.OVERLAP_FITS false, torch 2.11)
        runtime = name.endswith("-runtime")
        overlap.OVERLAP_FITS = not runtime
        overlap._batch_p2p = plain_loop_forbidden if runtime else batch_p2p
        strategy = cf.PipelineStrategy(schedule, microbatches=4, stages=stages)
        with strategy.scope():
            model = mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        zero_grad = optimizer.zero_grad

        def zeroed(set_to_none: bool = True, zero_grad: Any = zero_grad) -> None:
            events.append(("Z", -1))
            zero_grad(set_to_none)

        optimizer.zero_grad = zeroed  # type: ignore[method-assign]
        hooks = []
        ckpt = out / f"ckpt-{schedule}"
        if name == "1f1b":
            hooks.append(cf.Checkpoint(str(ckpt), every_steps=4))
        history = cf.fit(
            model,
            nn.CrossEntropyLoss(),
            optimizer,
            data(),
            strategy=strategy,
            epochs=2,
            global_batch_size=16,
            seed=3,
            hooks=hooks,
            metrics=["accuracy"],
        )
        result[name] = {
            "params": flat(model),
            "loss": history.history["loss"],
            "bounds": [(b.start, b.stop) for b in strategy.bounds],
            "actions": strategy.engine.actions(),  # type: ignore[union-attr]
            "linked": strategy.engine.linked_peers(),  # type: ignore[union-attr]
            "grads_divided": list(divided),
            "events": list(events),
            "stage": strategy.stage,
        }
        divided.clear()
        events.clear()
        if name == "1f1b" and rank == 0:
            joined, step = load_module(str(ckpt), mlp)  # type: ignore[misc]
            result["joined"] = {"params": flat(joined), "step": step}
    return result


def device_blocks() -> list[tuple[int, int]]:
    """Layers built under cf.device blocks go to those tasks' stages (2 of 4 tasks)."""
    strategy = cf.PipelineStrategy("1f1b", microbatches=2, stages=2)
    with strategy.scope():
        with cf.device("/job:worker/task:0"):
            front = [nn.Linear(FEATURES, 16), nn.Tanh()]
        with cf.device("/job:worker/task:1"):
            back = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)]
        model = nn.Sequential(*front, *back)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cf.fit(
        model,
        nn.CrossEntropyLoss(),
        optimizer,
        data(),
        strategy=strategy,
        epochs=1,
        global_batch_size=16,
    )
    return [(b.start, b.stop) for b in strategy.bounds]


def custom_loop(out: Path) -> dict[str, Any]:
    """A TrainingSession loop of one's own, with the step ``train_step`` gives."""
    strategy = cf.PipelineStrategy("gpipe", microbatches=2, stages=2)
    with strategy.scope():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = strategy.train_step(model, nn.CrossEntropyLoss(), optimizer)
    x, y = data()
    rows = slice(8 * strategy.layout.pipeline, 8 * strategy.layout.pipeline + 8)
    losses = []
    hooks = [cf.StopAtStep(6), cf.Checkpoint(str(out / "ckpt-loop"), every_steps=3)]
    with cf.TrainingSession(
        strategy=strategy, model=model, optimizer=optimizer, hooks=hooks
    ) as session:
        while not session.should_stop():
            loss, _ = session.run_step(step, x[rows], y[rows], 1.0)
            losses.append(float(strategy.reduce("mean", loss)))
    return {"step": session.step, "losses": losses}


def pipedream(out: Path, rank: int) -> dict[str, Any]:
    result = _pipedream(two_bw=False)
    result["2bw"] = _pipedream(two_bw=True)
    result["device_bounds"] = device_blocks()
    result["loop"] = custom_loop(out)
    result["outputs_early"] = outputs_early(out)
    return result


def outputs_early(out: Path, steps: int = 2) -> dict[str, Any]:
    """PipeDream, 2 micro-batches on 2 stages: stage 0's step returns (with the batch's
    outputs) while the last stage has yet to run its last micro-batch's backward.

    The last stage's loss function, called in that backward, waits until stage 0 has
    said (in a FileStore) that its step returned; a step that made stage 0 wait for the
    last stage's whole step would keep it from ever saying so, and the wait runs out
    (recorded, not raised, so both stages finish the run)."""
    strategy = cf.PipelineStrategy("pipedream", microbatches=2, stages=2)
    with strategy.scope():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    store = dist.FileStore(str(out / f"outputs-early-{strategy.layout.pipeline}"), 2)
    waits: list[bool] = []
    calls = [0]
    criterion = nn.CrossEntropyLoss()

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The last stage calls it per micro-batch in its backward, then once for the
        # step's loss: 3 calls a step; the second is the last micro-batch's backward.
        if strategy.stage == 1 and calls[0] % 3 == 1:
            try:
                store.wait([f"returned-{calls[0] // 3}"], timedelta(seconds=15))
                waits.append(True)
            except RuntimeError:  # FileStore: "Wait timeout"
                waits.append(False)
        calls[0] += 1
        return criterion(outputs, targets)

    step = strategy.train_step(model, loss_fn, optimizer)
    x, y = data()
    losses = []
    for k in range(steps):
        loss, outputs = step(x[:16], y[:16], 1.0)
        losses.append(loss.item())
        if strategy.stage == 0:
            store.set(f"returned-{k}", "1")
    strategy.refresh_model()
    return {"stage": strategy.stage, "waits": waits, "losses": losses, "rows": len(outputs)}


def _pipedream(two_bw: bool) -> dict[str, Any]:
    strategy = cf.PipelineStrategy(
        "pipedream", microbatches=4, stages=2, record_stashes=True, two_bw=two_bw
    )
    with strategy.scope():
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cf.fit(
        model,
        nn.CrossEntropyLoss(),
        optimizer,
        data(),
        strategy=strategy,
        epochs=2,
        global_batch_size=16,
        seed=3,
    )
    engine = strategy.engine
    records = [r for r in engine.records] if engine is not None else []  # type: ignore[union-attr]
    return {
        "params": flat(model),
        "stage": strategy.stage,
        "versions": engine.versions_made,  # type: ignore[union-attr]
        "bounds": [(b.start, b.stop) for b in strategy.bounds],
        "records": [
            (
                r.microbatch,
                r.forward_version,
                r.backward_version,
                r.live_version,
                r.stash_checksum,
                r.forward_checksum,
                r.live_checksum,
            )
            for r in records
        ],
    }


def digits(out: Path, rank: int) -> dict[str, Any]:
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all / 16.0, dtype=torch.float32)
    y = torch.tensor(y_all)
    train, test = slice(0, 1408), slice(1408, None)
    result = {}
    for schedule in ("1f1b", "pipedream"):
        strategy = cf.PipelineStrategy(schedule, microbatches=4, stages=2)
        with strategy.scope():
            torch.manual_seed(1)
            model = nn.Sequential(
                nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        cf.fit(
            model,
            nn.CrossEntropyLoss(),
            optimizer,
            (x[train], y[train]),
            strategy=strategy,
            epochs=6,
            global_batch_size=64,
            seed=5,
        )
        with torch.no_grad():
            accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        result[schedule] = accuracy
    return result


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    for name, scenario in (("sync", sync_schedules), ("pipedream", pipedream), ("digits", digits)):
        torch.save(scenario(out, rank), out / f"{name}-{rank}.pt")


if __name__ == "__main__":
    main()
