"""No command hangs: real CLI processes, real signals, addresses where no Ray answers.

Joining a Ray address where nothing (or no Ray) answers used to wait about ten minutes
inside ``ray.init``, deaf to Ctrl-C and SIGTERM, and the folder such a killed ``start``
left behind made ``ps``, ``describe`` and ``stop`` wait the same way. Here every such
command must end by itself, with one line naming the address, or at the first signal.
The ``wait`` timeouts below only catch a hang; they measure nothing.

No Ray cluster is started: a refused address is a port held on 127.0.0.2 without
listening, a silent one a listener that accepts and never speaks (127.0.0.2: loopback,
which Ray does not rewrite to the machine's address as it does 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conftest import wait_until

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
pytest.importorskip("ray", reason="joining Ray needs Ray")

PY = sys.executable
ENDS_S = 60.0
"""How long a command may take to end before the test calls it hung (a safety net)."""
GATED = """\
import os, sys, time
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


class Silent:
    """A TCP listener that accepts every connection, counts it, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.2", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.2:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        # shutdown first: a bare close leaves the socket listening, in the kernel, under
        # the accept blocked on it, and the cf fixture's `stop` then waits out Ray's join
        # deadline (60 s) on an address that should refuse it at once.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    listener = Silent()
    yield listener
    listener.close()


@pytest.fixture
def refused() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))  # held, never listening: every connection is refused
    yield f"127.0.0.2:{sock.getsockname()[1]}"
    sock.close()


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _half_created(cf: Clusterflow, address: str, state: dict[str, Any] | None = None) -> str:
    """A cluster folder as a `start --backend ray` killed while it joined leaves it
    (manager/registry.py's layout): the config, no state (``created``), or ``state``."""
    from clusterflow.manager import registry

    cluster = registry.create()
    config = {"backend": "ray", "address": address, "command": [PY, "-c", "pass"]}
    registry.write_json_atomic(cluster.config_file, config)
    if state is not None:
        registry.write_json_atomic(cluster.state_file, state)
    return cluster.id


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_start_joining_a_silent_address_ends_at_the_first_signal(
    cf: Clusterflow, silent: Silent, signum: int, code: int
) -> None:
    """Pins the join running off the main thread (ray_driver._init_within) and the CLI's
    SIGTERM handler (interrupts.install): Ray's own wait took neither signal."""
    start = cf.popen(
        "start", "--backend", "ray", "--address", silent.address, "--", PY, "-c", "pass",
        env={"CLUSTERFLOW_RAY_JOIN_TIMEOUT": "3600"},
    )  # fmt: skip
    # The probe's connection, then Ray's own: ray.init waits there now.
    wait_until(lambda: silent.accepted >= 2 or start.poll() is not None, ENDS_S, "Ray's connect")
    assert start.poll() is None, start.communicate()
    start.send_signal(signum)
    assert start.wait(ENDS_S) == code
    _, stderr = start.communicate()
    assert "Traceback" not in stderr
    # It ended while Ray still waited: ray.init on the main thread takes a signal only
    # once its GCS client gives up a wait (about 35 s in), after printing this line.
    assert "Failed to get cluster ID" not in stderr
    state = cf.state(cf.only_id())
    assert state["status"] == "failed"
    assert (
        state["summary"] == "never started: interrupted while it joined Ray or placed the cluster"
    )
    listed = cf.run("ps", "-a")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == [cf.only_id(), "failed"]


def test_start_at_a_silent_address_ends_at_the_join_deadline_with_one_line(
    cf: Clusterflow, silent: Silent
) -> None:
    out = cf.run(
        "start", "--backend", "ray", "--address", silent.address, "--", PY, "-c", "pass",
        env={"CLUSTERFLOW_RAY_JOIN_TIMEOUT": "2"}, timeout=ENDS_S,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert _errors(out.stderr) == [
        f"error: cannot join the Ray cluster at {silent.address}: it accepts connections but "
        "did not answer as Ray within 2s (if it is only slow, raise CLUSTERFLOW_RAY_JOIN_TIMEOUT)"
    ]
    assert "Traceback" not in out.stderr


def test_start_and_cache_create_at_a_refused_address_are_one_line(
    cf: Clusterflow, refused: str
) -> None:
    out = cf.run("start", "--backend", "ray", "--address", refused, "--", PY, "-c", "pass")
    why = "nothing listens there (connection refused)"
    line = f"error: cannot join the Ray cluster at {refused}: {why}"
    assert (out.returncode, out.stderr.splitlines()) == (2, [line])
    # Recorded as never started, saying why: `ps -a` and `describe` show it, never `created`.
    described = cf.run("describe", cf.only_id())
    assert described.returncode == 0, described.stderr
    assert "status:   failed" in described.stdout
    assert f"summary:  {line.removeprefix('error: ')} (exit code 2)" in described.stdout

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = cf.workdir / "data.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), data)
    out = cf.run(
        "cache", "create", "c", "--from", str(data), "--partitions", "1",
        "--backend", "ray", "--address", refused,
    )  # fmt: skip
    assert (out.returncode, out.stderr.splitlines()) == (2, [line])


def test_start_auto_names_the_stale_ray_current_cluster_it_read(
    cf: Clusterflow, refused: str, tmp_path: Path
) -> None:
    (tmp_path / "ray").mkdir()
    stale = tmp_path / "ray" / "ray_current_cluster"
    stale.write_text(refused)  # what a stopped `ray start --head` leaves behind
    out = cf.run(
        "start", "--backend", "ray", "--address", "auto", "--", PY, "-c", "pass",
        env={"RAY_TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert (out.returncode, out.stderr.splitlines()) == (
        2,
        [
            f"error: cannot join the Ray cluster at {refused} (auto: read from {stale}, which "
            "a stopped Ray leaves behind): nothing listens there (connection refused)"
        ],
    )


def test_a_half_created_folder_never_blocks_ps_describe_logs_attach_or_stop(
    cf: Clusterflow, refused: str
) -> None:
    """Pins ray_host.read (unreachable, not an error or a wait) and ray_host.stop's
    never-started path."""
    cluster_id = _half_created(cf, refused)
    why = f"cannot join the Ray cluster at {refused}: nothing listens there (connection refused)"
    for argv in (["ps"], ["ps", "-a"]):
        listed = cf.run(*argv, timeout=ENDS_S)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].split()[:2] == [cluster_id, "unreachable"]
        assert listed.stderr.splitlines() == [f"warning: cluster {cluster_id}: {why}"]

    described = cf.run("describe", cluster_id, timeout=ENDS_S)
    assert described.returncode == 0, described.stderr
    assert "status:   unreachable" in described.stdout
    assert f"summary:  {why}" in described.stdout
    as_json = cf.run("describe", cluster_id, "--json", timeout=ENDS_S)
    assert json.loads(as_json.stdout)["status"] == "unreachable"

    logs = cf.run("logs", cluster_id, "-f", timeout=ENDS_S)
    assert (logs.returncode, logs.stdout) == (0, ""), logs.stderr
    attach = cf.run("attach", cluster_id, timeout=ENDS_S)
    assert (attach.returncode, _errors(attach.stderr)) == (
        2,
        [f"error: cluster {cluster_id}: {why}"],
    )

    stopped = cf.run("stop", cluster_id, timeout=ENDS_S)
    assert (stopped.returncode, stopped.stdout) == (
        0,
        f"{cluster_id}: not running (never started: {why})\n",
    ), stopped.stderr
    state = cf.state(cluster_id)
    assert (state["status"], state["summary"]) == ("failed", f"never started: {why}")
    assert cf.run("ps").stdout.splitlines()[1:] == []  # it left `ps`


def test_a_manager_whose_ray_does_not_answer_reads_unreachable(
    cf: Clusterflow, silent: Silent
) -> None:
    """A running cluster's mirror whose Ray address accepts but never answers: `ps` and
    `stop` end at the join's deadline (a real ray.init, stuck on its thread)."""
    from clusterflow.manager.state import ClusterState, ManagerProcess

    running = ClusterState(
        id="x", status="running", backend="ray", manager=ManagerProcess(actor="clusterflow-x")
    )
    cluster_id = _half_created(cf, silent.address, running.to_dict())
    env = {"CLUSTERFLOW_RAY_JOIN_TIMEOUT": "2"}
    why = (
        f"cannot join the Ray cluster at {silent.address}: it accepts connections but did not "
        "answer as Ray within 2s (if it is only slow, raise CLUSTERFLOW_RAY_JOIN_TIMEOUT)"
    )
    listed = cf.run("ps", env=env, timeout=ENDS_S)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[:2] == [cluster_id, "unreachable"]
    assert f"warning: cluster {cluster_id}: {why}" in listed.stderr.splitlines()
    stopped = cf.run("stop", cluster_id, env=env, timeout=ENDS_S)
    assert (stopped.returncode, _errors(stopped.stderr)) == (2, [f"error: {why}"])
    assert cf.state(cluster_id)["status"] == "running"  # the mirror keeps what it knew


def test_the_dashboard_lists_a_half_created_folder_as_unreachable(
    cf: Clusterflow, refused: str
) -> None:
    from clusterflow.ui import views

    cluster_id = _half_created(cf, refused)
    (row,) = views.cluster_rows()
    assert (row["id"], row["status"]) == (cluster_id, "unreachable")
    assert row["summary"] == (
        f"cannot join the Ray cluster at {refused}: nothing listens there (connection refused)"
    )


@pytest.mark.parametrize("command", ["attach", "logs -f"])
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_following_a_running_cluster_ends_at_the_first_signal(
    cf: Clusterflow, command: str, signum: int, code: int
) -> None:
    """Pins interrupts.install (SIGTERM raised where the follow loop waits) and the exit
    codes of interrupts.exit_code; the cluster runs on."""
    script = cf.script("gated.py", GATED)
    go = cf.workdir / "go"
    cluster_id = cf.start_detached("--", PY, str(script), str(go))
    follower = cf.popen(*command.split(), cluster_id)
    assert follower.stdout is not None
    reader = cf.LineReader(follower.stdout)
    reader.wait_for("[worker:0] ready")
    follower.send_signal(signum)
    assert follower.wait(ENDS_S) == code
    assert cf.state(cluster_id)["status"] == "running"
    go.touch()
    wait_until(lambda: cf.state(cluster_id)["status"] == "succeeded", ENDS_S, "the run's end")
    wait_until(lambda: not cf.live(cluster_id), ENDS_S, "its manager's exit")
