"""Live figures end true: after a short run, ``ps``, ``describe`` and ``state.json`` (what
the dashboard reads) show the last step, loss and rate the tasks reported.

The report path sends at most one report a second; a run shorter than that used to
leave its first report (``step 1, loss 2.329``) as what every view showed for good.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable

SHORT_RUN = """
import os, sys, torch
from torch import nn
from clusterflow.train import fit, report

# The rate limit made absolute: after its first report the thread sends nothing more,
# so only the flushes under test can deliver the last figures.
live = sys.modules["clusterflow.train.report"]._current()
live._interval = 3600.0
if os.environ["CLUSTERFLOW_TASK_INDEX"] == "0":  # fit: 120 steps of one row each
    torch.manual_seed(0)
    x, y = torch.randn(120, 4), torch.randint(0, 2, (120,))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, nn.CrossEntropyLoss(), optimizer, (x, y), global_batch_size=1)
    print("last step", history.step, "sent", live._sent[0], flush=True)
else:  # a loop of one's own: the process's exit sends its last figures
    for step in range(1, 78):
        report(step=step, loss=1.0 / step, samples_per_s=float(step))
    print("last step", step, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_short_run_shows_its_last_step_loss_and_rate_after_it_ended(cf: Clusterflow) -> None:
    """Pins the flush of the last report: ``TrainingSession._close`` (worker:0, through
    ``fit``) and the exit of a process that called ``report`` (worker:1, ``atexit``),
    and the manager keeping what they sent (``TaskTable.report``; an exit clears
    nothing). ``ps`` sums the rates the tasks ended on (``ClusterState.figures``)."""
    script = cf.script("short_run.py", SHORT_RUN)

    done = cf.run("start", "--workers", "2", "--", PY, str(script))

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # fit sent its last step before it returned, not only at the process's exit.
    assert "[worker:0] last step 120 sent 120" in lines and "[worker:1] last step 77" in lines
    cluster = cf.only_id()
    tasks = {t["task"]: t for t in cf.state(cluster)["tasks"]}
    assert tasks["worker:0"]["step"] == 120
    assert tasks["worker:1"]["step"] == 77
    assert tasks["worker:1"]["loss"] == pytest.approx(1.0 / 77)
    assert tasks["worker:1"]["samples_per_s"] == 77.0

    described = cf.run("describe", cluster).stdout
    assert re.search(r"worker:1 .* step 77, loss 0\.01299, 77 samples/s$", described, re.M)
    assert re.search(r"worker:0 .* step 120, loss [0-9.e-]+, [0-9]+ samples/s$", described, re.M)

    (header, row) = cf.run("ps", "-a").stdout.splitlines()
    step, rate = (row[header.index(column) :].split()[0] for column in ("STEP", "SAMPLES/S"))
    assert step == "120" and rate == f"{tasks['worker:0']['samples_per_s'] + 77.0:.0f}"
