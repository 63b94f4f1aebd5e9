"""The evaluator never blocks training (docs/architecture.md section 1; docs/concepts.md).

Two evaluators that could only hold training back if training waited for them: one
whose first evaluation does not return until training has ended (a slow evaluator, made
as slow as it can be without a clock), and one stopped with SIGSTOP while it
evaluates (a hung one). In both, the worker goes past its first epoch only once the
evaluator is busy or hung, then trains every step of its data beside it and exits;
the assertions are about what happened, never about how long it took.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable
STEPS = 3 * 4  # 3 epochs of 64 examples in batches of 16

JOB = """
import os, sys, time, torch
from torch import nn
from torch.utils.data import TensorDataset
from clusterflow.train import Checkpoint, Evaluate, Hook, fit, is_evaluator

mode, ckpt, done, go = sys.argv[1:5]
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(64, 4)
data = TensorDataset(x, (x.sum(1) > 0).long())
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def wait_for(path, what):
    deadline = time.monotonic() + 120  # a safety net for a hang, not a measurement
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


class AfterFirstCheckpoint(Hook):
    # The worker goes on past epoch 0 only once the evaluator is busy (slow) or hung
    # (the test stopped it): the rest of training then runs beside it.
    def after_epoch(self, session, epoch, logs):
        if epoch == 0:
            wait_for(go, "the evaluator to be busy")


def evaluate(m):
    if not os.path.exists(done):
        print("evaluating while training runs", flush=True)
        if mode == "slow":
            open(go, "w").close()
            wait_for(done, "training to end")  # returns only once training has ended
    return {"ok": 1.0}


hooks = [Checkpoint(ckpt, every_steps=4), Evaluate(evaluate, directory=ckpt, poll_s=0.1)]
if not is_evaluator():
    hooks.append(AfterFirstCheckpoint())
history = fit(model, nn.CrossEntropyLoss(), opt, data, epochs=3, global_batch_size=16, hooks=hooks)
if is_evaluator():
    print(f"evaluated steps {history.epoch}", flush=True)
else:
    with open(done, "w") as f:
        f.write(str(history.step))
    print(f"trained {history.step} steps", flush=True)
"""


def _task(state: dict[str, object], name: str) -> dict[str, object]:
    tasks = {t["task"]: t for t in state["tasks"]}  # type: ignore[attr-defined]
    return tasks[name]  # type: ignore[no-any-return]


@pytest.mark.timeout(180)
def test_a_slow_evaluator_does_not_hold_training_and_the_run_ends_after_it(
    cf: Clusterflow,
) -> None:
    script = cf.script("job.py", JOB)
    ckpt, done, go = cf.workdir / "ckpt", cf.workdir / "trained", cf.workdir / "busy"
    result = cf.run(
        "start", "--workers", "1", "--evaluator", "--",
        PY, str(script), "slow", str(ckpt), str(done), str(go),
        timeout=150,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    # The evaluator was busy until training had ended: training never waited for it.
    assert "[evaluator:0] evaluating while training runs" in out, out[-3000:]
    assert f"[worker:0] trained {STEPS} steps" in out.splitlines(), out[-3000:]
    assert done.read_text() == str(STEPS)
    # Then it caught up with the final checkpoint, and the run ended.
    evaluated = [line for line in out.splitlines() if "evaluated steps" in line]
    assert len(evaluated) == 1 and evaluated[0].endswith(f", {STEPS}]"), evaluated


@pytest.mark.timeout(180)
def test_a_hung_evaluator_holds_neither_training_nor_the_end_of_the_run(cf: Clusterflow) -> None:
    script = cf.script("job.py", JOB)
    ckpt, done, go = cf.workdir / "ckpt", cf.workdir / "trained", cf.workdir / "hung"
    settings = cf.script("cluster.yaml", "evaluator_grace_s: 2\n")
    proc = cf.popen(
        "start", "-c", str(settings), "--workers", "1", "--evaluator", "--grace", "2", "--",
        PY, str(script), "hung", str(ckpt), str(done), str(go),
    )  # fmt: skip
    assert proc.stdout is not None
    reader = cf.LineReader(proc.stdout)
    reader.wait_for("[evaluator:0] evaluating while training runs", timeout=120)
    cluster_id = cf.only_id()
    # The evaluator's job process (its supervisor is its parent): hang it mid-evaluation.
    # Found by its supervisor's pid: a process forked from the warm server keeps the
    # server's first environment in /proc (docs/architecture.md section 3).
    supervisor = _task(cf.state(cluster_id), "evaluator:0")["pid"]
    (job,) = psutil.Process(supervisor).children()
    job.send_signal(signal.SIGSTOP)
    go.touch()  # the worker trains on past its first epoch only now
    try:
        reader.wait_for(f"[worker:0] trained {STEPS} steps", timeout=120)
        cf.wait_until(
            lambda: _task(cf.state(cluster_id), "worker:0").get("exit_code") == 0,
            60,
            "worker:0 to exit 0",
        )
        assert done.read_text() == str(STEPS)
        assert job.status() == psutil.STATUS_STOPPED  # still hung: nobody waited on it
        # The run then ends by itself: the hung evaluator is stopped after its grace.
        assert proc.wait(timeout=90) == 0
        summary = cf.state(cluster_id).get("summary") or ""
        assert "evaluator:0" in summary and "stopped" in summary, summary
        with contextlib.suppress(psutil.NoSuchProcess):  # gone, or at most unreaped
            assert job.status() == psutil.STATUS_ZOMBIE
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            job.send_signal(signal.SIGCONT)
