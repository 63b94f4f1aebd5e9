"""A real ``clusterflow start`` cluster whose tasks each run inside an emulated host.

``clusterflow start --backend hosts`` (tests and benchmarks, as root) reads a placement
file named by ``CLUSTERFLOW_HOSTS``: the manager's host and each task's, hosts of an
``EmulatedHosts`` harness (``Placement.of``). The manager itself runs inside its host
(the caller starts ``clusterflow start`` with ``Placement.manager_argv``): its RPC
server, data dispatcher and torch store bind that host's address, and every supervisor
is started with ``ip netns exec <its host>`` and binds its own host's address
(``CLUSTERFLOW_BIND_HOST``). The cluster spec therefore holds the hosts' private
addresses, the RPC runs curve auth (the default beyond loopback), and every link,
the manager's included, can be cut (``EmulatedHosts.cut``), as between real machines.

A warm standby, and any task the file does not name, goes to the ``spare`` host: a
respawned worker comes back on another machine, as a replacement would. Processes
stay children of the manager (one machine), so it still reads their exit codes and
signals them directly; what crosses the emulated network is everything clusterflow
sends over RPC, ZeroMQ and gloo.

``backends/kinds.py`` describes the ``hosts`` backend (a cluster on it is read and
stopped as a local one); importing this module registers how it starts
(``HostsLauncher``), which a start on it does through ``HOSTS.launcher_from``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterflow.backends import kinds
from clusterflow.backends.api import TaskLaunch
from clusterflow.backends.local import SUPERVISOR_MODULE, LocalBackend, LocalProcess
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ENV_BIND_HOST, ENV_HOSTS, ENV_STANDBY
from clusterflow.errors import ConfigError

_NETNS = re.compile(r"^[a-z][a-z0-9]{0,11}-\d+-[0-9a-f]{6}-\d+$")
_ADDRESS = re.compile(r"^10\.77\.\d{1,3}\.\d{1,3}$")
_LIMITS = ("heartbeat_timeout_s", "register_timeout_s", "grace_s")
"""The manager's own limits a placement may shorten (no flag sets them): a partition
test must outlast them within its time budget."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One emulated host as the backend needs it: where to enter, what to bind."""

    netns: str
    address: str

    def __post_init__(self) -> None:
        if not isinstance(self.netns, str) or not _NETNS.match(self.netns):
            raise ConfigError(f"placement: {self.netns!r} is not an emulated host's namespace")
        if not isinstance(self.address, str) or not _ADDRESS.match(self.address):
            raise ConfigError(f"placement: {self.address!r} is not an emulated host's address")

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Which host runs the manager, each task, and the standbys."""

    manager: Slot
    tasks: Mapping[str, Slot]
    spare: Slot
    limits: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Manager limits to shorten (``_LIMITS``), e.g. ``heartbeat_timeout_s``."""

    def __post_init__(self) -> None:
        for name, value in self.limits.items():
            if name not in _LIMITS:
                raise ConfigError(f"placement: limit {name!r} unknown; known: {_LIMITS}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"placement: {name} must be a positive number, got {value!r}")
        for task in self.tasks:
            TaskId.parse(task)  # raises on a name that is no task

    @classmethod
    def of(
        cls,
        hosts: Any,
        *,
        manager: int,
        tasks: Mapping[str, int],
        spare: int,
        limits: Mapping[str, float] | None = None,
    ) -> Placement:
        """A placement on ``hosts`` (an ``EmulatedHosts``), by host index."""

        def slot(i: int) -> Slot:
            return Slot(hosts[i].netns, hosts[i].address)

        return cls(
            manager=slot(manager),
            tasks={task: slot(i) for task, i in tasks.items()},
            spare=slot(spare),
            limits=dict(limits or {}),
        )

    def slot_for(self, task: TaskId, *, standby: bool) -> Slot:
        if standby:
            return self.spare
        return self.tasks.get(str(task), self.spare)

    def manager_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` (``clusterflow start ...``) run inside the manager's host."""
        return self.manager.argv(argv)

    def write(self, path: Path) -> Path:
        data = {
            "manager": dataclasses.asdict(self.manager),
            "tasks": {t: dataclasses.asdict(s) for t, s in self.tasks.items()},
            "spare": dataclasses.asdict(self.spare),
            "limits": dict(self.limits),
        }
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def read(cls, path: str) -> Placement:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                manager=Slot(**data["manager"]),
                tasks={str(t): Slot(**s) for t, s in data["tasks"].items()},
                spare=Slot(**data["spare"]),
                limits=dict(data.get("limits") or {}),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{ENV_HOSTS}={path}: not a placement file ({exc})") from None


class HostsBackend(LocalBackend):
    """Supervisors as child processes, each entered into its emulated host."""

    name = "hosts"

    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement

    def launch(self, launch: TaskLaunch) -> LocalProcess:
        slot = self.placement.slot_for(launch.task, standby=launch.env.get(ENV_STANDBY) == "1")
        popen = subprocess.Popen(
            slot.argv([sys.executable, "-m", SUPERVISOR_MODULE]),
            env={**launch.env, ENV_BIND_HOST: slot.address},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return LocalProcess(launch.task, popen)


def for_run(config: Any, environ: Mapping[str, str] = os.environ) -> tuple[Any, HostsBackend]:
    """The run's config with the manager's address (and shortened limits), and the
    backend: what ``clusterflow start --backend hosts`` runs with.

    Raises:
        ConfigError: no placement file, a bad one, or a manager outside its host.
    """
    path = environ.get(ENV_HOSTS)
    if not path:
        raise ConfigError(
            f"--backend hosts needs {ENV_HOSTS}=<placement file> "
            "(clusterflow.testing.hosts_backend.Placement.write)"
        )
    if os.geteuid() != 0:
        raise ConfigError("--backend hosts enters network namespaces: it needs root")
    placement = Placement.read(path)
    return (
        dataclasses.replace(config, host=placement.manager.address, **placement.limits),
        HostsBackend(placement),
    )


class HostsLauncher:
    """``--backend hosts``' tasks (``backends/kinds.py`` describes the backend; this
    module registers how it starts, so only a start on it imports the harness)."""

    def check(self, config: Any) -> None:
        """Its placement file, root, and the manager's host: checked before anything
        starts (``for_run``)."""
        for_run(config)

    def backend(self, config: Any) -> tuple[Any, HostsBackend]:
        return for_run(config)


kinds.register_launcher(kinds.HOSTS.name, HostsLauncher())
