"""The on-disk registry of clusters: one folder per cluster under ``$CLUSTERFLOW_HOME``.

``$CLUSTERFLOW_HOME/clusters/<id>/`` holds ``state.json`` (written atomically by the
manager: status, spec, tasks), ``config.json`` (what ``start`` asked for), ``secret``
(the cluster's credentials, mode 0600), ``events.jsonl``, ``output.log`` (every task's
lines, prefixed) and ``logs/<job>-<index>.log``. The CLI reads these files, so ``ps``,
``logs`` and ``describe`` work whether or not the manager is alive; ``stop`` and
``attach`` also talk to it or follow its files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from clusterflow._files import write_json_atomic
from clusterflow.cluster.contract import ENV_HOME
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager.state import TERMINAL, ClusterState

__all__ = [
    "TERMINAL",
    "UNREACHABLE",
    "ClusterDir",
    "MirrorBusy",
    "all_clusters",
    "create",
    "effective_status",
    "find",
    "home",
    "write_json_atomic",
]

MIRROR_LOCK_POLL_S = 0.05
"""How often a process waiting for the mirror's lock tries it again (``mirror_lock``)."""


class MirrorBusy(ClusterflowError):
    """Another process held a cluster's mirror lock past the wait allowed."""


UNREACHABLE = "unreachable"
"""The status shown (never written) for a cluster whose manager lives in a Ray cluster
that cannot be reached now (``ray_host.read``): its mirror keeps what it last knew."""


def home() -> Path:
    """``$CLUSTERFLOW_HOME``, or ``~/.clusterflow``; created owner-only on first use."""
    raw = os.environ.get(ENV_HOME)
    root = Path(raw).expanduser() if raw else Path.home() / ".clusterflow"
    (root / "clusters").mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


def new_cluster_id() -> str:
    return secrets.token_hex(5)


@dataclass(frozen=True, slots=True)
class ClusterDir:
    """The folder of one cluster and the files in it."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    @property
    def secret_file(self) -> Path:
        return self.path / "secret"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def output_file(self) -> Path:
        return self.path / "output.log"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @contextlib.contextmanager
    def mirror_lock(self, timeout: float) -> Iterator[None]:
        """Held by a process while it brings this folder's mirror of a Ray-hosted manager
        up to date (``ray_host.ManagerHandle.refresh``). The CLI that started the run and a
        ``describe`` beside it both refresh; each appends the bytes after the sizes it
        read, so two at once would append the same bytes twice.

        Waits at most ``timeout`` seconds. A holder's pull has a deadline of its own, but
        a holder can be stopped mid-pull (Ctrl-Z on a foreground ``start``), and a
        ``describe`` beside it must not hang with it. ``flock`` has no timed wait, so the
        lock is tried every ``MIRROR_LOCK_POLL_S``, as the ``filelock`` package does.

        Raises:
            MirrorBusy: another process held the lock all that time.
        """
        with open(self.path / ".mirror.lock", "a") as f:
            end = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= end:
                        raise MirrorBusy(
                            f"cluster {self.id}: another process has held the mirror's lock "
                            f"for {timeout:g}s ({f.name})"
                        ) from None
                    time.sleep(MIRROR_LOCK_POLL_S)
            yield  # closing the file lets go

    def task_log(self, task: str) -> Path:
        return self.logs_dir / (task.replace(":", "-") + ".log")

    def read_state(self) -> ClusterState:
        """The state the manager last wrote; ``created`` before it wrote any.

        Raises:
            ConfigError: the file is not JSON, or not a JSON object.
        """
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return ClusterState(id=self.id)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cluster {self.id}: unreadable state file: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"cluster {self.id}: state file is not a JSON object")
        return ClusterState.from_dict(data, cluster_id=self.id)

    def write_state(self, state: ClusterState) -> None:
        write_json_atomic(self.state_file, state.to_dict())

    def read_config(self) -> dict[str, Any]:
        try:
            data = json.loads(self.config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cluster {self.id}: unreadable config file: {exc}") from exc
        return dict(data)

    def append_event(self, kind: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        with self.events_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read_events(self) -> list[dict[str, Any]]:
        events = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.events_file.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
        return events


def create(cluster_id: str | None = None) -> ClusterDir:
    """Makes the folder of a new cluster (owner-only)."""
    cid = cluster_id or new_cluster_id()
    path = home() / "clusters" / cid
    path.mkdir(mode=0o700)
    (path / "logs").mkdir(mode=0o700)
    return ClusterDir(path)


def all_clusters() -> list[ClusterDir]:
    """Every cluster, newest first (by creation: its config is written once, at start)."""
    root = home() / "clusters"
    dirs = [ClusterDir(p) for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(dirs, key=_created, reverse=True)


def _created(cluster: ClusterDir) -> float:
    # Not the folder's own mtime: every state.json rewrite (a rename into it) bumps it.
    for path in (cluster.config_file, cluster.path):
        with contextlib.suppress(OSError):
            return path.stat().st_mtime
    return 0.0


def find(cluster_id: str) -> ClusterDir:
    """The cluster whose id is ``cluster_id`` or starts with it (unambiguously).

    Raises:
        ConfigError: no such cluster, or the prefix matches several.
    """
    # Over 255 bytes no file name can hold it: the lookup below would raise OSError.
    too_long = len(os.fsencode(cluster_id)) > 255
    if not cluster_id or "/" in cluster_id or cluster_id.startswith(".") or too_long:
        raise ConfigError(f"invalid cluster id {cluster_id[:80]!r}")
    root = home() / "clusters"
    exact = root / cluster_id
    if exact.is_dir():
        return ClusterDir(exact)
    matches = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(cluster_id)]
    if not matches:
        raise ConfigError(f"no cluster {cluster_id!r} (see `clusterflow ps`)")
    if len(matches) > 1:
        names = ", ".join(sorted(p.name for p in matches))
        raise ConfigError(f"cluster id {cluster_id!r} is ambiguous: {names}")
    return ClusterDir(matches[0])


def process_alive(pid: int | None, create_time: float | None) -> bool:
    """True if ``pid`` runs and is the same process (not a reused pid)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def effective_status(state: ClusterState | Mapping[str, Any]) -> str:
    """The status to show: a live status whose manager is gone reads ``stale``."""
    if not isinstance(state, ClusterState):
        state = ClusterState.from_dict(state)
    if state.status in TERMINAL or state.status in ("created", UNREACHABLE):
        return state.status
    manager = state.manager
    if manager is not None and manager.actor:
        return state.status  # a manager on Ray: its mirror is refreshed from it (ray_host)
    if manager is None or not process_alive(manager.pid, manager.create_time):
        return "stale"
    return state.status
