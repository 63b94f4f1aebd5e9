"""The chaos suite: SIGKILL tasks at random times; check docs/architecture.md section 6.

Each test starts a detached cluster running a scenario of ``chaos_job.py`` with
``--max-restarts``, kills the job process of a randomly chosen task (seeded, printed on
failure) whenever the run made progress since the previous kill, waits for the run to
end, and checks its outcome against an uninterrupted run: the same final parameters
(sync parameter servers, all-reduce), or every record applied exactly once on every ps
shard (async parameter servers).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import chaos_job  # noqa: E402

PY = sys.executable
KILLS = 5
TOLERANCE = 1e-5  # float sums in another order: replicas' means against one global mean


def _steps(out: Path) -> int:
    log = out / "steps.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _job_pid(cf: Clusterflow, cluster_id: str, task: str) -> int | None:
    """The pid of ``task``'s job process (its supervisor's child), if it runs now."""
    for entry in cf.state(cluster_id).get("tasks") or []:
        if entry.get("task") != task or entry.get("exit_code") is not None:
            continue
        try:
            children = psutil.Process(entry["pid"]).children()
        except (psutil.Error, KeyError, TypeError):
            return None
        live = [c.pid for c in children if c.status() != psutil.STATUS_ZOMBIE]
        return live[0] if live else None
    return None


def _ended(cf: Clusterflow, cluster_id: str) -> bool:
    from clusterflow.manager.registry import TERMINAL

    return cf.state(cluster_id).get("status") in TERMINAL


def run_with_chaos(
    cf: Clusterflow,
    out: Path,
    targets: list[str],
    cluster_args: list[str],
    job_args: list[str],
    *,
    seed: int,
    every: int,
) -> tuple[str, list[str]]:
    """Starts the cluster, kills ``KILLS`` random targets, waits for the end.

    A kill waits until ``every`` to ``2 * every`` more steps (chosen at random) were
    logged since the previous one, so the run gets past a checkpoint between kills and
    always finishes, and the kills land at random points of it.
    """
    rng = random.Random(seed)
    cluster_id = cf.start_detached(
        "--max-restarts", "20", *cluster_args, "--", PY, str(HERE / "chaos_job.py"), *job_args
    )
    kills: list[str] = []
    mark = 0
    while len(kills) < KILLS:
        target = mark + every + rng.randrange(every)
        cf.wait_until(
            lambda target=target: _steps(out) >= target or _ended(cf, cluster_id),
            120,
            f"progress after kill {len(kills)} (seed {seed})",
        )
        if _ended(cf, cluster_id):
            break
        task = rng.choice(targets)
        pid = _job_pid(cf, cluster_id, task)
        if pid is None:
            continue  # that task is being replaced right now: choose again later
        os.kill(pid, signal.SIGKILL)
        kills.append(task)
        mark = _steps(out)
    cf.wait_until(lambda: _ended(cf, cluster_id), 240, f"the end of the run (seed {seed})")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    state = cf.state(cluster_id)
    detail = f"seed {seed}, kills {kills}, state {state.get('summary')}\n{cf.output(cluster_id)}"
    assert len(kills) == KILLS, f"the run ended after {len(kills)} kills; {detail}"
    assert state["status"] == "succeeded", detail
    # A kill that hit a standby's zygote still warming up (before its job started) is no
    # task death: that supervisor starts the job cold instead, and says so.
    cold = cf.output(cluster_id).count("a task given to it starts cold")
    assert state["restarts"] + cold >= KILLS, detail
    return cluster_id, kills


@pytest.mark.timeout(420)
def test_sync_ps_killed_at_random_ends_with_the_uninterrupted_parameters(
    cf: Clusterflow, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 16)))
    cluster_id, kills = run_with_chaos(
        cf,
        tmp_path,
        ["chief:0", "worker:0", "ps:0", "ps:1"],
        ["--chief", "--ps", "2", "--workers", "1"],
        ["sync_ps", str(tmp_path)],
        seed=seed,
        every=2 * chaos_job.CHECKPOINT_EVERY + 2,
    )
    final = json.loads((tmp_path / "final.json").read_text())
    expected = chaos_job.reference(replicas=2)
    diff = max(abs(a - b) for a, b in zip(final, expected, strict=True))
    assert diff < TOLERANCE, f"seed {seed}, kills {kills}: parameters differ by {diff}"
    events = [json.loads(line) for line in (cf.path(cluster_id) / "events.jsonl").open()]
    kinds = {e["event"] for e in events}
    # A worker is respawned alone; a ps or the chief restarts everyone from the last
    # checkpoint.
    if "worker:0" in kills:
        assert "task_respawned" in kinds
        assert "standby_took_over" in kinds  # a warm standby, not a cold start
    if {"chief:0", "ps:0", "ps:1"} & set(kills):
        assert "cluster_restarted" in kinds


@pytest.mark.timeout(420)
def test_allreduce_killed_at_random_ends_with_the_uninterrupted_parameters(
    cf: Clusterflow, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 16)))
    _, kills = run_with_chaos(
        cf,
        tmp_path,
        ["worker:0", "worker:1"],
        ["--workers", "2"],
        ["allreduce", str(tmp_path)],
        seed=seed,
        every=2 * chaos_job.CHECKPOINT_EVERY + 2,
    )
    final = json.loads((tmp_path / "final.json").read_text())
    expected = chaos_job.reference(replicas=2)
    diff = max(abs(a - b) for a, b in zip(final, expected, strict=True))
    assert diff < TOLERANCE, f"seed {seed}, kills {kills}: parameters differ by {diff}"


@pytest.mark.timeout(420)
def test_async_ps_with_worker_kills_applies_every_record_once_per_epoch_on_every_shard(
    cf: Clusterflow, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 16)))
    records, epochs = 600, 2
    table = pa.table({"id": pa.array(range(records), pa.int64())})
    pq.write_table(table, tmp_path / "records.parquet")
    _, kills = run_with_chaos(
        cf,
        tmp_path,
        ["worker:0", "worker:1"],
        ["--chief", "--ps", "2", "--workers", "2"],
        ["async_ps", str(tmp_path), str(tmp_path / "records.parquet"), str(records), str(epochs)],
        seed=seed,
        every=6,
    )
    final: dict[str, Any] = json.loads((tmp_path / "final.json").read_text())
    counts = final["counts"]
    wrong = {i: c for i, c in enumerate(counts) if c != epochs}
    # counts[i] is how many times record i was applied; the two halves live on ps 0 and 1.
    assert not wrong, f"seed {seed}, kills {kills}: records not applied exactly {epochs}x: {wrong}"
    # Each shard applied every lease (one split of 10 records) of every epoch once.
    assert final["applied"] == [epochs * records / 10] * 2, f"seed {seed}, kills {kills}"
    assert len(final["ps_stats"]) == 2
