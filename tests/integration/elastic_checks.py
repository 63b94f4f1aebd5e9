"""What the elastic tests (issue 32) check, on the local backend and on Ray alike.

The three 2 -> 4 -> 2 scenarios run the same jobs on both backends
(``elastic_job.py``, async ps; ``elastic_sync_ps_job.py``; ``elastic_allreduce_job.py``):
``test_elastic.py``, ``test_elastic_sync_ps.py`` and ``test_elastic_allreduce.py`` on
the local backend, ``test_ray_elastic.py`` on a Ray cluster of emulated hosts. What
the run must show once it ended is written here once: the pacing of the job through
``OUT/allow``, the surviving tasks' pids read from a cluster's state, and the reading
of each job's log (every record applied exactly once per epoch, the steps' membership,
the replay in one process).

A task's pids are its supervisor's (the state's ``pid``: on Ray, the supervisor the
task's actor started on its node, ``ray_actor.SupervisorHost``) and its job's (the
supervisor's child). The emulated hosts are network namespaces of this machine, not
pid namespaces, so both are this machine's pids on either backend.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from clusterflow.testing.waiting import wait_for

SYNC_GROW_AFTER, SYNC_SHRINK_AFTER = 4, 9
"""The sync ps scenario: every replica holds after step 4 while the cluster grows, and
after step 9 while it shrinks (``elastic_job.hold_at``)."""
ALLREDUCE_GLOBAL_BATCH = 12
"""``elastic_allreduce_job``'s global batch: ``BATCH`` (4) rows on each of 3 replicas."""


def steps(out: Path, task: str | None = None) -> int:
    """The lines of ``OUT/steps.log`` (of ``task`` alone, when given)."""
    log = out / "steps.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if task is None or line.startswith(f"{task} "))


def allow(out: Path, limit: int | None) -> None:
    """Lets the run go on to ``limit`` (logged steps for ``elastic_job.hold``, a step
    number for ``hold_at``); None: to its end."""
    if limit is None:
        (out / "allow").unlink(missing_ok=True)
    else:
        (out / "allow").write_text(str(limit))


def pace(out: Path, done: Callable[[], bool], what: str, timeout: float = 180) -> None:
    """Lets the run go on a line of ``steps.log`` at a time until ``done()``: a step is
    a few milliseconds, and a resize must find the run still going (rank 0 sees a
    newcomer at its next look at the manager's spec; a leaver leaves at the next step
    boundary, within the stop's grace period), yet never after the data ran out."""

    def advanced() -> bool:
        if done():
            return True
        allow(out, steps(out) + 1)
        return False

    wait_for(advanced, what, timeout)


def pids(state: Mapping[str, Any], tasks: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Each of ``tasks``' supervisor pid and its job's pid (the supervisor's child; 0
    while it has none), from a cluster's state (``describe --json``)."""
    wanted = set(tasks)
    found = {}
    for entry in state.get("tasks") or []:
        if entry.get("task") in wanted and entry.get("pid"):
            try:
                children = [
                    c.pid
                    for c in psutil.Process(entry["pid"]).children()
                    if c.status() != psutil.STATUS_ZOMBIE
                ]
            except psutil.Error:
                children = []
            found[entry["task"]] = (entry["pid"], children[0] if children else 0)
    return found


def running_pids(
    state: Callable[[], Mapping[str, Any]], tasks: tuple[str, ...], timeout: float = 60
) -> dict[str, tuple[int, int]]:
    """``pids`` once every one of ``tasks`` has a running job."""
    found: dict[str, tuple[int, int]] = wait_for(
        lambda: (
            (p := pids(state(), tasks)).keys() == set(tasks)
            and all(job for _, job in p.values())
            and p
        ),
        f"the jobs of {tasks}",
        timeout,
    )
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_once_per_epoch(seen: Mapping[int, float], records: int, epochs: int) -> None:
    """Every record ``0..records-1`` applied ``epochs`` times (``seen``: id -> times)."""
    wrong = {i: seen.get(i, 0) for i in range(records) if seen.get(i, 0) != epochs}
    assert not wrong, f"records not applied exactly {epochs}x: {wrong}"


def check_async_ps(out: Path, records: int, epochs: int) -> None:
    """``elastic_job``: every record's count (the chief's ``final.json``) is ``epochs``."""
    counts: list[float] = json.loads((out / "final.json").read_text())["counts"]
    assert len(counts) == records
    assert_once_per_epoch(dict(enumerate(counts)), records, epochs)


# The sync ps job (elastic_sync_ps_job.py) ---------------------------------------------

Part = tuple[str, list[int], bool]
"""A push a step took: (task, ids, whether its gradients were applied)."""


def sync_log(out: Path) -> list[tuple[str, int | None, bool, list[int]]]:
    """``(task, step, applied, ids)`` per logged push; ``step`` None: no step took it."""
    rows = []
    log = out / "steps.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        task, _, step, _, applied, _, ids = line.split(" ")
        taken = None if step == "-" else int(step)
        rows.append((task, taken, applied == "1", [int(i) for i in ids.split(",")]))
    return rows


def took(out: Path, tasks: Iterable[str], step: int) -> bool:
    """Whether every one of ``tasks`` logged a push that step ``step`` took."""
    log = sync_log(out)
    return all(any(t == task and s == step for t, s, _, _ in log) for task in tasks)


def check_sync_ps(out: Path) -> None:
    """The end of a sync ps run resized 2 -> 4 -> 2 workers while every replica held
    after ``SYNC_GROW_AFTER`` and ``SYNC_SHRINK_AFTER``: every record applied exactly
    once per epoch; the steps took 3 replicas, then 5 (both newcomers counted from the
    same step), then 3 from the step after the pause; the parameters of one process
    taking the same steps (within 1e-5)."""
    from elastic_sync_ps_job import EPOCHS, RECORDS, reference

    log = sync_log(out)
    seen = Counter(i for _, step, applied, ids in log if step is not None and applied for i in ids)
    assert_once_per_epoch(seen, RECORDS, EPOCHS)

    taken: dict[int, list[Part]] = defaultdict(list)
    for task, step, applied, ids in log:
        if step is not None:
            taken[step].append((task, ids, applied))
    order = sorted(taken)
    assert order == list(range(len(order))), order  # one sequence of steps, none missing
    members = [frozenset(task for task, _, _ in taken[s]) for s in order]
    three = frozenset({"chief:0", "worker:0", "worker:1"})
    five = three | {"worker:2", "worker:3"}
    # 3 replicas, then 5 from one step on, then 3 again from the step after the pause;
    # the end takes fewer as the replicas' data runs out (each leaves the steps then).
    first5 = members.index(five)
    last5 = len(members) - 1 - members[::-1].index(five)
    assert first5 > SYNC_GROW_AFTER and last5 == SYNC_SHRINK_AFTER, members
    assert all(m == three for m in members[:first5]), members[:first5]
    assert all(m == five for m in members[first5 : last5 + 1]), members
    tail = members[last5 + 1 :]
    assert all(m <= three for m in tail), tail
    assert tail[:3] == [three] * 3, tail
    joined = {
        task: min(s for s in order if task in members[s]) for task in ("worker:2", "worker:3")
    }
    assert set(joined.values()) == {first5}, joined  # both counted from the same step

    finals = [json.loads(p.read_text()) for p in out.glob("final-*.json")]
    assert len(finals) == 3, finals  # the survivors'; the leavers were stopped
    final = max(finals, key=lambda f: f["version"])
    assert final["version"] == len(order)
    expected = reference([[(ids, applied) for _, ids, applied in taken[s]] for s in order])
    assert max(abs(a - b) for a, b in zip(final["params"], expected, strict=True)) < 1e-5, (
        final,
        expected,
    )


# The all-reduce job (elastic_allreduce_job.py) ----------------------------------------


def started(out: Path, tasks: Iterable[str]) -> bool:
    """Whether every one of ``tasks`` got past its imports (``OUT/started-TASK``).

    Wait for it before pacing the survivors on after a grow: paced while a newcomer
    starts (seconds under load), they could lease every split left, and a newcomer
    whose first batch finds none cannot take part in their steps (``fit``'s
    ``sit_in`` has no batch to sit in with)."""
    return all((out / f"started-{task}").exists() for task in tasks)


def allreduce_log(out: Path) -> list[tuple[str, int, list[int]]]:
    """``(task, step, ids)`` per logged step."""
    rows = []
    for line in (out / "steps.log").read_text().splitlines():
        task, _, step, _, ids = line.split(" ")
        rows.append((task, int(step), [int(i) for i in ids.split(",") if i != "-"]))
    return rows


def check_allreduce(out: Path, records: int, epochs: int, survivors: Iterable[str]) -> None:
    """The end of an all-reduce run resized 2 -> 4 -> 2 workers: every record applied
    exactly once per epoch; one sequence of steps at 3, 5, 4 and 3 replicas; each
    replica's batch its share of the global batch; the parameters of one process fed
    the same global batches (within 1e-5)."""
    from elastic_allreduce_job import reference

    log = allreduce_log(out)
    assert_once_per_epoch(Counter(i for _, _, ids in log for i in ids), records, epochs)

    batches: dict[int, list[int]] = defaultdict(list)
    shares: dict[int, dict[str, int]] = defaultdict(dict)
    for task, step, ids in log:
        batches[step].extend(ids)
        shares[step][task] = len(ids)
    order = sorted(batches)
    assert order == list(range(1, len(order) + 1)), order  # one sequence of steps
    worlds = [len(shares[s]) for s in order]
    assert worlds[0] == 3 and 5 in worlds and 4 in worlds and worlds[-1] == 3, worlds
    # The global batch stays 12 rows: each replica's batch is its share (4 at 3
    # replicas, 3 or 2 at 5, 3 at 4), but at the step a group re-forms (the survivors
    # read their batch before it), a leaver's last step (it takes all the records of
    # the splits it began), an epoch's end and the run's end.
    size = ALLREDUCE_GLOBAL_BATCH
    resized = {s for s in order[1:] if shares[s].keys() != shares[s - 1].keys()}
    kept = set(survivors)
    last_of = {task: step for task, step, _ in log if task not in kept}
    over = {
        s: shares[s]
        for s in order
        if s not in resized
        and any(
            rows > -(-size // len(shares[s])) and last_of.get(task) != s
            for task, rows in shares[s].items()
        )
    }
    assert not over, f"batches above the replica's share of {size} rows: {over}"
    # (at the end the replicas wait for each other's last splits: smaller batches)
    full = [s for s in order if len(batches[s]) == size]
    assert len(full) >= 2 * len(order) // 3, {s: len(batches[s]) for s in order}

    final = json.loads((out / "final.json").read_text())["params"]
    expected = reference(batches[s] for s in order)
    assert max(abs(a - b) for a, b in zip(final, expected, strict=True)) < 1e-5, (
        final,
        expected,
    )
