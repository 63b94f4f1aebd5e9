"""ClusterCoordinator on real clusters: `clusterflow start --chief --ps 1 --workers 2`.

Each test writes (or takes from examples/) the script every task runs: worker tasks
serve, the chief schedules and writes what it saw to a JSON file that the test reads.
No test sees a ``TF_CONFIG`` or ``CLUSTERFLOW_*`` variable of a surrounding cluster.
Every process a test starts is stopped when it ends, passed or failed, and a cluster
that ended by itself must have left no process behind. A few quick tests at the end
run the chief, the ps tasks and the workers as threads of this process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from clusterflow.manager.stopper import cluster_processes, kill_processes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LEFT_BEHIND_S = 30.0
"""How long a finished cluster's processes may take to exit: a bound on a hang, generous."""


def _inherited(name: str) -> bool:
    """A variable a surrounding cluster may have set (this test may run inside one)."""
    return name == "TF_CONFIG" or name.startswith("CLUSTERFLOW_")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No inherited cluster variable; no child process of this test outlives it."""
    for name in [n for n in os.environ if _inherited(n)]:
        monkeypatch.delenv(name)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    _assert_gone(
        lambda: [p for p in psutil.Process().children(recursive=True) if p.pid not in before],
        "child processes of the test",
    )


def _assert_gone(find: Callable[[], list[psutil.Process]], what: str) -> None:
    """Waits for ``find()`` to come back empty; kills and names what it still finds."""
    deadline = time.monotonic() + LEFT_BEHIND_S
    while (left := _alive(find())) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        names = []
        for proc in left:
            with contextlib.suppress(psutil.Error):
                names.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        kill_processes(left, grace_s=2.0)
        raise AssertionError(f"{what} left behind: {names}")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


# Every script starts the same way: worker tasks serve until the chief's coordinator
# closes; only the chief goes on. Nothing here imports torch before that split.
PRELUDE = """\
import json, os, sys, time
from clusterflow.strategies import TFConfigClusterResolver

OUT = sys.argv[1]
WORKER_TIMEOUT_S = float(sys.argv[2])
resolver = TFConfigClusterResolver()
"""

SERVE = """\
if resolver.task_type == "worker":
    from clusterflow.strategies.coordinator import serve_worker
    serve_worker()
    sys.exit(0)
"""

CHIEF = """\
import dataclasses
from clusterflow.strategies.coordinator import (
    ClusterCoordinator, DependencyError, FunctionError,
)
from clusterflow.strategies.parameter_server import ParameterServerStrategy

strategy = ParameterServerStrategy(resolver)
coordinator = ClusterCoordinator(strategy, worker_timeout_s=WORKER_TIMEOUT_S)


def log_run(name):
    with open(OUT + ".runs", "a") as f:  # one short append per run: atomic
        f.write(f"{name} {os.getpid()}\\n")


def log_order(event, name):
    # One append-mode file for every worker: the kernel orders the appends, so a line
    # written after another (as a dependent's start after its input's end) comes later.
    with open(OUT + ".order", "a") as f:
        f.write(f"{event} {name}\\n")


def finish(result):
    result["stats"] = dataclasses.asdict(coordinator.stats())
    coordinator.close()
    with open(OUT + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(OUT + ".tmp", OUT)
"""


@contextlib.contextmanager
def running_cluster(
    home: Path, command: list[str], extra: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """`clusterflow start` in its own session; on exit, stops it and everything it started.

    When the body returned normally, the cluster must also have left no process behind.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not _inherited(k)}
    env.update(CLUSTERFLOW_HOME=str(home), PYTHONUNBUFFERED="1")
    with (home / "output.log").open("wb") as output:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clusterflow.cli.main",
                "start",
                "--chief",
                "--ps",
                "1",
                "--workers",
                "2",
                "--untracked",
                "ps,worker",
                "--grace",
                "3",
                *extra,
                "--",
                *command,
            ],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        except BaseException:
            _stop_everything(proc, home)
            raise
        for cluster in (home / "clusters").glob("*"):
            find = functools.partial(cluster_processes, cluster.name)
            _assert_gone(find, f"processes of cluster {cluster.name}")
        _stop_everything(proc, home)


def _stop_everything(proc: subprocess.Popen[bytes], home: Path) -> None:
    if proc.poll() is None:
        # The manager takes SIGTERM as a stop request: it stops its tasks in order.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Whatever outlived the manager carries its cluster id in its environment.
    for cluster in (home / "clusters").glob("*"):
        kill_processes(cluster_processes(cluster.name), grace_s=2.0)


def wait_for(proc: subprocess.Popen[bytes], home: Path, timeout: float) -> str:
    """The run's output once `clusterflow start` exited 0 (or the test fails)."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    output = (home / "output.log").read_text(errors="replace")
    assert code == 0, f"clusterflow start exited {code}:\n{output[-4000:]}"
    return output


def run_script(home: Path, body: str, timeout: float = 90.0) -> dict[str, Any]:
    """Runs PRELUDE + SERVE + CHIEF + body on a cluster; returns what the chief wrote."""
    script = home / "script.py"
    home.mkdir(parents=True, exist_ok=True)
    script.write_text(PRELUDE + SERVE + CHIEF + textwrap.dedent(body))
    out = home / "result.json"
    # No worker fails here: a generous timeout, so a CPU-starved machine cannot fake one.
    command = [sys.executable, str(script), str(out), "20"]
    with running_cluster(home, command) as proc:
        wait_for(proc, home, timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    result["runs"] = [line.split() for line in Path(f"{out}.runs").read_text().splitlines()]
    order = Path(f"{out}.order")
    lines = order.read_text().splitlines() if order.exists() else []
    result["order"] = [" ".join(line.split()) for line in lines]
    return result


# Dataflow: one cluster, several behaviours ----------------------------------------

DATAFLOW = """\
def node(name, *inputs, delay=0.05):
    log_run(name)
    log_order("start", name)
    time.sleep(delay)  # work: a dependent that did not wait would start meanwhile
    value = name + "(" + ",".join(i["value"] for i in inputs) + ")"
    log_order("end", name)
    return {"name": name, "value": value}


def gather(parts):
    log_run("gather")
    return {
        "left": [p["value"] for p in parts["left"]],
        "right": [parts["right"][0]["value"], parts["right"][1]["d"]["value"]],
    }


def fail(name):
    log_run(name)
    raise ValueError(f"{name} failed on purpose")


# Each head is slow: a dependent that did not wait for it would start first.
f1 = coordinator.schedule(node, args=("f1",), kwargs={"delay": 0.6})
f2 = coordinator.schedule(node, args=("f2", f1))
f3 = coordinator.schedule(node, args=("f3", f2))

a = coordinator.schedule(node, args=("a",), kwargs={"delay": 0.5})
b = coordinator.schedule(node, args=("b", a))
c = coordinator.schedule(node, args=("c", a), kwargs={"delay": 0.3})
d = coordinator.schedule(node, args=("d", b, c))
nested = coordinator.schedule(gather, kwargs={"parts": {"left": [b], "right": (c, {"d": d})}})

fillers = [coordinator.schedule(node, args=(f"x{i}",)) for i in range(6)]
bad = coordinator.schedule(fail, args=("bad",))
after_bad = coordinator.schedule(node, args=("after_bad", bad))

result = {}
try:
    coordinator.join()
except FunctionError as exc:
    result["join_error"] = [type(exc).__name__, exc.error_type]
result["done_after_join"] = coordinator.done()
result["nodes"] = {
    rv.fetch()["name"]: rv.fetch() for rv in [f1, f2, f3, a, b, c, d, *fillers]
}
result["nested"] = nested.get()
for name, rv in (("bad", bad), ("after_bad", after_bad)):
    try:
        rv.fetch()
    except (FunctionError, DependencyError) as exc:
        cause = exc.__cause__
        result[name] = {
            "error": type(exc).__name__,
            "error_type": getattr(exc, "error_type", None),
            "cause": type(cause).__name__ if cause is not None else None,
            "message": str(exc),
        }
finish(result)
"""


@pytest.fixture(scope="module")
def dataflow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory.mktemp("dataflow"), DATAFLOW)


def ran_after(dataflow: dict[str, Any], dependent: str, *inputs: str) -> bool:
    """Whether ``dependent`` started after every one of ``inputs`` ended, in the log order.

    The order is what the functions themselves wrote to one file, on whichever worker
    they ran, never clocks compared across processes.
    """
    order: list[str] = dataflow["order"]
    for event in [f"start {dependent}"] + [f"end {i}" for i in inputs]:
        assert order.count(event) == 1, (event, order)
    started = order.index(f"start {dependent}")
    return all(order.index(f"end {i}") < started for i in inputs)


@pytest.mark.timeout(150)
def test_chain_runs_in_dependency_order(dataflow: dict[str, Any]) -> None:
    assert ran_after(dataflow, "f2", "f1")
    assert ran_after(dataflow, "f3", "f2")
    assert dataflow["nodes"]["f3"]["value"] == "f3(f2(f1()))"


@pytest.mark.timeout(150)
def test_diamond_waits_for_every_input(dataflow: dict[str, Any]) -> None:
    assert ran_after(dataflow, "b", "a")
    assert ran_after(dataflow, "c", "a")
    assert ran_after(dataflow, "d", "b", "c")
    assert dataflow["nodes"]["d"]["value"] == "d(b(a()),c(a()))"


@pytest.mark.timeout(150)
def test_remote_values_nested_in_arguments_are_replaced_by_values(
    dataflow: dict[str, Any],
) -> None:
    assert dataflow["nested"] == {
        "left": ["b(a())"],
        "right": ["c(a())", "d(b(a()),c(a()))"],
    }


@pytest.mark.timeout(150)
def test_function_error_surfaces_typed_and_is_not_retried(dataflow: dict[str, Any]) -> None:
    assert dataflow["bad"]["error"] == "FunctionError"
    assert dataflow["bad"]["error_type"] == "ValueError"
    assert dataflow["bad"]["cause"] == "ValueError"
    assert "bad failed on purpose" in dataflow["bad"]["message"]
    assert dataflow["join_error"] == ["FunctionError", "ValueError"]
    assert [name for name, _ in dataflow["runs"]].count("bad") == 1


@pytest.mark.timeout(150)
def test_dependents_of_a_failed_function_never_run(dataflow: dict[str, Any]) -> None:
    assert dataflow["after_bad"]["error"] == "DependencyError"
    assert dataflow["after_bad"]["cause"] == "FunctionError"
    ran = [name for name, _ in dataflow["runs"]]
    assert "after_bad" not in ran
    # Everything else ran exactly once (no worker failed), and join() waited for it all.
    assert sorted(ran) == sorted(
        ["f1", "f2", "f3", "a", "b", "c", "d", "gather", "bad"] + [f"x{i}" for i in range(6)]
    )
    assert dataflow["done_after_join"] is True
    stats = dataflow["stats"]
    assert (stats["scheduled"], stats["completed"], stats["failed"]) == (16, 14, 2)
    assert (stats["retried"], stats["pending"]) == (0, 0)


# A worker killed mid-run ----------------------------------------------------------

# The worker tasks serve from a forked child, and the test SIGKILLs that child. Killing
# the task's whole process group would fail the run: the manager's policy today ends
# the cluster on any task's non-zero exit (respawning a worker alone is the
# fault-tolerance issue's). The coordinator's view is the same either way: the
# process that served the worker's address is gone mid-call.
FORKED_SERVE = """\
if resolver.task_type == "worker":
    import signal
    child = os.fork()
    if child == 0:
        from clusterflow.strategies.coordinator import serve_worker
        try:
            serve_worker()
        finally:
            os._exit(0)
    os.close(int(os.environ["CLUSTERFLOW_LISTEN_FD"]))  # the child owns the port now
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    os.waitpid(child, 0)
    while True:
        signal.pause()
"""

KILLED_WORKER = """\
VICTIM = 3  # the call the test kills its worker during


def work(i, marker):
    log_run(str(i))
    if i == VICTIM:
        try:
            claim = os.open(marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass  # the re-run, on the other worker
        else:
            os.close(claim)
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
            time.sleep(120)  # until the test kills this worker
    time.sleep(0.15)
    return {"i": i, "square": i * i, "pid": os.getpid()}


values = [coordinator.schedule(work, args=(i, OUT + ".victim")) for i in range(24)]
coordinator.join()
finish({"results": [v.fetch() for v in values]})
"""


@pytest.mark.timeout(150)
def test_worker_killed_mid_run_still_completes_every_function(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + FORKED_SERVE + CHIEF + KILLED_WORKER)
    out = tmp_path / "result.json"
    marker = Path(f"{out}.victim")
    # Short, so the kill is noticed quickly; a live worker answers a poll within it.
    command = [sys.executable, str(script), str(out), "4"]
    with running_cluster(tmp_path, command) as proc:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "output.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the victim call never started"
            time.sleep(0.05)
        victim = int(marker.read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(proc, tmp_path, 90)
    result = json.loads(out.read_text())
    results = result["results"]

    assert [r["i"] for r in results] == list(range(24))
    assert all(r["square"] == r["i"] ** 2 for r in results)
    assert results[3]["pid"] != victim  # re-run on the other worker
    stats = result["stats"]
    assert stats["scheduled"] == stats["completed"] == 24
    assert (stats["failed"], stats["pending"]) == (0, 0)
    assert stats["retried"] >= 1
    runs = [line.split() for line in Path(f"{out}.runs").read_text().splitlines()]
    assert sorted({int(i) for i, _ in runs}) == list(range(24))
    assert [i for i, _ in runs].count("3") >= 2  # at least once: the killed call ran again


RESPAWNED_WORKER = KILLED_WORKER.replace(
    "values = [coordinator",
    """
def wait_for_both(deadline_s=90):
    end = time.monotonic() + deadline_s
    while coordinator.stats().workers_up < 2:
        assert time.monotonic() < end, "the respawned worker never served again"
        time.sleep(0.05)

values = [coordinator""",
).replace(
    'finish({"results": [v.fetch() for v in values]})',
    """wait_for_both()
later = [coordinator.schedule(work, args=(100 + i, OUT + ".victim")) for i in range(6)]
coordinator.join()
finish({"results": [v.fetch() for v in values], "later": [v.fetch() for v in later]})""",
)


@pytest.mark.timeout(180)
def test_a_killed_worker_task_is_respawned_on_a_new_address_and_used_again(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + SERVE + CHIEF + RESPAWNED_WORKER)
    out = tmp_path / "result.json"
    marker = Path(f"{out}.victim")
    command = [sys.executable, str(script), str(out), "4"]
    with running_cluster(tmp_path, command, ("--max-restarts", "2")) as proc:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, (tmp_path / "output.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the victim call never started"
            time.sleep(0.05)
        victim = int(marker.read_text())
        os.kill(victim, signal.SIGKILL)  # the whole worker task's job, not a child of it
        wait_for(proc, tmp_path, 120)
    result = json.loads(out.read_text())
    assert [r["i"] for r in result["results"]] == list(range(24))
    assert result["stats"]["failed"] == 0
    # The manager respawned the worker; its new address reached the coordinator through
    # the newer spec version, and the second batch ran on it too.
    later_pids = {r["pid"] for r in result["later"]}
    first_pids = {r["pid"] for r in result["results"]}
    assert victim not in later_pids
    assert later_pids - first_pids, (later_pids, first_pids)
    clusters = list((tmp_path / "clusters").iterdir())
    events = [json.loads(line) for line in (clusters[0] / "events.jsonl").open()]
    (first,) = [e for e in events if e["event"] == "spec_assembled"]
    moved = [e for e in events if e["event"] == "spec_updated"]
    assert len(moved) == 1 and moved[0]["task"] in ("worker:0", "worker:1"), moved
    index = int(moved[0]["task"].split(":")[1])
    assert moved[0]["address"] != first["spec"]["worker"][index], (first, moved)  # a new one
    assert moved[0]["version"] > first["version"]


# Training -------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_training_through_the_coordinator_updates_the_ps_variables(tmp_path: Path) -> None:
    example = ROOT / "examples" / "digits_coordinator.py"
    with running_cluster(tmp_path, [sys.executable, str(example), "--epochs", "8"]) as proc:
        output = wait_for(proc, tmp_path, 120)
    losses = [float(x) for x in re.findall(r"\[chief:0\] epoch \d+ loss ([\d.]+)", output)]
    assert len(losses) == 8, output[-4000:]
    assert losses[-1] < 0.5 * losses[0]
    final = re.search(
        r"final test_accuracy ([\d.]+) parameters_moved ([\d.]+) steps (\d+) retried (\d+)",
        output,
    )
    assert final is not None, output[-4000:]
    accuracy, moved, steps = float(final[1]), float(final[2]), int(final[3])
    assert accuracy >= 0.9
    assert moved > 0.01  # the chief pulled values the workers' pushes changed
    assert steps == 8 * 23  # 1437 training images in batches of 64


# In one process: servers on 127.0.0.1, the chief in the test's thread ----------------


@dataclass
class LocalCluster:
    spec: dict[str, list[str]]
    credentials: Any
    workers: list[Any]
    """The ``WorkerService`` of each worker that serves (``serve``) so far."""
    worker_servers: list[Any]

    def strategy(self, **options: Any) -> Any:
        from clusterflow.strategies import SimpleClusterResolver
        from clusterflow.strategies.parameter_server import ParameterServerStrategy

        resolver = SimpleClusterResolver(
            self.spec, task_type="chief", task_id=0, credentials=self.credentials
        )
        return ParameterServerStrategy(resolver, **options)

    def serve(self, index: int) -> None:
        """Worker ``index`` starts serving the coordinator (until then its port answers
        nothing the coordinator's probe accepts)."""
        from clusterflow.strategies.coordinator.worker import WorkerService

        self.workers.append(WorkerService(self.worker_servers[index]))


@contextlib.contextmanager
def _local_cluster(serving: tuple[int, ...]) -> Iterator[LocalCluster]:
    """Two ps and two workers in this process; the workers in ``serving`` serve at once."""
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials, RpcServer
    from clusterflow.server import Server

    credentials = Credentials.generate()
    # Bound first, so the spec holds ports nobody else can take meanwhile.
    rpcs = {name: RpcServer(credentials) for name in ("ps0", "ps1", "w0", "w1")}
    spec = {
        "chief": ["127.0.0.1:1"],  # the test itself: never dialled
        "ps": [rpcs["ps0"].address, rpcs["ps1"].address],
        "worker": [rpcs["w0"].address, rpcs["w1"].address],
    }
    servers = [Server(spec, "ps", i, credentials=credentials, _rpc=rpcs[f"ps{i}"]) for i in (0, 1)]
    for server in servers:
        PSService(server)
    workers = [
        Server(spec, "worker", i, credentials=credentials, _rpc=rpcs[f"w{i}"]) for i in (0, 1)
    ]
    servers.extend(workers)
    cluster = LocalCluster(spec, credentials, [], workers)
    try:
        for index in serving:
            cluster.serve(index)
        yield cluster
    finally:
        for service in cluster.workers:
            service.close()
        for server in servers:
            server.stop()


@pytest.fixture
def local_cluster() -> Iterator[LocalCluster]:
    with _local_cluster(serving=(0, 1)) as cluster:
        yield cluster


@pytest.mark.timeout(60)
def test_functions_start_in_the_order_they_were_scheduled() -> None:
    """TensorFlow's closure queue: one queue, oldest first. The functions are scheduled
    while no worker serves; then one worker runs them all, so the order it starts them
    in is the queue's. (Per-worker queues dealt them out 1, 3, 5, ... and 2, 4, ...: the
    one worker up ran its own share first, and a step scheduled last ran early.)"""
    from clusterflow.strategies.coordinator import ClusterCoordinator

    def started() -> int:
        return time.monotonic_ns()

    with _local_cluster(serving=()) as cluster:
        strategy = cluster.strategy()
        with ClusterCoordinator(strategy, worker_timeout_s=10) as coordinator:
            stamps = [coordinator.schedule(started) for _ in range(10)]
            cluster.serve(0)
            coordinator.join()
            order = [value.fetch() for value in stamps]
        strategy.close()
    assert order == sorted(order), order


@pytest.mark.timeout(60)
def test_strategy_run_inside_a_function_trains_variables_sharded_over_two_ps(
    local_cluster: LocalCluster,
) -> None:
    import torch
    import torch.nn.functional as F

    from clusterflow.ps.placement import MinSizePartitioner
    from clusterflow.strategies.coordinator import ClusterCoordinator

    strategy = local_cluster.strategy(
        variable_partitioner=MinSizePartitioner(min_shard_bytes=64, max_shards=2)
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert any(len(shards) == 2 for shards in strategy.placement.shards.values())
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()

    def train(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        def replica_step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(a), b)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        return strategy.run(replica_step, args=(xb, yb))  # type: ignore[no-any-return]

    def values() -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()]

    with ClusterCoordinator(strategy, worker_timeout_s=10) as coordinator:
        losses = [coordinator.schedule(train, args=(x, y)) for _ in range(40)]
        coordinator.join()
        seen_by_a_worker = coordinator.schedule(values).fetch()
        initial = values()
        coordinator.pull_variables()
    assert float(losses[-1].fetch()) < 0.8 * float(losses[0].fetch())
    assert all(torch.equal(a, b) for a, b in zip(seen_by_a_worker, values(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(initial, values(), strict=True))
    assert sum(w.executed for w in local_cluster.workers) == 41
    strategy.close()


@pytest.mark.timeout(60)
def test_what_cannot_travel_is_refused_at_schedule(local_cluster: LocalCluster) -> None:
    import threading

    from clusterflow.errors import ConfigError
    from clusterflow.strategies.coordinator import ClusterCoordinator, SerializationError

    strategy = local_cluster.strategy()
    with ClusterCoordinator(strategy, worker_timeout_s=10) as coordinator:
        first = coordinator.schedule(int, args=("1",))
        with pytest.raises(SerializationError, match="pass it as an argument"):
            coordinator.schedule(lambda: first.fetch() + 1)
        with pytest.raises(SerializationError, match="arguments of"):
            coordinator.schedule(print, args=(threading.Lock(),))
        assert coordinator.schedule(lambda a: a + 1, args=(first,)).fetch() == 2
        with (
            ClusterCoordinator(strategy, worker_timeout_s=10) as other,
            pytest.raises(ConfigError, match="another ClusterCoordinator"),
        ):
            other.schedule(int, args=(first,))
    strategy.close()


@pytest.mark.timeout(60)
def test_close_fails_unfinished_functions_and_stops_the_workers(
    local_cluster: LocalCluster,
) -> None:
    from clusterflow.strategies.coordinator import ClusterCoordinator, CoordinatorClosed

    strategy = local_cluster.strategy()
    coordinator = ClusterCoordinator(strategy, worker_timeout_s=10)
    slow = [coordinator.schedule(time.sleep, args=(0.5,)) for _ in range(6)]
    coordinator.close()
    with pytest.raises(CoordinatorClosed):
        slow[-1].fetch(timeout=5)
    with pytest.raises(CoordinatorClosed):
        coordinator.schedule(time.sleep, args=(0,))
    assert all(w.stopped.is_set() for w in local_cluster.workers)
    strategy.close()
