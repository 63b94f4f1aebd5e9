"""Interrupted runs continue from their checkpoint: ``TrainingSession`` and ``fit`` restarts.

A run is stopped (``StopAtStep``) or killed (SIGKILL, mid-run) and started again on a
fresh model with the same ``Checkpoint`` directory: it resumes at the saved step and
ends where one uninterrupted run ends, bit for bit in one process and up to float
reordering across replicas. This file is also the job's program:
``python test_session_in_cluster.py DIR STOP KILL_AT OUT`` runs one task of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

PY = sys.executable
EVERY = 5
LAST = 20


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: a function of the step, so resuming needs no skipping."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 3))


def run_session(
    strategy: Any, directory: Path | None, stop: int, kill_at: int = 0, seed: int = 0
) -> tuple[nn.Module, int]:
    """Trains to ``stop``; returns the model and the step the session started at."""
    from clusterflow.train import Checkpoint, StopAtStep, TrainingSession

    with strategy.scope() if strategy is not None else _Nothing():
        model = make_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    hooks: list[Any] = [StopAtStep(stop)]
    if directory is not None:
        hooks.append(Checkpoint(directory, every_steps=EVERY))
    with TrainingSession(
        strategy=strategy, model=model, optimizer=optimizer, hooks=hooks
    ) as session:
        started = session.step
        print(f"start step {started}", flush=True)
        while not session.should_stop():
            batch = global_batch(session.step)
            if strategy is not None:
                batch = next(iter(strategy.distribute([batch], 16)))
            session.run_step(step, *batch)
            if session.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no end, no final save
    return model, started


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def straight() -> torch.Tensor:
    """One uninterrupted run to LAST."""
    model, _ = run_session(None, None, LAST)
    return flat(model)


@pytest.mark.timeout(60)
def test_a_stopped_session_resumes_at_its_step_on_a_fresh_model(
    tmp_path: Path, straight: torch.Tensor
) -> None:
    _, started = run_session(None, tmp_path, 12)
    assert started == 0
    model, started = run_session(None, tmp_path, LAST, seed=99)  # other initial weights
    assert started == 12  # the final save of the stopped run, off the 5-step schedule
    torch.testing.assert_close(flat(model), straight, rtol=0, atol=0)


@pytest.mark.timeout(90)
def test_a_killed_run_resumes_from_its_last_checkpoint(
    tmp_path: Path, straight: torch.Tensor
) -> None:
    killed = subprocess.run(
        [PY, __file__, str(tmp_path / "ckpt"), str(LAST), "13", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    model, started = run_session(None, tmp_path / "ckpt", LAST, seed=99)
    assert started == 10  # the last scheduled save before the kill at 13
    torch.testing.assert_close(flat(model), straight, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_a_stopped_fit_resumes_on_the_same_global_batches(tmp_path: Path) -> None:
    from clusterflow.train import Checkpoint, StopAtStep, fit

    gen = torch.Generator().manual_seed(3)
    data = torch.randn(100, 6, generator=gen), torch.randint(0, 3, (100,), generator=gen)

    def run(seed: int, hooks: list[Any]) -> tuple[nn.Module, Any]:
        model = make_model(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        history = fit(
            model,
            nn.CrossEntropyLoss(),
            opt,
            data,
            epochs=3,
            global_batch_size=16,
            seed=4,
            hooks=hooks,
        )
        return model, history

    expected, _ = run(0, [])
    run(0, [Checkpoint(tmp_path, every_steps=4), StopAtStep(10)])  # 7 steps per epoch
    resumed, history = run(99, [Checkpoint(tmp_path, every_steps=4)])
    assert history.epoch == [1, 2] and history.step == 21
    torch.testing.assert_close(flat(resumed), flat(expected), rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_mirrored_replicas_stopped_and_restarted_resume_together(
    cf: Clusterflow, tmp_path: Path, straight: torch.Tensor
) -> None:
    ckpt = tmp_path / "ckpt"
    for stop in (12, LAST):
        done = cf.run(
            "start",
            "--workers",
            "2",
            "--",
            PY,
            __file__,
            str(ckpt),
            str(stop),
            "0",
            str(tmp_path),
            timeout=150,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[worker:0] start step 12" in done.stdout and "[worker:1] start step 12" in done.stdout
    for rank in range(2):
        got = torch.load(tmp_path / f"worker-{rank}.pt")
        torch.testing.assert_close(got, straight, rtol=1e-5, atol=1e-5)


def task_main(directory: Path, stop: int, kill_at: int, out: Path) -> None:
    from clusterflow.cluster import TFConfig
    from clusterflow.strategies import MultiWorkerMirroredStrategy

    torch.set_num_threads(1)
    strategy = MultiWorkerMirroredStrategy()  # alone: one replica
    model, _ = run_session(strategy, directory, stop, kill_at)
    config = TFConfig.from_env()
    name = str(config.task).replace(":", "-") if config and config.task else "alone"
    torch.save(flat(model), out / f"{name}.pt")


if __name__ == "__main__":
    task_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
