"""Hostile conditions: a fuzzed wire and partitions (docs/failure-semantics.md).

* ``fuzz_inputs``: hostile messages sent (``clusterflow.rpc.fuzz``, seeded) to a live
  cluster (``--ps 1 --workers 1``): its ps task's ``Server`` and ps service, its
  manager's dispatcher and manager methods, plus raw non-ZMTP payloads. Goal >= 100,000.
* ``fuzz_crashes``: a target process that died, or a good client's call that failed,
  between batches or after. Goal 0. ``fuzz_unanswered``: messages owed an answer that
  got none; ``fuzz_internal``: answers of code ``internal`` (a handler raised on bad
  input). ``fuzz_rss_growth_mib``: the larger growth of the two processes.
* ``partition_runs``, ``lost``, ``duplicated``, ``max_stall_s``, ``stall_bound_s``:
  partition scenarios on emulated hosts (``benchmarks/scenarios/partition.py``, and cuts
  from the manager under ``clusterflow start``, ``benchmarks/scenarios/start.py``); records
  lost and applied twice over all of them (the counter model), and, of the times a task
  sat without progress or failure, the one nearest its documented bound (the largest
  stall / bound) with that bound; ``stalls_within_bound`` counts the runs within theirs.
  ``zombies_fenced``: zombie launches that ended by ``TaskFenced`` rather than by their
  own deadline (goal: every zombie scenario); ``zombie_served_after_fence``: their
  requests a ps or the dispatcher served after the fence was raised (goal 0);
  ``zombie_ended_after_heal_s``: the longest from the heal to a zombie's exit.
* ``lossy_max_param_diff``, ``lossy_throughput_ratio``: sync ps training on a clean and
  on a slow, lossy link (``benchmarks/scenarios/lossy.py``): the largest difference of
  the final parameters (goal 0) and steps/s lossy / clean.

Usage::

    python -m benchmarks.hostile [--quick] [--verbose]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import parser, result
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.rpc.fuzz import FIELDS, WireProbe, hostile_stream, raw_garbage

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "clusterflow.cli.main"]
BATCH = 1000
ANSWER_TIMEOUT_S = 20.0


def _wait_running(home: Path, cluster_id: str, timeout: float = 120.0) -> dict[str, object]:
    path = home / "clusters" / cluster_id / "state.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state: dict[str, object] = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("status") == "running":
            return state
        time.sleep(0.1)
    raise SystemExit(f"benchmark failed: cluster {cluster_id} not running in {timeout:g}s")


def fuzz(total: int, workdir: Path, verbose: bool) -> dict[str, float]:
    """Sends ``total`` hostile messages, half to the ps task, half to the manager."""
    home = workdir / "home"
    env = {**os.environ, "CLUSTERFLOW_HOME": str(home)}
    job = workdir / "sleep.py"
    job.write_text("import time\ntime.sleep(3600)\n")
    done = subprocess.run(
        [*CLI, "start", "--detach", "--ps", "1", "--workers", "1", "--", sys.executable, str(job)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"benchmark failed: clusterflow start: {done.stderr.strip()}")
    cluster_id = done.stdout.strip()
    try:
        state = _wait_running(home, cluster_id)
        creds = Credentials.from_file(home / "clusters" / cluster_id / "secret")
        manager = state["manager"]
        tasks = state["tasks"]
        assert isinstance(manager, dict) and isinstance(tasks, list)
        ps_address = next(t["address"] for t in tasks if t["task"] == "ps:0")
        procs = {"manager": psutil.Process(manager["pid"])}
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("CLUSTERFLOW_HOME") == str(home) and (
                    "clusterflow.ps" in " ".join(proc.cmdline())
                ):
                    procs["ps"] = proc
            except psutil.Error:
                continue
        rss0 = {name: p.memory_info().rss for name, p in procs.items()}
        targets = [
            (ps_address, [m for m in FIELDS if m.startswith(("ps.", "health."))], "health.ping"),
            (
                str(manager["address"]),
                [m for m in FIELDS if m.startswith(("data.", "manager.", "task.", "trial."))],
                "manager.status",
            ),
        ]
        sent = unanswered = internal = crashes = garbage = 0
        rng = random.Random(0)
        started = time.monotonic()
        for address, methods, good_method in targets:
            good = RpcClient(address, creds, deadline=ANSWER_TIMEOUT_S)
            with WireProbe(address, creds) as probe:
                for batch in range(total // 2 // BATCH):
                    stream = hostile_stream(batch, methods, BATCH, first_id=batch * BATCH + 1)
                    got = probe.run(stream, answer_timeout_s=ANSWER_TIMEOUT_S)
                    sent += got.sent
                    unanswered += len(got.unanswered_ids)
                    internal += sum(got.internal.values())
                    try:
                        good.call(good_method)
                    except Exception as exc:
                        crashes += 1
                        print(f"good client failed: {exc}", flush=True)
                    if batch % 10 == 0:
                        raw_garbage(address, rng.randbytes(rng.randrange(1, 8192)))
                        garbage += 1
                    if verbose and batch % 10 == 0:
                        print(f"{address}: {sent} sent, {time.monotonic() - started:.0f}s")
            good.close()
        crashes += sum(1 for p in procs.values() if not p.is_running())
        growths = {
            name: (p.memory_info().rss - rss0[name]) / 2**20
            for name, p in procs.items()
            if p.is_running()
        }
        print(", ".join(f"{n} grew {g:.1f} MiB" for n, g in growths.items()), flush=True)
        growth = max(growths.values())
        print(
            f"fuzz: {sent + garbage} inputs in {time.monotonic() - started:.0f}s, "
            f"{unanswered} unanswered, {internal} internal, {crashes} crashes, "
            f"rss growth {growth:.1f} MiB",
            flush=True,
        )
        return {
            "fuzz_inputs": sent + garbage,
            "fuzz_crashes": crashes,
            "fuzz_unanswered": unanswered,
            "fuzz_internal": internal,
            "fuzz_rss_growth_mib": round(growth, 1),
        }
    finally:
        subprocess.run([*CLI, "stop", cluster_id], capture_output=True, env=env, check=False)


def partitions(workdir: Path) -> dict[str, float]:
    """Every scenario of ``scenarios.partition`` once, on fresh emulated hosts."""
    from benchmarks.scenarios.partition import SCENARIOS, run
    from clusterflow.testing import available

    if not available():
        print("partitions: not run (emulated hosts need root and iproute2)", flush=True)
        return {"partition_runs": 0}
    outcomes = []
    for scenario in SCENARIOS:
        outcome = run(scenario, workdir / scenario)
        print(
            f"partition {scenario}: lost {outcome.lost}, duplicated {outcome.duplicated}, "
            f"stall {outcome.stall_s:.1f}s (bound {outcome.stall_bound_s:.1f}s); "
            f"the cut-off launch ended: {outcome.first_exit}",
            flush=True,
        )
        outcomes.append(outcome)
    start = start_partitions(workdir / "start")
    stalls = [(o.stall_s, o.stall_bound_s) for o in outcomes] + start.pop("stalls")
    worst = max(stalls, key=lambda s: s[0] / s[1])
    zombies = [o for o in outcomes if o.scenario.startswith("zombie")]
    return {
        "partition_runs": len(stalls),
        "lost": sum(o.lost for o in outcomes) + start["lost"],
        "duplicated": sum(o.duplicated for o in outcomes) + start["duplicated"],
        "max_stall_s": worst[0],
        "stall_bound_s": worst[1],
        "stalls_within_bound": sum(stall <= bound for stall, bound in stalls),
        "zombies_fenced": sum(o.fenced for o in zombies),
        "zombie_served_after_fence": sum(o.served_after_fence for o in zombies),
        "zombie_ended_after_heal_s": max((o.ended_after_heal_s for o in zombies), default=0.0),
    }


def start_partitions(workdir: Path) -> dict[str, Any]:
    """Cuts from the manager under ``clusterflow start`` (``scenarios.start``): one run,
    each cut a partition scenario; its stalls (cut to the cut-off task's exit) and bounds."""
    from benchmarks.scenarios.start import RECORDS, run

    result = run(workdir)
    for cut in result.cuts:
        print(
            f"partition {cut.scenario} (clusterflow start): {cut.task} ended "
            f"{cut.stall_s:.1f}s after the cut (bound {cut.stall_bound_s:.1f}s), "
            f"{'before' if cut.ended_before_heal else 'AFTER'} the heal; the manager: "
            f"{cut.recovery}",
            flush=True,
        )
    print(
        f"partitions under clusterflow start: run {result.status}, lost {result.lost}, "
        f"duplicated {result.duplicated} of {RECORDS} records",
        flush=True,
    )
    failed = result.status != "succeeded"
    return {
        "lost": RECORDS if failed else result.lost,
        "duplicated": result.duplicated,
        "stalls": [(c.stall_s, c.stall_bound_s) for c in result.cuts],
    }


def lossy(workdir: Path) -> dict[str, float]:
    """Sync training on a clean and on a slow, lossy link (``scenarios.lossy``)."""
    from benchmarks.scenarios.lossy import compare
    from clusterflow.testing import available

    if not available():
        print("lossy links: not run (emulated hosts need root and iproute2)", flush=True)
        return {}
    figures = compare(workdir / "lossy")
    print(
        f"lossy links: final parameters differ by at most {figures['lossy_max_param_diff']:g}; "
        f"throughput kept {figures['lossy_throughput_ratio']:.2f}",
        flush=True,
    )
    return figures


def main() -> None:
    args = parser("hostile", __doc__).parse_args()
    total = 100_000 if args.quick else 200_000
    with tempfile.TemporaryDirectory(prefix="cf-hostile-") as tmp:
        figures = fuzz(total, Path(tmp), args.verbose)
        figures.update(partitions(Path(tmp)))
        figures.update(lossy(Path(tmp)))
    result("hostile", **figures)


if __name__ == "__main__":
    main()
