"""A cluster's manager inside a Ray cluster (``start --backend ray``), and the CLI's way to it.

The manager runs as a detached Ray actor (``ManagerHost``, named ``clusterflow-<id>`` in
Ray's namespace ``clusterflow``), so it survives the CLI that started it and the machine
the CLI ran on: Ray keeps a detached actor until it ends itself or is killed. It runs the
same ``Controller`` as a local manager, with the ``RayBackend``, and writes the cluster's
folder (state, events, output, task logs) on its own node, under
``$CLUSTERFLOW_HOME/ray/<id>/`` of that node.

The machine that started the cluster keeps its usual folder,
``$CLUSTERFLOW_HOME/clusters/<id>/`` (config, secret), as a mirror: ``refresh`` pulls
the manager's state and the new bytes of its output and logs into it, so ``ps``,
``describe``, ``logs`` and ``attach`` read local files as for a local cluster. Any
machine that can reach the Ray cluster reaches the manager by its actor name.

Once its run ended, the manager lingers (holding no resources) until the CLI collected
the final state, at most ``LINGER_S``; then it ends itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from clusterflow.backends import kinds, ray_agent, ray_driver
from clusterflow.backends.ray_placement import PlacementError, TaskRequest
from clusterflow.cluster.contract import ENV_SECRET_FILE
from clusterflow.errors import ConfigError
from clusterflow.manager import agent_record, registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.ray_links import CALL_DEADLINE_S, Hosted, ManagerGone, PortLink, RayLink
from clusterflow.manager.registry import TERMINAL, ClusterDir
from clusterflow.manager.state import ClusterState
from clusterflow.rpc import RpcError

log = logging.getLogger(__name__)

MIRROR_WAIT_S = CALL_DEADLINE_S + 5.0
"""How long a refresh waits for another process's (``ClusterDir.mirror_lock``): that
one's pull and the appending of what it brought."""

NAMESPACE = ray_driver.NAMESPACE
LINGER_S = 3600.0
"""How long a finished manager waits for the CLI to collect its final state."""
PULL_LIMIT = 8 << 20
"""Most bytes of one file sent by one ``pull`` (the rest comes with the next)."""
PORT_DEADLINE_S = 10.0
"""Deadline of asking the head's agent for its port (``NodeAgent.port``)."""
MIRRORED = ("events.jsonl", "output.log", "trial-report.jsonl")


def actor_name(cluster_id: str) -> str:
    return f"clusterflow-{cluster_id}"


def task_requests(
    config: RunConfig, automatic: frozenset[str], before: Mapping[str, float] | None = None
) -> list[TaskRequest]:
    """One placement request per task, in the cluster's canonical task order
    (``automatic``: jobs whose memory was sized, not named; ``before``: their peaks
    measured by earlier runs, a floor of this run's later sizes)."""
    before = before or {}
    return [
        TaskRequest(
            task=task,
            resources=dict(config.resources.get(task.job, {})),
            labels=dict(config.labels.get(task.job, {})),
            memory_named=task.job not in automatic,
            memory_before=float(before.get(task.job, 0.0)),
        )
        for task in config.tasks()
    ]


class ManagerHost:
    """The manager of one cluster, as a detached Ray actor (see ``_host_class``)."""

    def __init__(
        self,
        cluster_id: str,
        config: dict[str, Any],
        secret: str,
        automatic: list[str],
        before: dict[str, float] | None = None,
    ) -> None:
        import ray

        path = registry.home() / "ray" / cluster_id
        path.mkdir(parents=True, mode=0o700)
        (path / "logs").mkdir(mode=0o700)
        self.cluster = ClusterDir(path)
        fd = os.open(self.cluster.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        registry.write_json_atomic(self.cluster.config_file, config)
        self.node_id = ray.get_runtime_context().get_node_id()
        # The manager's RPC server, its torch store and MASTER_ADDR use this node's address.
        self.config = replace(RunConfig.from_dict(config), host=ray.util.get_node_ip_address())
        self.automatic = frozenset(automatic)
        self.before = dict(before or {})
        self.controller: Any = None
        self.backend: Any = None
        self.watcher: Any = None
        """The growth watcher (``ray_growth``) of an elastic cluster; None otherwise."""
        self._ended = threading.Event()
        self._collected = threading.Event()
        self.release_hook: Any = None
        """Set by a node's agent that hosts this manager (``ray_agent.NodeAgent.make``):
        drops it there once it may end; None in an actor of its own, which exits."""

    def start(self) -> str | None:
        """Places the whole cluster, then runs it on a thread; the one-line error if it
        cannot be placed within the placement timeout (nothing is then held)."""
        from clusterflow.backends.ray_backend import RayBackend
        from clusterflow.backends.ray_placement import reserve
        from clusterflow.manager.controller import Controller

        requests = task_requests(self.config, self.automatic, self.before)
        name = actor_name(self.cluster.id)
        try:
            group = reserve(requests, name, self.config.placement_timeout_s)
        except PlacementError as exc:
            self._ended.set()
            return str(exc)
        self.backend = RayBackend(
            requests, group, name=name, placement_timeout_s=self.config.placement_timeout_s
        )
        self.controller = Controller(self.cluster, self.config, self.backend, echo=False)
        threading.Thread(target=self._run, name="controller", daemon=True).start()
        self.watcher = self._growth(requests)
        return None

    def _growth(self, requests: list[TaskRequest]) -> Any:
        """Under ``--workers MIN:MAX``, a watcher that grows the cluster onto nodes that
        join (``ray_growth``); None for a fixed size."""
        from clusterflow.manager.ray_growth import GrowthWatcher, scale_asker

        high = self.config.workers_max
        worker = next((r for r in requests if r.task.job == "worker"), None)
        if high is None or worker is None:
            return None
        grow = scale_asker(self.controller.place.manager, self._credentials())

        def size() -> tuple[int, int] | None:
            return None if self._ended.is_set() else self.controller.growth_size()

        watcher = GrowthWatcher(request=worker, size=size, grow=grow)
        watcher.start()
        return watcher

    def _credentials(self) -> Any:
        """The cluster's credentials, as the controller reads them (``CLUSTERFLOW_AUTH``,
        plain or curve, may be in the run's environment)."""
        from clusterflow.rpc import Credentials

        secret = str(self.cluster.secret_file)
        credentials = Credentials.from_env(
            {**os.environ, **self.config.env, ENV_SECRET_FILE: secret}
        )
        assert credentials is not None  # the secret file is given
        return credentials

    def _run(self) -> None:
        try:
            self.controller.run()
        except BaseException:
            log.exception("the manager of cluster %s failed", self.cluster.id)
        finally:
            if self.watcher is not None:
                self.watcher.stop()  # before the backend: no grow asked while it closes
            self.backend.close()
            with contextlib.suppress(OSError):
                self.cluster.secret_file.unlink()
            self._ended.set()
        if not self._collected.wait(LINGER_S):
            # Nobody came for the final state (it stays in this node's folder): a
            # detached actor is not reclaimed by Ray, so it ends itself.
            log.info("nobody collected cluster %s's final state; ending", self.cluster.id)
            if self.release_hook is not None:
                self.release_hook()  # hosted by the node's agent, which lives on
            else:
                os._exit(0)

    def pull(self, offsets: dict[str, int]) -> dict[str, Any]:
        """The state (with each task's node and resources) and every mirrored file's
        bytes after ``offsets`` (file name relative to the cluster folder: offset)."""
        state = self.cluster.read_state().to_dict()
        placements = self.backend.placements() if self.backend is not None else {}
        for task in state["tasks"]:
            task.update(placements.get(task["task"], {}))
        manager = dict(state["manager"] or {})
        manager.update({"actor": actor_name(self.cluster.id), "node_id": self.node_id})
        manager["folder"] = str(self.cluster.path)
        state["manager"] = manager
        names = list(MIRRORED)
        with contextlib.suppress(OSError):
            names += [f"logs/{p.name}" for p in self.cluster.logs_dir.iterdir()]
        files = {}
        for name in names:
            with contextlib.suppress(OSError), open(self.cluster.path / name, "rb") as f:
                f.seek(offsets.get(name, 0))
                files[name] = f.read(PULL_LIMIT)
        return {"state": state, "files": files}

    def stop(self, grace_s: float) -> None:
        """Asks the controller to stop, as ``clusterflow stop`` asks a local manager."""
        from clusterflow.rpc import RpcClient
        from clusterflow.server.manager_messages import StopRequest

        manager = self.cluster.read_state().manager
        address = manager.address if manager else None
        if self.controller is None or self._ended.is_set() or not address:
            return
        with RpcClient(address, self._credentials(), deadline=10.0) as client:
            client.call(StopRequest.METHOD, StopRequest(grace_s=grace_s).to_wire())

    def release(self) -> None:
        """The CLI has the final state: the manager may end now."""
        self._collected.set()


def _host_class() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_concurrency=8, max_restarts=0)(ManagerHost)


# The CLI's side -----------------------------------------------------------------------


def connect(address: str | None, job_dir: str | None = None) -> None:
    """Joins the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a local one).

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    runtime_env: dict[str, Any] = {}
    if job_dir:
        if not (os.path.isdir(job_dir) or (job_dir.endswith(".zip") and os.path.isfile(job_dir))):
            raise ConfigError(f"--job-dir {job_dir!r} is neither a folder nor a .zip file")
        runtime_env["working_dir"] = job_dir
    ray_driver.join(address, runtime_env=runtime_env)


def run(cluster: ClusterDir, config: RunConfig, *, detach: bool) -> ManagerHandle:
    """Starts the cluster's manager in the Ray cluster and places the cluster.

    Where ``ray-agents start`` (or an earlier launch) recorded the head agent's port
    (``agent_record``) and it answers, the manager is made there through that port and
    Ray is neither imported nor joined here; otherwise (no record, a stale one, a run
    with ``--job-dir``) the CLI joins Ray as before.

    Raises:
        PlacementError: the cluster cannot be placed (the manager is ended again).
        ManagerGone: the manager stopped answering before the cluster was placed.
        ConfigError: Ray cannot be joined, or the head's agent refused the manager.
    """
    from clusterflow.manager.memory_sizing import earlier_peaks, size

    key = actor_name(cluster.id)
    # A run with a job folder never goes to an agent: Ray unpacks it only for its workers.
    port = None if config.job_dir else agent_record.open_port(config.address)
    if port is None:
        connect(config.address, config.job_dir)  # first: it says how to get Ray if missing
    secret = cluster.secret_file.read_text()
    sized, automatic = size(config)
    before = earlier_peaks(config, automatic)
    args = (cluster.id, sized.to_dict(), secret, sorted(automatic), before)
    link: PortLink | RayLink
    if port is not None:
        try:
            port.make(key, __name__, ManagerHost.__name__, *args)
        except RpcError as exc:
            port.close()
            why = f"the head's agent at {port.address} did not make the manager: {exc}"
            raise ConfigError(why) from exc
        link = PortLink(port, key)
    else:
        # The head's agent hosts the manager when agents run (no Ray worker to start);
        # else (or with a job folder) it gets a detached actor of its own.
        hosted = None if config.job_dir else _in_head_agent(key, args, config.address)
        link = RayLink(hosted if hosted is not None else _new_actor(key, args))
    handle = ManagerHandle(cluster, link)
    try:
        error = link.call("start", deadline=config.placement_timeout_s + 120.0)
    except BaseException:
        handle.end()
        raise
    if error:
        handle.end()
        raise PlacementError(error)
    return handle


def _new_actor(key: str, args: tuple[Any, ...]) -> Any:
    """The manager as a detached actor of its own, on the head node."""
    return (
        _host_class()
        .options(
            name=key,
            namespace=NAMESPACE,
            lifetime="detached",
            scheduling_strategy=_on_head_node(),
        )
        .remote(*args)
    )


def _in_head_agent(key: str, args: tuple[Any, ...], address: str | None) -> Hosted | None:
    """The manager made in the head node's agent; None where agents are not enabled,
    or where the head's agent failed within its deadlines (an actor of its own then).
    The agent's port is recorded for ``address`` on the way, so the next command with
    that address reaches the agent without joining Ray (``agent_record``)."""
    import ray

    try:
        agent = ray_agent.head_agent()
        if agent is None:
            return None
        ray.get(agent.make.remote(key, __name__, ManagerHost.__name__, *args), timeout=60.0)
    except (ray_agent.AgentUnavailable, ray.exceptions.RayError) as exc:
        log.warning("the head's agent cannot host the manager (%s); it gets an actor", exc)
        return None
    try:
        agent_record.write(address, ray.get(agent.port.remote(), timeout=PORT_DEADLINE_S))
    except (ray.exceptions.RayError, OSError) as exc:  # only the next launch is slower
        log.warning("the head agent's port is not recorded (%s)", exc)
    return Hosted(agent, key)


def _on_head_node() -> Any:
    """The manager goes to the head node: the Ray cluster ends with that node anyway,
    while any other node may be a spot machine that goes away."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in (node.get("Resources") or {}):
            return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    return "DEFAULT"


class ManagerHandle:
    """The CLI's handle on a manager: keeps the local folder a mirror of its own."""

    def __init__(self, cluster: ClusterDir, link: RayLink | PortLink) -> None:
        self.cluster = cluster
        self.link = link

    @classmethod
    def find(cls, cluster: ClusterDir) -> ManagerHandle | None:
        """The handle of a Ray cluster's manager; None for a local cluster or a gone one.

        Through the head agent's port when it is recorded, answers and hosts the manager
        (no Ray joined); else by joining Ray (an actor of its own, or the head's agent).
        """
        config = cluster.read_config()
        kind = kinds.find(config.get("backend") or kinds.LOCAL.name)
        if kind is None or not kind.manager_in_ray:
            return None
        key = actor_name(cluster.id)
        port = agent_record.open_port(config.get("address"))
        if port is not None:
            try:
                if port.hosts(key):
                    return cls(cluster, PortLink(port, key))
            except RpcError as exc:
                log.warning("the head's agent at %s stopped answering (%s)", port.address, exc)
            port.close()
        connect(config.get("address"))
        import ray

        try:
            actor: Any = ray.get_actor(key, namespace=NAMESPACE)
        except ValueError:
            actor = Hosted.find(key)
        return None if actor is None else cls(cluster, RayLink(actor))

    def refresh(self) -> ClusterState | None:
        """Pulls the manager's state and new output into the local folder; the state,
        or None if the manager is gone. A final state is collected once: the manager
        is then told it may end. One process at a time (``mirror_lock``); one that
        waited for another that collected the final state returns that state. One
        that could not get the lock within ``MIRROR_WAIT_S`` (its holder stopped
        mid-pull) returns the state as last mirrored, with a warning: news comes at
        the next refresh."""
        try:
            with self.cluster.mirror_lock(MIRROR_WAIT_S):
                with contextlib.suppress(ConfigError):
                    known = self.cluster.read_state()
                    if known.status in TERMINAL:
                        return known
                state = self._pull()
        except registry.MirrorBusy as exc:
            log.warning("%s; showing the state as last mirrored", exc)
            return self.cluster.read_state()
        if state is not None and state.status in TERMINAL:
            from clusterflow.manager.memory_sizing import record

            # Kept for the next run of the same command and job (--memory auto).
            with contextlib.suppress(ConfigError, OSError):
                record(RunConfig.from_dict(self.cluster.read_config()), state)
            self.end()
        return state

    def _pull(self) -> ClusterState | None:
        offsets = {name: _size(self.cluster.path / name) for name in MIRRORED}
        with contextlib.suppress(OSError):
            for p in self.cluster.logs_dir.iterdir():
                offsets[f"logs/{p.name}"] = p.stat().st_size
        try:
            reply = self.link.call("pull", offsets, deadline=CALL_DEADLINE_S)
        except ManagerGone:
            return None
        # Another machine's mirror starts from config.json alone (docs/ray.md).
        self.cluster.logs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, data in reply["files"].items():
            folder, _, base = name.rpartition("/")
            if folder not in ("", "logs") or not base or base.startswith("."):
                continue  # only the manager's own files, never a path out of the folder
            if data:
                with open(self.cluster.path / name, "ab") as f:
                    f.write(data)
        state = ClusterState.from_dict(reply["state"], cluster_id=self.cluster.id)
        full = any(len(d) >= PULL_LIMIT for d in reply["files"].values())
        if full and state.status in TERMINAL:
            state = replace(state, status="running")  # not final until every byte is here
        self.cluster.write_state(state)
        return state

    def stop(self, grace_s: float) -> None:
        """Asks the manager to stop its tasks in order.

        Raises:
            ManagerGone: it did not take the request within ``grace_s`` and a call's deadline.
        """
        self.link.call("stop", grace_s, deadline=grace_s + CALL_DEADLINE_S)

    def end(self) -> None:
        """Lets the manager end (it has nothing left to run or to tell)."""
        self.link.end()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def refresh(cluster: ClusterDir) -> None:
    """Brings a Ray cluster's local mirror up to date; nothing for a local cluster.

    A mirror that still says the cluster runs, whose manager is gone, is marked stale.
    Waits at most the join's deadlines (``ray_driver``) and one call's.

    Raises:
        RayUnreachable: the cluster's Ray cannot be reached (the mirror is left as is).
    """
    with contextlib.suppress(ConfigError):
        kind = kinds.find(cluster.read_config().get("backend") or kinds.LOCAL.name)
        if kind is None or not kind.manager_in_ray:
            return
    state = cluster.read_state()
    if state.status in TERMINAL:
        return
    handle = ManagerHandle.find(cluster)
    if handle is not None and handle.refresh() is not None:
        return
    if state.status not in TERMINAL and state.manager:
        summary = "the manager actor is gone; its node's folder holds its last state"
        cluster.write_state(replace(state, status="stale", summary=summary))


def never_started(cluster: ClusterDir, summary: str, *, exit_code: int) -> None:
    """Records that the cluster's manager never started (``failed``, with ``summary``),
    so ``ps -a`` and the dashboard say why instead of showing it ``created`` for ever."""
    command: tuple[str, ...] = ()
    with contextlib.suppress(ConfigError):
        command = tuple(cluster.read_config().get("command") or ())
    now = time.time()
    state = ClusterState(
        id=cluster.id, status="failed", backend="ray", command=command, created=now
    )
    cluster.write_state(state.finished(exit_code=exit_code, summary=summary, ended=now))


def read(cluster: ClusterDir) -> ClusterState:
    """The cluster's state as ``ps``, ``describe`` and the dashboard show it: a Ray
    cluster's mirror refreshed first (``refresh``). One whose Ray cannot be reached (a
    lost address, or a folder a killed ``start`` left with the address it never joined)
    reads ``unreachable``, its summary saying why; the mirror itself is not changed."""
    try:
        refresh(cluster)
    except ray_driver.RayUnreachable as exc:
        return replace(cluster.read_state(), status=registry.UNREACHABLE, summary=str(exc))
    return cluster.read_state()


def stop(cluster: ClusterDir, grace_s: float) -> str:
    """``clusterflow stop`` for a Ray cluster: the manager stops its tasks in order, the
    mirror collects the final state, and the manager, its actors and its placement group
    end.

    A cluster that never heard from its manager (``created``), in a Ray that cannot be
    reached or that holds no manager of it, never started there (a ``start`` killed
    while it joined, or before its manager was made): it is recorded as failed, saying
    so, and leaves ``ps``.

    Raises:
        RayUnreachable: the cluster's manager ran in a Ray that cannot be reached now.
    """
    try:
        handle = ManagerHandle.find(cluster)
    except ray_driver.RayUnreachable as exc:
        mirror = cluster.read_state()
        if mirror.status != "created" or mirror.manager is not None:
            raise
        never_started(cluster, f"never started: {exc}", exit_code=1)
        return f"not running (never started: {exc})"
    if handle is None:
        refresh(cluster)
        mirror = cluster.read_state()
        if mirror.status == "created" and mirror.manager is None:  # a start killed early
            address = cluster.read_config().get("address") or "auto"
            why = f"never started: no manager of it in the Ray cluster at {address}"
            never_started(cluster, why, exit_code=1)
            return f"not running ({why})"
        return f"not running ({mirror.status})"
    handle.stop(grace_s)
    deadline = time.monotonic() + grace_s + 60.0
    while time.monotonic() < deadline:
        state = handle.refresh()
        if state is None or state.status in TERMINAL:
            return "stopped"
        time.sleep(0.2)
    handle.end()
    return "stopped (forced: the manager did not finish in time)"
