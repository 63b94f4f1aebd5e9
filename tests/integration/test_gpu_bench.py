"""``python -m benchmarks.gpu`` runs: its ``--cpu-smoke`` on CPU, so the GPU script does not rot.

The script is meant for a machine with a GPU that this suite does not have; the smoke
run goes through every part it runs there (torchrun's DDP, MultiWorkerMirrored through
``fit`` under ``clusterflow start``, ps async, the ps bandwidth probe) on a tiny model,
and this test reads its RESULT line. No figure is judged: timings live in benchmarks/.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_gpu_benchmark_cpu_smoke_runs_every_part_and_prints_its_result(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "TF_CONFIG"))}
    env["TMPDIR"] = str(tmp_path)  # the script's cluster state goes under the test's folder
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--cpu-smoke", "--budget-s", "500"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT gpu "))
    figures = dict(re.findall(r"(\w+)=(\S+)", line))
    assert "failed" not in figures.values() and "skipped" not in figures.values(), line
    for key in (
        "ddp_tokens_per_s",
        "mirrored_tokens_per_s",
        "mirrored_vs_torchrun_ddp",
        "ps_async_tokens_per_s",
        "ps_gpu_push_pull_GBps",
        "copy_pinned_GBps",
        "staged_vs_unstaged",
    ):
        assert float(figures[key]) > 0, (key, line)
    assert figures["card"] == "cpu" and figures["backend_ddp"] == "gloo"
    # The same global batches, in float32 on the CPU: both runs end on the same loss.
    assert abs(float(figures["val_loss_ddp"]) - float(figures["val_loss_mirrored"])) < 1e-3
