"""A real Ray cluster on emulated hosts: one Ray node per host, as on real machines.

Ray advertises the machine's primary address whatever ``--node-ip-address`` says; in a
namespace whose only interface is the harness's ``eth0`` (``10.77.x.y``) that address
is the host's own, so each node has an address of its own, the cluster's traffic stays
on the harness's bridge, and nothing reaches this machine's other addresses. A test or
benchmark then runs clusterflow's CLI on host 0 (the head's), and every address in a
spec, ``TF_CONFIG`` or ``MASTER_ADDR`` is a node's bridge address, never 127.0.0.1.

Stopping: ``close`` (also ``__exit__``) kills every process in every host (the nodes,
their workers, the supervisors and jobs under them: all started here) and removes the
hosts. It never runs ``ray stop``, which kills every Ray process of the machine by name,
other clusters' too. ``kill_node`` does the same to one host: the node dies as a
machine does, with everything on it.

Needs root, iproute2 and Ray (``clusterflow[ray]``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from clusterflow.cluster.contract import TF_CONFIG
from clusterflow.testing.netns import EmulatedHosts, Host

PORT = 6379
NODE_FLAGS = ("--object-store-memory=100000000", "--disable-usage-stats")
"""Every node: a small object store (these clusters move little), no usage report."""
HEAD_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}
"""A dead node is declared dead after ~2 s of failed health checks, not ~30 s."""
START_DEADLINE_S = 120.0

PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
from ray._private.state import actors
live = [v.get("Name") or k for k, v in actors().items() if v["State"] != "DEAD"]
groups = {k: v["state"] for k, v in ray.util.placement_group_table().items()}
nodes = [
    {"id": n["NodeID"], "ip": n["NodeManagerAddress"], "labels": n.get("Labels") or {}}
    for n in ray.nodes() if n["Alive"]
]
print(json.dumps({"actors": live, "groups": groups, "nodes": nodes}))
"""


class RayNodes:
    """Ray nodes on ``n`` emulated hosts (a context manager); none runs until started.

    Args:
        n: hosts to make; ``start_head`` uses host 0, ``start_node(i)`` host ``i``.
        prefix: the hosts' namespace prefix (a test's branch or purpose).
        home: ``CLUSTERFLOW_HOME`` of the nodes' workers (the managers' folders).
        node_env: more variables for every node (and so every worker on it).
    """

    def __init__(
        self,
        n: int,
        *,
        prefix: str = "ray",
        home: Path | None = None,
        node_env: Mapping[str, str] | None = None,
    ) -> None:
        self.node_env = dict(node_env or {})
        self.root = Path(tempfile.mkdtemp(prefix="ray-n-"))  # short: socket paths are bounded
        self.home = home or self.root / "home"
        self.hosts = EmulatedHosts(n, prefix=prefix)
        self.bin = Path(sys.executable).parent

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """The head's GCS address, as ``--address`` takes it."""
        return f"{self.head.address}:{PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """This environment without clusterflow's, Ray's and TF's variables, with this
        interpreter's scripts first on PATH and ``HOME`` in this cluster's folder, plus
        ``extra``."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CLUSTERFLOW_", "RAY_")) and k != TF_CONFIG
        }
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        # A home of its own: Ray reads ~/.ray (an auth token another cluster of this
        # machine may have generated there would lock this one's nodes out of its head).
        env["HOME"] = str(self.root)
        env.update(extra)
        return env

    def _start(self, host: Host, argv: list[str], env: Mapping[str, str]) -> None:
        argv += [f"--node-ip-address={host.address}", f"--temp-dir={self.root / 'ray'}"]
        out = host.run(
            [str(self.bin / "ray"), "start", *argv, *NODE_FLAGS],
            env=dict(env),
            timeout=START_DEADLINE_S,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray start on {host.address} failed: {out.stderr[-2000:]}")

    def start_head(self, *flags: str) -> None:
        """The head node on host 0 (no dashboard), with ``flags`` (``--labels=...``)."""
        argv = ["--head", f"--port={PORT}", "--include-dashboard=false", *flags]
        env = self.env(CLUSTERFLOW_HOME=str(self.home), **HEAD_ENV, **self.node_env)
        self._start(self.head, argv, env)

    def start_node(self, index: int, *flags: str) -> None:
        """A worker node on host ``index``, joined to the head."""
        argv = [f"--address={self.address}", *flags]
        env = self.env(CLUSTERFLOW_HOME=str(self.home), **self.node_env)
        self._start(self.hosts[index], argv, env)

    def kill_node(self, index: int) -> None:
        """Host ``index`` dies: everything running on it, at once (SIGKILL)."""
        _kill_all(self.hosts[index].netns)

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on the head's host (where a user runs the CLI)."""
        return self.head.run(list(argv), env=dict(env or self.env()), **kwargs)

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[str]:
        kwargs.setdefault("text", True)
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return self.head.popen(list(argv), env=dict(env or self.env()), **kwargs)

    def probe(self) -> dict[str, Any]:
        """What the Ray cluster holds: live ``actors`` (names), placement ``groups``
        (id: state) and live ``nodes`` (id, ip, labels)."""
        out = self.run([sys.executable, "-c", PROBE, self.address], timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"probing the Ray cluster failed: {out.stderr[-2000:]}")
        # Ray's driver may print after it (a node it saw die: "raylet has lagging ...").
        lines = out.stdout.strip().splitlines()
        return dict(json.loads(next(x for x in reversed(lines) if x.startswith('{"actors"'))))

    def close(self) -> None:
        """Kills every node and what runs on it, removes the hosts and the files."""
        try:
            self.hosts.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _kill_all(netns: str) -> None:
    pids = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30, check=False
    ).stdout.split()
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(int(pid)))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
