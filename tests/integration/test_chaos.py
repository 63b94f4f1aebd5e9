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
    from collections.abc import Callable

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


def _running_job(cf: Clusterflow, cluster_id: str, task: str) -> int | None:
    """``task``'s job pid once the whole cluster runs (not while it restarts)."""
    if cf.state(cluster_id).get("status") != "running":
        return None
    return _job_pid(cf, cluster_id, task)


def _handled(cf: Clusterflow, cluster_id: str) -> int:
    """Task deaths the manager has acted on.

    A kill that hit a standby's zygote still warming up (before its job started) is no
    task death: that supervisor starts the job cold instead, and says so.
    """
    cold = cf.output(cluster_id).count("a task given to it starts cold")
    return int(cf.state(cluster_id).get("restarts", 0)) + cold


def _ended(cf: Clusterflow, cluster_id: str) -> bool:
    from clusterflow.manager.registry import TERMINAL

    return cf.state(cluster_id).get("status") in TERMINAL


def seeds(fixed: int) -> Any:
    """The seeds a chaos test runs: its fixed one (CI covers the same kills every run;
    ``kill_schedule`` kills every target of the shape at least once, whatever the
    seed), plus a fresh random one when ``CHAOS_RANDOM=1``. ``CHAOS_SEED`` replays one
    seed in place of the fixed one. Each run prints its seed.

    A fixed seed whose shape has more workers than kills to spare spends its extra kills
    on workers (a respawn by the warm standby), not on a ps or the chief a second time:
    a whole restart costs a cold start of every task (about 5 s on 2 cores) and adds no
    scenario the shape lacks (each ps and the chief is still killed once, so every such
    shape still restarts from a checkpoint at least twice in a run). The seeds before
    that choice (104, 105, 106, 110) replay with ``CHAOS_SEED``."""
    chosen = [int(os.environ.get("CHAOS_SEED", fixed))]
    if os.environ.get("CHAOS_RANDOM") == "1":
        chosen.append(random.randrange(1 << 16))
    return pytest.mark.parametrize("seed", chosen, ids=[f"seed{s}" for s in chosen])


def kill_schedule(seed: int, targets: list[str], every: int) -> list[tuple[int, str]]:
    """``KILLS`` kills as ``(steps logged, task)``: a pure function of the seed.

    Counted in logged steps, not wall time, so one seed gives the same schedule on a
    fast or a loaded machine. Every target is killed at least once (in a random order),
    so every assertion about what a kill must cause runs whatever the seed.
    """
    rng = random.Random(seed)
    tasks = list(targets) + [rng.choice(targets) for _ in range(KILLS - len(targets))]
    rng.shuffle(tasks)
    schedule, at = [], 0
    for task in tasks:
        at += every + rng.randrange(every)
        schedule.append((at, task))
    return schedule


def run_with_chaos(
    cf: Clusterflow,
    out: Path,
    targets: list[str],
    cluster_args: list[str],
    job_args: list[str],
    *,
    seed: int,
    every: int,
    before_kill: Callable[[], bool] | None = None,
) -> tuple[str, list[str]]:
    """Starts the cluster, kills as ``kill_schedule`` says, waits for the end.

    Kill ``k`` waits until the run logged its step threshold (``every`` to ``2 * every``
    more than the previous one, so the run gets past a checkpoint between kills and
    always finishes) and ``before_kill()`` holds, then until the chosen task's job runs
    (it may be respawning), and kills it. Every wait is on a condition; none draws from
    the RNG again.
    """
    schedule = kill_schedule(seed, targets, every)
    cluster_id = cf.start_detached(
        "--max-restarts", "20", *cluster_args, "--", PY, str(HERE / "chaos_job.py"), *job_args
    )
    kills: list[str] = []
    try:
        _kill_on_schedule(cf, cluster_id, out, schedule, kills, seed, before_kill)
    except AssertionError as exc:  # a wait ran out: what the cluster said is the clue
        raise AssertionError(f"{exc}; kills {kills}\n{cf.output(cluster_id)}") from None
    state = cf.state(cluster_id)
    detail = f"seed {seed}, kills {kills}, state {state.get('summary')}\n{cf.output(cluster_id)}"
    assert len(kills) == KILLS, f"the run ended after {len(kills)} kills; {detail}"
    assert state["status"] == "succeeded", detail
    assert _handled(cf, cluster_id) >= KILLS, detail
    return cluster_id, kills


def _kill_on_schedule(
    cf: Clusterflow,
    cluster_id: str,
    out: Path,
    schedule: list[tuple[int, str]],
    kills: list[str],
    seed: int,
    before_kill: Callable[[], bool] | None = None,
) -> None:
    """Kills as ``schedule`` says (see ``run_with_chaos``), then waits for the end."""
    ready = before_kill or (lambda: True)
    for at, task in schedule:
        cf.wait_until(
            lambda at=at: (_steps(out) >= at and ready()) or _ended(cf, cluster_id),
            120,
            f"{at} steps before kill {len(kills) + 1} (seed {seed})",
        )
        pid = cf.wait_until(
            lambda task=task: _running_job(cf, cluster_id, task) or _ended(cf, cluster_id),
            120,
            f"{task}'s job for kill {len(kills) + 1} (seed {seed})",
        )
        if _ended(cf, cluster_id) or pid is True:
            break
        os.kill(pid, signal.SIGKILL)
        kills.append(task)
        # The manager must have acted on this kill before the next one: else a second
        # kill could hit a task of the incarnation it is tearing down, and count for none.
        cf.wait_until(
            lambda: _handled(cf, cluster_id) >= len(kills) or _ended(cf, cluster_id),
            120,
            f"the manager's answer to kill {len(kills)} (seed {seed})",
        )
    cf.wait_until(lambda: _ended(cf, cluster_id), 240, f"the end of the run (seed {seed})")
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")


def _events(cf: Clusterflow, cluster_id: str) -> set[str]:
    return {json.loads(line)["event"] for line in (cf.path(cluster_id) / "events.jsonl").open()}


def _records(out: Path, records: int) -> Path:
    table = pa.table({"id": pa.array(range(records), pa.int64())})
    pq.write_table(table, out / "records.parquet")
    return out / "records.parquet"


@pytest.mark.timeout(420)
@seeds(101)
def test_sync_ps_killed_at_random_ends_with_the_uninterrupted_parameters(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    print(f"CHAOS_SEED={seed}")
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
    kinds = _events(cf, cluster_id)
    # Every target was killed (kill_schedule): a worker is respawned alone, by a warm
    # standby; a ps or the chief restarts everyone from the last checkpoint.
    assert {"task_respawned", "standby_took_over", "cluster_restarted"} <= kinds, kinds


@pytest.mark.timeout(420)
@seeds(102)
def test_allreduce_killed_at_random_ends_with_the_uninterrupted_parameters(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    print(f"CHAOS_SEED={seed}")
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
@seeds(103)
def test_async_ps_with_worker_kills_applies_every_record_once_per_epoch_on_every_shard(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    print(f"CHAOS_SEED={seed}")
    records, epochs = 600, 2
    path = _records(tmp_path, records)
    _, kills = run_with_chaos(
        cf,
        tmp_path,
        ["worker:0", "worker:1"],
        ["--chief", "--ps", "2", "--workers", "2"],
        ["async_ps", str(tmp_path), str(path), str(records), str(epochs)],
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


# Through fit(): a user's job, a data-service client, a counter per record -------------

FIT_RECORDS, FIT_EPOCHS = 600, 2


def run_fit_with_chaos(
    cf: Clusterflow,
    tmp_path: Path,
    scenario: str,
    targets: list[str],
    cluster_args: list[str],
    *,
    seed: int,
    batch_size: int = 10,
    own_directory: bool = False,
) -> tuple[str, str]:
    """Runs ``chaos_job.fit_counts`` under kills; asserts every record's update was
    applied exactly once per epoch (its counter is the number of epochs).

    ``batch_size`` over 10 (the split size) makes each batch, and so each push, carry
    several splits; ``own_directory`` keeps the checkpoints in a folder of the job's
    own, which the manager learns from the chief."""
    print(f"CHAOS_SEED={seed}")
    path = _records(tmp_path, FIT_RECORDS)
    job = [scenario, str(tmp_path), str(path), str(FIT_RECORDS), str(FIT_EPOCHS), str(batch_size)]
    before_kill = None
    if own_directory:
        own = tmp_path / "own-checkpoints"
        job.append(str(own))

        # The step thresholds count every worker's lines, and the leader, which cuts
        # the checkpoints, may lag the others (async, a loaded machine): seen once, two
        # ps kills before its first checkpoint, so the restarts restored none.
        def before_kill() -> bool:
            return any((d / "MANIFEST.json").exists() for d in own.glob("ckpt-*"))

    cluster_id, kills = run_with_chaos(
        cf,
        tmp_path,
        targets,
        cluster_args,
        job,
        seed=seed,
        every=2 * chaos_job.FIT_CHECKPOINT_EVERY + 2,
        before_kill=before_kill,
    )
    counts = json.loads((tmp_path / "final.json").read_text())["counts"]
    wrong = {i: c for i, c in enumerate(counts) if c != FIT_EPOCHS}
    detail = f"seed {seed}, kills {kills}"
    assert not wrong, f"{detail}: records not applied exactly {FIT_EPOCHS}x: {wrong}"
    return cluster_id, detail


@pytest.mark.timeout(420)
@seeds(114)
def test_fit_async_ps_under_kills_applies_every_record_once_per_epoch(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_async_ps",
        ["chief:0", "worker:0", "worker:1", "ps:0"],
        ["--chief", "--ps", "1", "--workers", "2"],
        seed=seed,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted"} <= kinds, f"{detail}: {kinds}"


@pytest.mark.timeout(420)
@seeds(125)
def test_fit_embedding_table_on_two_ps_under_kills_applies_every_record_once_per_epoch(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    """Issue 21: the counters are the rows of an ``nn.Embedding`` sharded over two ps
    tasks; worker kills (respawns) and ps or chief kills (restarts from a checkpoint of
    the shards' rows and applied keys) leave every row counted once per epoch."""
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_embedding_ps",
        ["chief:0", "worker:0", "ps:0", "ps:1"],
        ["--chief", "--ps", "2", "--workers", "1"],
        seed=seed,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted"} <= kinds, f"{detail}: {kinds}"


@pytest.mark.timeout(420)
@seeds(156)
def test_fit_sync_ps_with_a_backup_worker_under_kills_applies_every_record_once_per_epoch(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_sync_ps",
        ["chief:0", "worker:0", "ps:0"],
        ["--chief", "--ps", "1", "--workers", "1"],
        seed=seed,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted"} <= kinds, f"{detail}: {kinds}"


@pytest.mark.timeout(420)
@seeds(107)
def test_fit_allreduce_under_kills_applies_every_record_once_per_epoch(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    cluster_id, detail = run_fit_with_chaos(
        cf, tmp_path, "fit_allreduce", ["worker:0", "worker:1"], ["--workers", "2"], seed=seed
    )
    assert "cluster_restarted" in _events(cf, cluster_id), detail


# Without a chief job: worker 0 leads (it cuts the checkpoints) and is respawned alone ----


@pytest.mark.timeout(420)
@seeds(108)
def test_fit_async_ps_without_a_chief_under_kills_of_the_leading_worker_applies_every_record_once(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    """Issue 31's shape: no ``chief`` job, so ``worker:0`` leads and is respawned alone
    while the ps lives on; three workers, two ps, batches of two splits, checkpoints in
    the job's own folder. A respawned leader that reloaded its last checkpoint into the
    live ps undid every update since (``ParameterServerStrategy.restore``), and a ps
    kill restarted the ps and the data cursor afresh while the chief reloaded its own
    folder (``Checkpointer`` telling the manager, ``manager.checkpoints``)."""
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_async_ps",
        ["worker:0", "worker:1", "worker:2", "ps:0", "ps:1"],
        ["--ps", "2", "--workers", "3"],
        seed=seed,
        batch_size=20,
        own_directory=True,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted", "checkpoints_moved"} <= kinds, f"{detail}"
    # Every kill comes after a checkpoint: each whole restart restored one, from the
    # job's folder the manager learnt (else it restarted from nothing: the run only
    # stayed exactly-once because the chief reloaded the ps's applied keys itself).
    restarts = [
        json.loads(line)
        for line in (cf.path(cluster_id) / "events.jsonl").open()
        if json.loads(line)["event"] == "cluster_restarted"
    ]
    assert all(r.get("checkpoint") for r in restarts), f"{detail}: {restarts}"


@pytest.mark.timeout(420)
@seeds(109)
def test_fit_sync_ps_without_a_chief_under_kills_applies_every_record_once(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    """Sync, no ``chief`` job, two workers each pushing batches of two splits (a push
    whose keys are part applied, part new, is refused whole), the job's own folder."""
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_sync_ps",
        ["worker:0", "worker:1", "ps:0"],
        ["--ps", "1", "--workers", "2"],
        seed=seed,
        batch_size=20,
        own_directory=True,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted"} <= kinds, f"{detail}: {kinds}"


@pytest.mark.timeout(420)
@seeds(140)
def test_fit_embedding_table_without_a_chief_one_worker_under_kills_applies_every_record_once(
    cf: Clusterflow, tmp_path: Path, seed: int
) -> None:
    """An embedding table on two ps, one worker that leads (no ``chief`` job), batches
    of two splits: the rows count every record once per epoch."""
    cluster_id, detail = run_fit_with_chaos(
        cf,
        tmp_path,
        "fit_embedding_ps",
        ["worker:0", "ps:0", "ps:1"],
        ["--ps", "2", "--workers", "1"],
        seed=seed,
        batch_size=20,
    )
    kinds = _events(cf, cluster_id)
    assert {"task_respawned", "cluster_restarted"} <= kinds, f"{detail}: {kinds}"
