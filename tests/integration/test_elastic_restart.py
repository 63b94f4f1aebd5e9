"""Elastic clusters (issue 32) for a job that cannot re-form its group: an unmodified
torchrun script (``elastic_ddp_job.py``, plain DDP on gloo) under ``--workers 1:3``.

Its workers never call ``manager.declare``, so ``clusterflow scale`` restarts every
task at the new size, as torchrun's elastic mode does: each rank is told the new
``WORLD_SIZE`` and its dense ``RANK``, ``TORCHELASTIC_RESTART_COUNT`` one higher, and
reloads the script's own newest checkpoint. The test paces the script with
``OUT/allow`` so each resize lands on a step boundary whose checkpoint is written
(``OUT/progress``); a run paced or not trains the same global batches, so its final
parameters equal one process's over the same data.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

JOB = str(Path(__file__).resolve().parent / "elastic_ddp_job.py")
PY = sys.executable
STEPS = 40


def _allow(out: Path, steps: int | None) -> None:
    """Lets the script start steps below ``steps``; None: every step."""
    if steps is None:
        (out / "allow").unlink(missing_ok=True)
    else:
        (out / "allow").write_text(str(steps))


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text())
    except (OSError, ValueError):
        return 0


def _starts(out: Path) -> list[dict[str, Any]]:
    log = out / "starts.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines]


def _scale(cf: Clusterflow, cluster_id: str, workers: int) -> str:
    done = cf.run("scale", cluster_id, "--workers", str(workers), timeout=200)
    assert done.returncode == 0, f"{done.stderr}\n{cf.output(cluster_id)}"
    return done.stdout.strip()


def _ranks(starts: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What each rank of one start saw, by rank."""
    keys = ["rank", "world", "CLUSTERFLOW_TASK", "RANK", "WORLD_SIZE", "LOCAL_RANK"]
    keys += ["LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "resumes"]
    return sorted(tuple(s[k] for k in keys) for s in starts)


def _expected(world: int, restarts: int, resumes: int) -> list[tuple[Any, ...]]:
    w = str(world)
    return [
        (r, world, f"worker:{r}", str(r), w, str(r), w, str(restarts), resumes)
        for r in range(world)
    ]


@pytest.mark.timeout(300)
def test_an_unmodified_ddp_script_restarts_at_each_new_size_from_its_own_checkpoint(
    cf: Clusterflow, tmp_path: Path
) -> None:
    """1 -> 3 -> 2 -> 3 workers. Pins: a job that declared nothing is restarted whole
    rather than resized live (a live add would leave worker:0 at world 1 and the
    newcomers waiting for it); every rank of each restart gets the new ``WORLD_SIZE``,
    its dense rank and a restart count one higher, a newcomer the group's (worker:2
    comes back after it left); it resumes at the checkpoint's step; the
    ``--max-restarts`` budget is untouched; the membership history records each change;
    a bad size is still one line, exit 2, nothing restarted; and the script's result
    equals one process's over the same global batches (1e-5)."""
    out, alone_out = tmp_path / "run", tmp_path / "alone"
    out.mkdir()
    alone_out.mkdir()
    # The one-process reference runs meanwhile: the cluster mostly waits on the pacing.
    alone = subprocess.Popen(
        [PY, JOB, str(alone_out), str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _allow(out, 10)
        cluster_id = cf.start_detached("--workers", "1:3", "--", PY, JOB, str(out), str(STEPS))
        cf.wait_until(lambda: _progress(out) == 10, 120, f"step 10\n{cf.output(cluster_id)}")
        assert _ranks(_starts(out)) == _expected(1, 0, 0)  # held at step 10, checkpointed

        done = cf.run("scale", cluster_id, "--workers", "4")
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert "--workers 4 is outside the range 1:3" in done.stderr, done.stderr

        restarted = "; every task restarted at the new size"  # the CLI says how it resized
        phases = [
            (3, f"3 workers at spec version 2 (added worker:1, worker:2){restarted}"),
            (2, f"2 workers at spec version 3 (removed worker:2){restarted}"),
            (3, f"3 workers at spec version 4 (added worker:2){restarted}"),
        ]
        seen = 1
        for restarts, (workers, said) in enumerate(phases, 1):
            step = 10 * restarts
            cf.wait_until(lambda s=step: _progress(out) == s, 120, f"step {step}")
            answer = _scale(cf, cluster_id, workers)
            assert answer.endswith(said), answer
            _allow(out, step + 10 if restarts < len(phases) else None)
            cf.wait_until(
                lambda s=step: _progress(out) > s, 120, f"step {step + 1}\n{cf.output(cluster_id)}"
            )
            starts = _starts(out)
            assert len(starts) == seen + workers, starts  # no other start (the bad size)
            assert _ranks(starts[seen:]) == _expected(workers, restarts, step)
            seen += workers

        cf.wait_until(
            lambda: cf.state(cluster_id).get("status") in ("succeeded", "failed"),
            120,
            f"the end of {cluster_id}",
        )
        cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
        state = cf.state(cluster_id)
        assert state["status"] == "succeeded", f"{state.get('summary')}\n{cf.output(cluster_id)}"
        assert state["restarts"] == 0, "a resize spent the --max-restarts budget"
        assert [(t["task"], t["restarts"]) for t in state["tasks"]] == [
            ("worker:0", 3),
            ("worker:1", 3),
            ("worker:2", 3),
        ]
        history = [(m["task"], m["change"], m["spec_version"]) for m in state["membership"]]
        assert history == [
            ("worker:1", "joined", 2),
            ("worker:2", "joined", 2),
            ("worker:2", "left", 3),
            ("worker:2", "joined", 4),
        ], history

        output, _ = alone.communicate(timeout=120)
        assert alone.returncode == 0, output
    finally:
        if alone.poll() is None:
            alone.kill()
            alone.wait()
    ours = json.loads((out / "final.json").read_text())
    reference = json.loads((alone_out / "final.json").read_text())
    assert ours["step"] == reference["step"] == STEPS
    flat = [*ours["weight"][0], *ours["bias"]]
    expected = [*reference["weight"][0], *reference["bias"]]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(flat, expected, strict=True)), (
        flat,
        expected,
    )
