"""``clusterflow tune --backend ray``: each trial a cluster placed on a real Ray cluster.

As in test_ray.py, the Ray cluster and every command under test run inside a network
namespace of this module's own with only loopback up, so nothing leaves it. One Ray node
(the head) declares 3 CPUs, more than this 2-core machine has: trials at once are bounded
by what the Ray cluster can place, not by the local cores. The module's finalizer kills
every process in the namespace and deletes it; each test's finalizer stops what the test
left and checks that no actor or placement group remains in the Ray cluster.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna  # a test dependency (the `test` extra): its absence is a failure, not a skip
import pytest

from clusterflow.manager.registry import TERMINAL
from clusterflow.manager.stopper import cluster_processes
from conftest import LineReader, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB = str(Path(__file__).with_name("tune_job.py"))
PORT = 6380
ADDRESS = f"127.0.0.1:{PORT}"
RAY_CPUS = 3

if shutil.which("ip") is None or os.geteuid() != 0:
    pytest.skip("needs root and iproute2 to make a network namespace", allow_module_level=True)


class Namespace:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CLUSTERFLOW_", "RAY_")) and k != "TF_CONFIG"
        }
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        # A HOME of its own: Ray reads ~/.ray (an auth token another run may have left).
        env["HOME"] = str(self.root / "home")
        return {**env, **extra}

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        check = kwargs.pop("check", False)
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            text=True,
            capture_output=True,
            check=check,
            **kwargs,
        )

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **kwargs,
        )

    def probe(self) -> dict[str, Any]:
        """The Ray cluster's live actors and its placement groups' states."""
        script = (
            "import json, ray\n"
            f"ray.init(address={ADDRESS!r}, logging_level='ERROR', log_to_driver=False)\n"
            "from ray._private.state import actors\n"
            "live = [v.get('Name') or k for k, v in actors().items() if v['State'] != 'DEAD']\n"
            "groups = {k: v['state'] for k, v in ray.util.placement_group_table().items()}\n"
            "print(json.dumps({'actors': live, 'groups': groups}))\n"
        )
        out = self.run([sys.executable, "-c", script], env=self.env(), timeout=60)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def ray_ns() -> Iterator[Namespace]:
    name = f"tune-{secrets.token_hex(4)}"
    root = Path(tempfile.mkdtemp(prefix="tune-r-"))  # short: Ray's socket paths are bounded
    subprocess.run(["ip", "netns", "add", name], check=True)
    ns = Namespace(name, root)
    (root / "home").mkdir()
    try:
        ns.run(["ip", "link", "set", "lo", "up"], check=True)
        head = [str(BIN / "ray"), "start", "--head", f"--port={PORT}", f"--num-cpus={RAY_CPUS}"]
        head += ["--node-ip-address=127.0.0.1", "--include-dashboard=false"]
        head += ["--object-store-memory=100000000", f"--temp-dir={root / 'ray'}"]
        head += ["--disable-usage-stats"]
        out = ns.run(head, env=ns.env(CLUSTERFLOW_HOME=str(root / "node-home")), timeout=120)
        assert out.returncode == 0, out.stderr
        yield ns
    finally:
        # Every process in the namespace was started here: the Ray node and its workers.
        pids = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
        )
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(root, ignore_errors=True)


class Tuner:
    """The CLI inside the namespace, with this test's CLUSTERFLOW_HOME."""

    def __init__(self, ns: Namespace, home: Path) -> None:
        self.ns = ns
        self.home = home
        self.env = ns.env(CLUSTERFLOW_HOME=str(home), PYTHONUNBUFFERED="1")
        self.cli = [sys.executable, "-m", "clusterflow.cli.main"]

    def __call__(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.ns.run([*self.cli, *args], env=self.env, timeout=timeout, cwd=REPO)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return self.ns.popen([*self.cli, *args], env=self.env, cwd=REPO)

    def ids(self) -> list[str]:
        root = self.home / "clusters"
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def reports(self, cluster_id: str) -> list[dict[str, Any]]:
        path = self.home / "clusters" / cluster_id / "trial-report.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def state(self, cluster_id: str) -> dict[str, Any]:
        """The trial's mirror of its manager's state (the tuner refreshes it)."""
        path = self.home / "clusters" / cluster_id / "state.json"
        return dict(json.loads(path.read_text()))

    def study(self, name: str) -> Any:
        return optuna.load_study(study_name=name, storage=f"sqlite:///{self.home / 'studies.db'}")


@pytest.fixture
def tuner(ray_ns: Namespace, tmp_path: Path) -> Iterator[Tuner]:
    t = Tuner(ray_ns, tmp_path / "home")
    procs: list[subprocess.Popen[str]] = []
    t.popen = lambda *args: procs.append(Tuner.popen(t, *args)) or procs[-1]  # type: ignore[method-assign]
    yield t
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    for cluster_id in t.ids():
        if t.state(cluster_id)["status"] not in TERMINAL:
            t("stop", cluster_id, "--grace", "2", timeout=120)
    held = ray_ns.probe()
    assert not held["actors"], f"actors left behind: {held['actors']}"
    assert all(s == "REMOVED" for s in held["groups"].values()), held["groups"]
    assert not any(cluster_processes(c) for c in t.ids())


def _on_ray(study: str, *args: str) -> list[str]:
    return [
        "tune", "--study", study, "--param", "x=uniform:0:1", "--metric", "score",
        "--backend", "ray", "--address", ADDRESS, "--workers", "1",
        "--resources", "worker:CPU=1", *args,
    ]  # fmt: skip


def test_trials_are_ray_placed_clusters_as_many_as_ray_holds_stopped_by_ctrl_c(
    ray_ns: Namespace, tuner: Tuner, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    args = _on_ray("r", "--trials", "4", "--parallel", "4", "--pruner", "none", "--seed", "1")
    proc = tuner.popen(*args, "--", sys.executable, JOB, "hold", "{x}", "2", str(marks))
    out = LineReader(proc.stdout)  # type: ignore[arg-type]
    # Three CPUs in the Ray cluster, one per trial: three at once, not --parallel's four.
    out.wait_for(
        "running 3 trials at once, not 4: the Ray cluster's nodes hold no more; "
        "a trial takes CPU=1,memory=1G",
        timeout=120,
    )

    def three_reporting() -> list[str]:
        ids = [i for i in tuner.ids() if tuner.reports(i)]
        return ids if len(ids) == 3 else []

    running = wait_until(three_reporting, 150, "three trials reporting")
    assert len(tuner.ids()) == 3  # the fourth waits for a slot
    assert max(r["metrics"]["alive"] for i in running for r in tuner.reports(i)) == 3
    listing = tuner("ps")
    assert listing.returncode == 0, listing.stderr
    for cluster_id in running:
        assert cluster_id.startswith("r-t")
        line = next(line for line in listing.stdout.splitlines() if cluster_id in line)
        assert "running" in line, listing.stdout
        state = tuner.state(cluster_id)
        assert state["backend"] == "ray"
        assert state["manager"]["actor"] == f"clusterflow-{cluster_id}"
        assert state["tasks"][0]["resources"]["CPU"] == 1.0  # placed by Ray, as asked
        # The reports went to the manager on its node, and came back with the mirror.
        on_node = ray_ns.root / "node-home" / "ray" / cluster_id / "trial-report.jsonl"
        assert on_node.read_text().startswith(json.dumps({"step": 0})[:-1])
    held = ray_ns.probe()
    assert sum(s == "CREATED" for s in held["groups"].values()) == 3

    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 130
    for cluster_id in running:
        assert tuner.state(cluster_id)["status"] == "stopped"
    held = ray_ns.probe()
    assert not held["actors"] and all(s == "REMOVED" for s in held["groups"].values()), held

    # Their parameters wait in the study for `--resume` (test_tune.py resumes a study).
    trials = tuner.study("r").get_trials()
    interrupted = [t for t in trials if t.user_attrs.get("interrupted")]
    waiting = [t for t in trials if t.state.name == "WAITING"]
    assert len(interrupted) == 3 and all(t.state.name == "FAIL" for t in interrupted)
    queued = sorted(t.system_attrs["fixed_params"]["x"] for t in waiting)  # enqueue_trial's
    assert sorted(t.params["x"] for t in interrupted) == queued


def _tasks(tuner: Tuner, trial: Any) -> list[dict[str, Any]]:
    return list(tuner.state(trial.user_attrs["cluster_id"])["tasks"])


def test_a_pruned_ray_trial_is_stopped_and_leaves_nothing_in_ray(
    ray_ns: Namespace, tuner: Tuner, tmp_path: Path
) -> None:
    # Known values, in this order: two good trials, then a bad one the median pruner stops.
    storage = f"sqlite:///{tuner.home / 'studies.db'}"
    tuner.home.mkdir(parents=True)
    study = optuna.create_study(study_name="p", storage=storage, direction="maximize")
    for x in (0.3, 0.35, 0.95):
        study.enqueue_trial({"x": x})
    steps = 8
    done = tuner(
        *_on_ray("p", "--trials", "3", "--pruner", "median"),
        "--", sys.executable, JOB, "score", "{x}", str(steps), str(tmp_path / "marks"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    cluster_id = trials[2].user_attrs["cluster_id"]
    assert len(tuner.reports(cluster_id)) < steps  # stopped before its last step
    state = tuner.state(cluster_id)
    assert state["status"] == "stopped" and state["backend"] == "ray"
    assert tuner.state(trials[0].user_attrs["cluster_id"])["status"] == "succeeded"
    # Memory: the first trial asks for the estimate; each later one (one trial at a time)
    # for the trial before it's peak x 1.25, at least 256 MiB: trials are kept by the
    # study's command before {x} is filled in (manager/memory_sizing.py, memory_key).
    (asked,) = [t["memory_requested"] for t in _tasks(tuner, trials[0])]
    assert asked == 2**30
    for before, trial in itertools.pairwise(trials):
        (peak,) = [t["memory_peak"] for t in _tasks(tuner, before)]
        (asked,) = [t["memory_requested"] for t in _tasks(tuner, trial)]
        assert asked == pytest.approx(max(256 << 20, peak * 1.25))
    # The finalizer checks that no actor and no placement group is left in Ray.
