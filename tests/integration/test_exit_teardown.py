"""A finished job's process group is freed before its interpreter exits, from Python.

Why this matters (docs/failure-semantics.md, "Process exit"): a gloo group alive at
interpreter exit keeps worker threads that may still have to take the GIL to drop a
finished collective's tensors; one that wakes while Python finalizes is ended with
``pthread_exit`` inside torch's ``noexcept`` code and the process aborts (SIGABRT, exit
134) after training finished, rarely (about 1 run in 25 on a loaded machine). A group
freed from C++ instead (its last reference a DDP reducer's) is destroyed with the GIL
held and can hang on such a thread. Both are races, but their preconditions are not:
these tests assert, in each replica, that no gloo thread is left when the function that
frees the group returns (a profile hook) and when the last exit hook runs. The probe
registers its exit hook before the job starts, so it runs after every hook the job
registers (atexit is LIFO)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
LEFT = re.compile(r"\[(worker:\d)\] gloo threads at exit: (\[.*\])")
RETURNED = re.compile(r"\[(worker:\d)\] gloo threads when it returns: (\[.*\])")

PROBE = textwrap.dedent(
    """
    import atexit, os, runpy, sys

    def gloo_threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if "gloo" in name:  # pt_gloo_runloop (its workers), gloo_tcp_loop
                names.append(name)
        return sorted(names)

    atexit.register(lambda: print(f"gloo threads at exit: {gloo_threads()}", flush=True))
    freeing = sys.argv[1]  # the qualified name of the function that frees the group

    def at_return(frame, event, arg):
        if event == "return" and frame.f_code.co_qualname == freeing:
            print(f"gloo threads when it returns: {gloo_threads()}", flush=True)

    sys.setprofile(at_return)
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    """
)

# fit's path, without fit: a mirrored model, steps, a reduce of a Python tensor (a
# collective whose tensor a gloo thread drops after the caller went on), then the end of
# the script with no shutdown: the strategy's exit hook must leave the group.
MIRRORED = textwrap.dedent(
    """
    import torch
    from clusterflow.strategies import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(3):
        loss = strategy.reduce("mean", strategy.run(step, (torch.ones(2, 4),)))
    print(f"final loss {loss.item():.4f}", flush=True)
    """
)


def _threads_left(output: str) -> dict[str, str]:
    return dict(LEFT.findall(output))


@pytest.mark.timeout(200)
def test_digits_ddp_leaves_no_gloo_thread_at_exit(cf: Clusterflow, tmp_path: Path) -> None:
    """Pins examples/digits_ddp.py's teardown: ``import torch.distributed.nn`` before
    ``init_process_group``, ``del model`` before ``leave_process_group()``, and the
    group freed there from its last reference. Without any one of them the group's
    threads are alive when ``leave_process_group`` returns or at exit."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = cf.run(
        "start",
        "--workers",
        "2",
        "--",
        PY,
        str(probe),
        "leave_process_group",
        str(ROOT / "examples" / "digits_ddp.py"),
        "--epochs",
        "2",
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final test_accuracy" in done.stdout
    none = {"worker:0": "[]", "worker:1": "[]"}
    assert dict(RETURNED.findall(done.stdout)) == none, done.stdout[-3000:]
    assert _threads_left(done.stdout) == none, done.stdout[-3000:]


@pytest.mark.timeout(200)
def test_mirrored_strategy_leaves_no_gloo_thread_at_exit(cf: Clusterflow, tmp_path: Path) -> None:
    """Pins the teardown of a group clusterflow forms: collective/group.py's ``import
    torch.distributed.nn`` before any group forms, MirroredStrategy registering its
    ``shutdown`` at exit, that shutdown dropping the DDP wrappers before the group, and
    ``CollectiveGroup.shutdown`` freeing the group from its last reference. Without any
    one of them the group's threads are alive when that returns or at exit."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    job = tmp_path / "mirrored_job.py"
    job.write_text(MIRRORED)
    freeing = "CollectiveGroup.shutdown"
    done = cf.run("start", "--workers", "2", "--", PY, str(probe), freeing, str(job), timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final loss" in done.stdout
    none = {"worker:0": "[]", "worker:1": "[]"}
    assert dict(RETURNED.findall(done.stdout)) == none, done.stdout[-3000:]
    assert _threads_left(done.stdout) == none, done.stdout[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_gpt_examples_plain_scripts_free_their_group_before_they_return(
    cf: Clusterflow, tmp_path: Path, strategy: str
) -> None:
    """Pins examples/gpt/train.py's ``run_plain`` teardown.

    DDP: ``del`` of everything holding the group, then the group destroyed and freed
    from its last Python reference: its threads are gone before ``run_plain`` returns,
    and so at exit.
    Without the ``del``, the DDP reducer frees the group from C++ when the function's
    locals go, with the GIL held, while a gloo thread may wait for the GIL to drop a
    finished allreduce: a deadlock (1 torchrun run in 10 hung so, and failed CI).
    FSDP: torch's DTensor caches keep the group whatever the script drops, so the script
    leaves with ``os._exit(0)`` before it returns: no line from either hook, exit 0. The
    FSDP run aborted at exit once in a full suite run (``terminate called without an
    active exception``) before it had this."""
    from tests.integration.test_gpt import TINY

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    train = ROOT / "examples" / "gpt" / "train.py"
    flags = ["--strategy", strategy, "--steps", "6", "--eval-every", "6", "--warmup", "2"]
    done = cf.run(
        *("start", "--workers", "2", "--", PY, str(probe), "run_plain", str(train)),
        *(*TINY, *flags),
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final val_loss" in done.stdout
    left = {"worker:0": "[]", "worker:1": "[]"} if strategy == "ddp" else {}
    assert dict(RETURNED.findall(done.stdout)) == left, done.stdout[-3000:]
    assert _threads_left(done.stdout) == left, done.stdout[-3000:]
