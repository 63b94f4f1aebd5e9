"""Parameter-server training on real clusters: ``clusterflow start --ps N --workers M``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from clusterflow.rpc import Credentials, RemoteError, RpcClient
from clusterflow.server import Server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _kill_leftovers(home: Path) -> list[int]:
    """Kills every process started for this test's CLUSTERFLOW_HOME; returns their pids."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("CLUSTERFLOW_HOME") == str(home) and proc.pid != os.getpid():
                found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return [p.pid for p in found]


def clean_environ() -> dict[str, str]:
    """This process's environment without what a surrounding cluster may have set.

    A test run inside a task of another cluster (or after a job leaked its variables)
    must not hand that cluster's TF_CONFIG, secret or manager to the one it starts.
    """
    return {
        k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("CLUSTERFLOW_")
    }


@pytest.fixture
def cluster_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    yield home
    leftovers = _kill_leftovers(home)
    assert not leftovers, f"processes outlived their cluster: {leftovers}"


def start(home: Path, args: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {**clean_environ(), "CLUSTERFLOW_HOME": str(home), "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "clusterflow.cli.main", "start", *args]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the manager stops its tasks
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"cluster did not finish in {timeout}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


SYNC_JOB = textwrap.dedent(
    """
    import os, sys, torch
    from clusterflow.ps.placement import MinSizePartitioner
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    out, optimizer_name = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))

    def batch(step, replica):
        g = torch.Generator().manual_seed(1000 * step + replica)
        return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

    strategy = ParameterServerStrategy(
        mode="sync", variable_partitioner=MinSizePartitioner(min_shard_bytes=512, max_shards=2)
    )
    with strategy.scope():
        model = make()
        if optimizer_name == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    history = []
    for i in range(5):
        strategy.run(step, batch(i, strategy.worker_index))
        strategy.pull_values()
        history.append([p.detach().clone() for p in model.parameters()])
    ps_shards = sorted({s.ps for shards in strategy.placement.shards.values() for s in shards})
    path = os.path.join(out, f"w{strategy.worker_index}.pt")
    torch.save({"history": history, "ps": ps_shards}, path)
    strategy.close()
    """
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_two_ps_two_workers_match_one_process(
    tmp_path: Path, cluster_home: Path, optimizer: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(SYNC_JOB)
    result = start(
        cluster_home,
        [
            "--ps",
            "2",
            "--workers",
            "2",
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
            optimizer,
        ],
    )
    assert result.returncode == 0, result.stdout[-4000:]

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    if optimizer == "sgd":
        ref_opt: torch.optim.Optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    else:
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    workers = [torch.load(tmp_path / f"w{i}.pt") for i in range(2)]
    assert all(w["ps"] == [0, 1] for w in workers)  # variables were spread over both ps tasks
    for step in range(5):
        xs, ys = [], []
        for replica in range(2):
            g = torch.Generator().manual_seed(1000 * step + replica)
            xs.append(torch.randn(16, 8, generator=g))
            ys.append(torch.randint(0, 3, (16,), generator=g))
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for w in workers:
            for got, want in zip(w["history"][step], ref.parameters(), strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


FINAL = re.compile(
    r"\[worker:(\d+)\] final test_accuracy ([0-9.]+) global_step (\d+) dropped_pushes (\d+)"
)


def finals(stdout: str) -> dict[int, tuple[float, int, int]]:
    """Each worker's final line of examples/digits_ps.py: accuracy, global step, drops."""
    return {int(m[1]): (float(m[2]), int(m[3]), int(m[4])) for m in FINAL.finditer(stdout)}


@pytest.mark.timeout(240)
def test_async_digits_reaches_accuracy(cluster_home: Path) -> None:
    example = ROOT / "examples" / "digits_ps.py"
    result = start(
        cluster_home,
        ["--ps", "1", "--workers", "2", "--", sys.executable, str(example), "--epochs", "6"],
    )
    assert result.returncode == 0, result.stdout[-4000:]
    got = finals(result.stdout)
    assert sorted(got) == [0, 1], result.stdout[-4000:]
    # Async mode drops nothing (no max_staleness). Every worker evaluates the ps's final
    # values, once both workers left (the example's wait_for_every_worker): the same
    # figures on both, every push of both in them, exactly 2 x 6 x 23 steps. (Without the
    # wait, the worker that finished first reported fewer steps and its own accuracy.)
    assert all(dropped == 0 for _, _, dropped in got.values())
    assert {(acc, step) for acc, step, _ in got.values()} == {(got[0][0], 2 * 6 * 23)}, got
    # Async Adam on digits gives 0.92-0.97 after 6 epochs; a broken optimizer or lost
    # updates stay far below (chance is 0.1).
    assert got[0][0] >= 0.90, got


BACKUP_JOB = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    strategy = ParameterServerStrategy(mode="sync", backup_workers=1)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    straggler = strategy.worker_index == 2

    def step(x, y):
        if straggler:
            time.sleep(0.3)  # a slow replica: its gradient is ready long after the others'
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    pushes = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        strategy.run(step, (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)))
        # the version this replica's gradients were computed at, and whether a step took them
        pushes.append([strategy.state_dict()["versions"][0], strategy.last_push_applied])
    strategy.leave()  # the data ran out: the last steps must not wait for this replica
    record = {"pushes": pushes, "dropped": strategy.dropped_pushes}
    if strategy.is_chief:
        record["stats"] = strategy.ps_stats()[0]
    with open(os.path.join(out, f"w{strategy.worker_index}.json"), "w") as f:
        json.dump(record, f)
    strategy.close()
    """
)


@pytest.mark.timeout(240)
def test_backup_workers_drop_a_stragglers_pushes_in_a_real_cluster(
    tmp_path: Path, cluster_home: Path
) -> None:
    """Three sync replicas, one backup: steps take the first two pushes and never wait
    for the straggler, and the run ends when the data does."""
    script = tmp_path / "job.py"
    script.write_text(BACKUP_JOB)
    steps = 12
    args = ["--ps", "1", "--workers", "3", "--", sys.executable, str(script), str(tmp_path)]
    result = start(cluster_home, [*args, str(steps)])
    # No hang at the end of the data: every replica left, the cluster ended by itself.
    assert result.returncode == 0, result.stdout[-4000:]
    records = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(3)]
    assert all(len(r["pushes"]) == steps for r in records)

    # The straggler's late pushes were dropped, and each replica counted its own drops.
    assert records[2]["dropped"] >= 1, records[2]
    for r in records:
        assert r["dropped"] == sum(1 for _, applied in r["pushes"] if not applied)

    taken: dict[int, int] = {}
    for r in records:
        for version, applied in r["pushes"]:
            if applied:
                taken[version] = taken.get(version, 0) + 1
    # Every step committed exactly once, with contiguous versions ...
    assert sorted(taken) == list(range(len(taken))), taken
    # ... never with more than N = 3 - 1 pushes, and with exactly N while all three
    # replicas were still training (a step before any replica's last push).
    assert max(taken.values()) == 2, taken
    first_to_finish = min(r["pushes"][-1][0] for r in records)
    assert all(taken[v] == 2 for v in range(first_to_finish)), (first_to_finish, taken)
    dropped = sum(r["dropped"] for r in records)
    assert sum(taken.values()) == 3 * steps - dropped


@pytest.mark.timeout(240)
def test_digits_ps_example_with_backup_workers_ends_and_learns(cluster_home: Path) -> None:
    example = ROOT / "examples" / "digits_ps.py"
    result = start(
        cluster_home,
        [
            "--ps", "1", "--workers", "3", "--",
            sys.executable, str(example), "--mode", "sync", "--backup-workers", "1",
            "--epochs", "2",
        ],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]  # it ends when the data does
    got = finals(result.stdout)
    assert sorted(got) == [0, 1, 2], result.stdout[-4000:]
    # Sync Adam with steps of 2 x 64 examples: about 0.95 after 2 epochs.
    assert min(acc for acc, _, _ in got.values()) >= 0.85, got
    # 2 epochs x 23 batches on each of 3 replicas. A step takes 2 pushes, or 1 once two
    # replicas left; the replica that read the step last saw the final one.
    taken = 3 * 2 * 23 - sum(d for _, _, d in got.values())
    assert taken / 2 <= max(step for _, step, _ in got.values()) <= taken, got


def test_bad_pushes_get_error_replies_and_the_ps_keeps_serving(
    ps_server: tuple[Server, Credentials],
) -> None:
    server, credentials = ps_server
    config = {
        "mode": "async",
        "num_replicas": 2,
        "backup_workers": 0,
        "max_staleness": None,
        "stale_policy": "drop",
        "staleness_aware_lr": False,
        "warmup_steps": 0,
        "reject_nonfinite": True,
    }
    with (
        RpcClient(server.target, credentials, deadline=10) as one,
        RpcClient(server.target, credentials, deadline=10) as two,
    ):
        one.call(
            "ps.create",
            {"config": config, "vars": [{"name": "w", "shape": [2, 3], "dtype": "float32"}]},
            {"w": torch.ones(2, 3)},
        )
        one.call(
            "ps.optimizer", {"spec": {"name": "SGD", "groups": [{"lr": 0.5}]}, "group_of": {"w": 0}}
        )
        bad = [
            ({"g/w": torch.ones(3, 2)}, r"shape \(3, 2\)"),
            ({"g/w": torch.ones(2, 3, dtype=torch.float64)}, "float64"),
            ({"g/nope": torch.ones(1)}, "'nope'"),
            ({"g/w": torch.full((2, 3), float("nan"))}, "NaN"),
        ]
        for tensors, match in bad:
            with pytest.raises(RemoteError, match=match) as info:
                one.call("ps.push", {"worker": "worker:0", "version": 0}, tensors)
            assert info.value.code == "app" and info.value.error_type == "PushRejected"
        reply = two.call(
            "ps.push",
            {"worker": "worker:1", "version": 0, "want_values": True},
            {"g/w": torch.ones(2, 3)},
        )
        assert reply.body["applied"] and reply.body["version"] == 1
        assert torch.allclose(reply.tensors["w"], torch.full((2, 3), 0.5))
        pulled = one.call("ps.pull", {"names": ["w"]})
        assert pulled.body["version"] == 1 and torch.equal(pulled.tensors["w"], reply.tensors["w"])
        with pytest.raises(RemoteError, match="no variable 'x'"):
            one.call("ps.pull", {"names": ["x"]})
