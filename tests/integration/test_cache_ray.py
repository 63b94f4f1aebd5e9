"""Caches on a real multi-node Ray cluster (every node on an emulated host of its own,
with distinct labels): a cache actor per node, workers
placed on the partitions' nodes, reads local where they lie, and a cache node killed
mid-epoch with every record still read exactly once.

One Ray cluster serves the module, one node per emulated host (``clusterflow.testing``,
each its own network namespace and address): the head ``b`` and nodes ``c`` and ``d``
(``zone=<name>``). The finalizers kill every process on the hosts, remove them and the
caches' shared memory, even when a test failed.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterflow.testing import available
from conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

if not available():
    pytest.skip("needs root and iproute2 for the emulated hosts", allow_module_level=True)

from clusterflow.testing.ray_nodes import RayNodes  # noqa: E402 (after the skip)

REPO = Path(__file__).resolve().parents[2]
RECORDS = 40_960
JOB = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    import torch, torch.distributed as dist
    from clusterflow.data import distributed_dataset

    out, pause = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    data = distributed_dataset("cache://", batch_size=256, split_size=1024, seed=1)
    it, seen, steps = iter(data), [], 0
    while True:  # in lockstep, as synchronous training steps: one batch each a step
        batch = next(it, None)
        more = torch.tensor([0 if batch is None else 1])
        dist.all_reduce(more)
        if batch is not None:
            seen.extend(batch.data["id"].tolist())
            steps += 1
        if steps == pause:
            name = os.environ["CLUSTERFLOW_TASK"].replace(":", "-")
            (out / f"paused-{name}").write_text(os.environ["CLUSTERFLOW_NODE"])
            while not (out / "go").exists():
                time.sleep(0.05)
        if more.item() == 0:
            break
    result = {"ids": seen, "stats": data.source.stats(), "locality": data.status()["locality"],
              "node": os.environ["CLUSTERFLOW_NODE"]}
    data.close()
    name = os.environ["CLUSTERFLOW_TASK"].replace(":", "-")
    (out / f"{name}.json").write_text(json.dumps(result))
    """
)


ZONES = {"b": 0, "c": 1, "d": 2}
"""Cache nodes by zone -> their host (host 0 is the head)."""


class Nodes:
    """The module's Ray cluster and its nodes' ids by zone."""

    def __init__(self, ray: RayNodes) -> None:
        self.ray = ray
        self.address = ray.address
        found = {n["labels"].get("zone"): n["id"] for n in ray.probe()["nodes"]}
        self.ids: dict[str, str] = found
        self.zones = {v: k for k, v in found.items()}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Nodes]:
    with RayNodes(3, prefix="cache") as ray:
        ray.start_head("--num-cpus=1", "--labels=zone=b")
        for zone in "cd":
            ray.start_node(ZONES[zone], "--num-cpus=1", f"--labels=zone={zone}")

        def three() -> bool:
            return len(ray.probe()["nodes"]) >= 3

        wait_until(three, 90, "three Ray nodes")
        yield Nodes(ray)


@pytest.fixture
def cf(ray_cluster: Nodes, tmp_path: Path) -> Iterator[Any]:
    """``clusterflow ARGS`` in the namespace with this test's home; afterwards every cache
    it made is dropped and its shared memory removed."""
    home = tmp_path / "home"
    env = ray_cluster.ray.env(CLUSTERFLOW_HOME=str(home))
    names: list[str] = []

    def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("cache", "create"):
            names.append(args[2])
        cli = [sys.executable, "-m", "clusterflow.cli.main"]
        return ray_cluster.ray.run([*cli, *args], env=env, timeout=timeout, cwd=REPO)

    run.home = home  # type: ignore[attr-defined]
    yield run
    for name in names:
        with contextlib.suppress(subprocess.TimeoutExpired):
            run("cache", "drop", name, timeout=120)
        for path in Path("/dev/shm").glob(f"clusterflow-cache-{name}-*"):
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / "clusterflow-caches" / name, ignore_errors=True)


def write_parquet(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(RECORDS)
    x = np.random.default_rng(0).random((RECORDS, 4), dtype=np.float32)
    table = pa.table({"id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4)})
    pq.write_table(table, folder / "data.parquet", row_group_size=4096)
    return str(folder / "data.parquet")


def describe(cf: Any, name: str) -> dict[str, Any]:
    out = cf("cache", "describe", name, "--json")
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))]


def test_workers_run_on_the_partitions_nodes_and_read_locally(
    ray_cluster: Nodes, cf: Any, tmp_path: Path
) -> None:
    source = write_parquet(tmp_path / "src")
    address = ray_cluster.address
    name = f"loc{secrets.token_hex(2)}"
    made = cf(
        "cache", "create", name, "--from", source, "--partitions", "4",
        "--backend", "ray", "--address", address, "--label", "zone=in(b,c)",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    cache = describe(cf, name)
    zones = ray_cluster.zones
    owners = {zones[p[4]] for p in cache["partitions"]}
    assert owners == {"b", "c"}
    assert set(cache["servers"]) == {ray_cluster.ids["b"], ray_cluster.ids["c"]}

    out = tmp_path / "out"
    out.mkdir()
    (out / "go").touch()
    job = out / "job.py"
    job.write_text(JOB)
    done = cf(
        "start", "--backend", "ray", "--address", address, "--cache", name, "--workers", "2",
        "--", sys.executable, str(job), str(out), "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = results(out)
    assert len(got) == 2
    assert {zones[r["node"]] for r in got} == {"b", "c"}  # each worker on a cache node
    ids = sorted(i for r in got for i in r["ids"])
    assert ids == list(range(RECORDS))  # every record exactly once
    local = sum(r["stats"]["records_local"] for r in got)
    assert sum(r["stats"]["records_remote"] for r in got) + local == RECORDS
    assert local >= 0.95 * RECORDS, [r["stats"] for r in got]
    locality = got[0]["locality"]  # the dispatcher's own count of where splits went
    assert locality["located"] == RECORDS // 1024
    assert locality["local"] >= 0.95 * locality["located"], locality


def test_a_cache_node_killed_mid_epoch_loses_no_record(
    ray_cluster: Nodes, cf: Any, tmp_path: Path
) -> None:
    """Runs last: it kills a node. Partitions on b, c, d with a replica each; the two
    workers (kept off d by a label of their own) pause mid-epoch; d is killed; the
    keeper rebalances (replicas promoted, new replicas loaded); the run completes with
    every record read exactly once."""
    source = write_parquet(tmp_path / "src")
    address = ray_cluster.address
    name = f"ha{secrets.token_hex(2)}"
    made = cf(
        "cache", "create", name, "--from", source, "--partitions", "6", "--replicas", "1",
        "--backend", "ray", "--address", address, "--label", "zone=in(b,c,d)",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    zones = ray_cluster.zones
    before = describe(cf, name)
    assert {zones[p[4]] for p in before["partitions"]} == {"b", "c", "d"}
    assert all(p[5] is not None and p[5] != p[4] for p in before["partitions"])

    out = tmp_path / "out"
    out.mkdir()
    job = out / "job.py"
    job.write_text(JOB)
    cli = [sys.executable, "-m", "clusterflow.cli.main"]
    env = ray_cluster.ray.env(CLUSTERFLOW_HOME=str(cf.home))
    argv = [*cli, "start", "--backend", "ray", "--address", address, "--cache", name]
    argv += ["--workers", "2", "--label", "worker:zone=!d"]
    argv += ["--", sys.executable, str(job), str(out), "10"]
    proc = ray_cluster.ray.popen(argv, env=env, cwd=REPO)
    try:

        def both_paused() -> list[Path] | None:
            if proc.poll() is not None:
                raise AssertionError(f"start ended early: {proc.communicate()}")
            found = list(out.glob("paused-*"))
            return found if len(found) == 2 else None

        paused = wait_until(both_paused, 240, "both workers paused mid-epoch")
        assert {zones[p.read_text()] for p in paused} == {"b", "c"}
        idle = "d"  # the cache node that runs no worker
        ray_cluster.ray.kill_node(ZONES[idle])

        def rebalanced() -> dict[str, Any] | None:
            now = describe(cf, name)
            held = {n for p in now["partitions"] for n in (p[4], p[5]) if n}
            ok = now["status"] == "ready" and ray_cluster.ids[idle] not in held
            return now if ok else None

        after = wait_until(rebalanced, 120, "the keeper's rebalance")
        assert all(p[5] is not None for p in after["partitions"])  # replicas again
        assert any("lost" in event for event in after["events"]), after["events"]
        (out / "go").touch()
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    got = results(out)
    assert len(got) == 2
    ids = sorted(i for r in got for i in r["ids"])
    assert ids == list(range(RECORDS))  # every record exactly once, the lost node's too
