"""A dead or hung ps task is detected end to end, under async and sync training.

The promise (docs/concepts.md, "Servers and the RPC layer"; ``ParameterServerStrategy``'s
``deadline_s``): every call to a ps answers within its deadline, so a worker whose ps
is gone raises instead of waiting forever; and the manager ends a run whose ps task
died. The deadline is made small through ``deadline_s`` so the test is quick; the
test's own waits are safety nets for a hang, far above it, not measurements.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable
DEADLINE_S = 10.0
"""The workers' ps call deadline (``ParameterServerStrategy(deadline_s=...)``): short,
yet above what a ps takes to answer its first call on a loaded 2-core machine."""

JOB = """
import sys, time, torch
from clusterflow.strategies.parameter_server import ParameterServerStrategy

mode, deadline = sys.argv[1], float(sys.argv[2])
torch.set_num_threads(1)
strategy = ParameterServerStrategy(mode=mode, deadline_s=deadline)
with strategy.scope():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

def step(x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()

x = torch.randn(8, 4)
steps = 0
try:
    while True:  # trains until the ps goes away
        strategy.run(step, (x,))
        steps += 1
        if steps == 5:
            print("training", flush=True)
except Exception as exc:
    # Exit 0, so the manager does not stop the other worker: each must notice by itself.
    print(f"raised {type(exc).__name__} after {steps} steps", flush=True)
"""


def _ps_process(cf: Clusterflow, cluster_id: str) -> psutil.Process:
    """The process that runs the built-in ps (not its supervisor)."""
    found = []
    for proc in cf.live(cluster_id):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if "clusterflow.ps" in cmdline:
            found.append(proc)
    assert len(found) == 1, [p.cmdline() for p in found]
    return found[0]


def _start_and_wait_for_training(
    cf: Clusterflow, mode: str
) -> tuple[subprocess.Popen[str], Clusterflow.LineReader, str]:
    script = cf.script("job.py", JOB)
    proc = cf.popen(
        "start", "--ps", "1", "--workers", "2", "--grace", "2", "--",
        PY, str(script), mode, str(DEADLINE_S),
    )  # fmt: skip
    assert proc.stdout is not None
    reader = cf.LineReader(proc.stdout)
    cf.wait_until(
        lambda: sum(line.endswith(" training") for line in reader.lines) == 2,
        120,
        "both workers training",
    )
    return proc, reader, cf.only_id()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_hung_ps_makes_every_worker_raise_within_its_deadline(cf: Clusterflow, mode: str) -> None:
    proc, reader, cluster_id = _start_and_wait_for_training(cf, mode)
    ps = _ps_process(cf, cluster_id)
    ps.send_signal(signal.SIGSTOP)  # alive, its supervisor heartbeats: only deadlines see it
    try:
        # Each worker is in a ps call, or makes one within a step: the deadline ends it.
        # The wait is a safety net (a hang fails here, not at pytest's timeout).
        proc.wait(timeout=60 + 10 * DEADLINE_S)
    finally:
        if ps.is_running():
            ps.send_signal(signal.SIGCONT)
    lines = reader.join()
    raised = [line for line in lines if " raised " in line]
    assert len(raised) == 2, lines[-30:]
    for line in raised:
        # A deadline, or the ps's own "did not come" reply that ends a wait early.
        found = re.search(r"raised (DeadlineExceeded|RemoteError|PSError) after (\d+) steps", line)
        assert found and int(found[2]) >= 5, line  # it trained, then the ps hung
    assert proc.returncode == 0, lines[-30:]  # then the manager ended the run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_ps_ends_the_run_naming_it(cf: Clusterflow, mode: str) -> None:
    proc, reader, cluster_id = _start_and_wait_for_training(cf, mode)
    _ps_process(cf, cluster_id).send_signal(signal.SIGKILL)
    # The manager sees the exit at once; the deadline bounds a worker that is faster.
    proc.wait(timeout=60 + 10 * DEADLINE_S)
    assert proc.stderr is not None
    errors = proc.stderr.read()
    lines = reader.join()
    assert proc.returncode != 0, lines[-30:]
    # One line, naming the task and how it died.
    assert re.fullmatch(
        r"error: cluster \w+ failed: task ps:0 was killed by SIGKILL", errors.strip()
    ), errors
    state = cf.state(cluster_id)
    assert state["status"] == "failed", state
    assert not cf.live(cluster_id)
