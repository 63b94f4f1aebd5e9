"""``fit`` on real clusters equals ``fit`` in one process; summaries come from the chief alone.

This file is also the tasks' program: ``python test_fit_in_cluster.py STRATEGY OUT LOGS`` runs
one task's ``fit`` and saves its final parameters to ``OUT/<task>.pt``. The test runs the
same function in its own process with no strategy and compares: with the same global
batches and seed, all-reduce and a synchronous parameter server take the single
process's steps (up to float reordering). The data has an uneven final batch (203 rows
in batches of 32), so the loss scaling of a partial batch is checked too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable
EPOCHS = 2
STEPS = EPOCHS * 7  # 203 rows: 6 batches of 32 and one of 11 per epoch
TOLERANCE = 1e-5  # float sums in another order: two half-batch means against one mean


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(203, 8, generator=gen), torch.randint(0, 4, (203,), generator=gen)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def train(
    strategy: Any, log_dir: str | None, checkpoints: str | None = None
) -> tuple[nn.Module, Any]:
    """The training every task (and the reference) runs."""
    from clusterflow.train import Checkpoint, Summary, fit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    scope = strategy.scope() if strategy is not None else _nothing()
    with scope:
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    hooks: list[Any] = [Summary(log_dir, every_steps=2)] if log_dir else []
    if checkpoints:
        hooks.append(Checkpoint(checkpoints, every_steps=7))  # the last step is one of them
    history = fit(
        model,
        nn.CrossEntropyLoss(),
        optimizer,
        make_data(),
        strategy=strategy,
        epochs=EPOCHS,
        global_batch_size=32,
        metrics=["accuracy"],
        hooks=hooks,
        seed=5,
    )
    return model, history


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def task_main(kind: str, out: Path, log_dir: str) -> None:
    """One task of a cluster: trains, then writes its parameters, pid and history."""
    from clusterflow.cluster import TFConfig

    if kind == "mirrored":
        from clusterflow.strategies import MultiWorkerMirroredStrategy

        strategy: Any = MultiWorkerMirroredStrategy()
    else:
        from clusterflow.strategies.parameter_server import ParameterServerStrategy

        strategy = ParameterServerStrategy(mode="sync")
    model, history = train(strategy, log_dir, str(out / "checkpoints"))
    config = TFConfig.from_env()
    name = str(config.task).replace(":", "-") if config and config.task else "alone"
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}.pt")
    facts = {"pid": os.getpid(), "is_chief": strategy.is_chief, "history": history.history}
    (out / f"{name}.json").write_text(json.dumps(facts))
    if kind != "mirrored":
        strategy.close()


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    model, history = train(None, None)
    return model.state_dict(), history.history


def _run(cf: Clusterflow, tmp_path: Path, jobs: list[str], kind: str) -> tuple[Path, Path, str]:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    done = cf.run("start", *jobs, "--", PY, __file__, kind, str(out), str(logs), timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, logs, done.stdout


def _assert_equal_to_reference(
    out: Path, tasks: list[str], reference: tuple[dict[str, torch.Tensor], dict[str, list[float]]]
) -> None:
    state, _ = reference
    for task in tasks:
        got = torch.load(out / f"{task}.pt")
        for name, want in state.items():
            torch.testing.assert_close(got[name], want, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def _histories(out: Path, tasks: list[str]) -> list[dict[str, list[float]]]:
    return [json.loads((out / f"{task}.json").read_text())["history"] for task in tasks]


def _event_files(logs: Path) -> list[Path]:
    return sorted(p for p in logs.rglob("events.out.tfevents.*"))


@pytest.mark.timeout(180)
def test_mirrored_fit_on_two_workers_equals_one_process_and_only_the_chief_writes_summaries(
    cf: Clusterflow,
    tmp_path: Path,
    reference: tuple[dict[str, torch.Tensor], dict[str, list[float]]],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs, _ = _run(cf, tmp_path, ["--workers", "2"], "mirrored")
    _assert_equal_to_reference(out, ["worker-0", "worker-1"], reference)
    # fit reported live figures to the manager, which keeps them in the cluster's state.
    figures = {t["task"]: t.get("step") for t in cf.state(cf.only_id())["tasks"]}
    assert all(isinstance(s, int) and s >= 1 for s in figures.values()), figures

    for history in _histories(out, ["worker-0", "worker-1"]):  # reduced over the replicas
        for name in ("loss", "accuracy"):
            assert history[name] == pytest.approx(reference[1][name], rel=1e-4), name
    chief = json.loads((out / "worker-0.json").read_text())
    other = json.loads((out / "worker-1.json").read_text())
    assert chief["is_chief"] and not other["is_chief"]
    (events_file,) = _event_files(logs)  # one writer
    assert f".{chief['pid']}." in events_file.name  # ... and it was the chief
    events = EventAccumulator(str(logs))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(2, STEPS + 1, 2))
    assert {"samples_per_s", "lr", "accuracy", "epoch/loss", "epoch/accuracy"} <= set(
        events.Tags()["scalars"]
    )
    epoch_loss = [e.value for e in events.Scalars("epoch/loss")]
    assert epoch_loss == pytest.approx(reference[1]["loss"], rel=1e-4)


@pytest.mark.timeout(180)
def test_sync_ps_fit_on_two_workers_equals_one_process(
    cf: Clusterflow,
    tmp_path: Path,
    reference: tuple[dict[str, torch.Tensor], dict[str, list[float]]],
) -> None:
    out, logs, _ = _run(cf, tmp_path, ["--ps", "1", "--workers", "2"], "ps-sync")
    _assert_equal_to_reference(out, ["worker-0", "worker-1"], reference)
    # A parameter-server worker has no collective to reduce with: its History is its own
    # replica's. Weighted by their rows (102 and 101 of each epoch's 203), the two
    # replicas' figures make the single process's.
    first, second = _histories(out, ["worker-0", "worker-1"])
    for name in ("loss", "accuracy"):
        mixed = [(a * 102 + b * 101) / 203 for a, b in zip(first[name], second[name], strict=True)]
        assert mixed == pytest.approx(reference[1][name], rel=1e-4), name
    chief = json.loads((out / "worker-0.json").read_text())
    (events_file,) = _event_files(logs)
    assert f".{chief['pid']}." in events_file.name
    # The finished run's last checkpoint holds every step: the chief's end-of-run cut
    # waits for its own last step to commit (ParameterServerStrategy.quiesce) instead of
    # holding the ps one version short, with the other replica's last push waiting.
    from clusterflow.train.checkpoint import read_final
    from clusterflow.train.cut import load_module

    loaded = load_module(str(out / "checkpoints"), make_model)
    assert loaded is not None
    assert loaded[1] == STEPS and read_final(str(out / "checkpoints")) == STEPS
    for name, want in reference[0].items():
        got = loaded[0].state_dict()[name]
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


if __name__ == "__main__":
    task_main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
