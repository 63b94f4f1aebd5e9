"""``Server``: one task's server, mirroring ``tf.distribute.Server``.

Every task of a cluster runs one. It binds the task's address from the cluster spec
(or adopts the socket its supervisor reserved for that address, so no other process
can take the port between the two binds: docs/architecture.md section 3), answers the
health service, and hosts the services later layers register (parameter server, data
dispatcher).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from clusterflow.cluster import ClusterSpec, ClusterSpecLike, TaskId, TFConfig, parse_address
from clusterflow.cluster.contract import ENV_LISTEN_FD, ENV_TASK
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials, Request, RpcServer

log = logging.getLogger(__name__)


class Server:
    """An in-process server for one task of a cluster.

    Args:
        server_or_cluster_def: the cluster (a ``ClusterSpec`` or its dict form).
        job_name: this task's job; may be omitted when the cluster has one job.
        task_index: this task's index; may be omitted when the job has one task.
        credentials: the cluster's secret; by default read from the environment a
            launcher set (``CLUSTERFLOW_SECRET_FILE``).
        start: start serving at once (as TensorFlow's ``Server`` does by default).
        listen_fd: a bound socket for this task's address to adopt; by default the one
            a supervisor passed in ``CLUSTERFLOW_LISTEN_FD`` when it is for this task.

    Raises:
        ConfigError: an unknown job or index, no credentials to be found, or an
            address this host cannot serve (another machine's, or a port in use).
    """

    def __init__(
        self,
        server_or_cluster_def: ClusterSpecLike,
        job_name: str | None = None,
        task_index: int | None = None,
        *,
        credentials: Credentials | None = None,
        start: bool = True,
        listen_fd: int | None = None,
        _rpc: RpcServer | None = None,
    ) -> None:
        spec = ClusterSpec(server_or_cluster_def)
        self._task = _resolve_task(spec, job_name, task_index)
        self._spec = spec
        self._started_at = time.monotonic()
        self._stopped = threading.Event()
        if _rpc is not None:
            self._rpc = _rpc
            self._credentials = credentials
        else:
            creds = credentials or Credentials.from_env()
            if creds is None:
                raise ConfigError(
                    "no cluster credentials for Server: pass credentials= or set "
                    "CLUSTERFLOW_SECRET_FILE (clusterflow start sets it for its tasks)"
                )
            self._credentials = creds
            address = spec.task_address(self._task.job, self._task.index)
            host, port = parse_address(address)
            fd = listen_fd if listen_fd is not None else _inherited_fd(self._task)
            try:
                self._rpc = RpcServer(
                    creds, host=host, port=port, listen_fd=fd, name=f"server-{self._task}"
                )
            except (zmq.ZMQError, OSError) as exc:
                # The spec names an address this host cannot serve (another machine's,
                # or a port already taken): the user's spec, so a ConfigError naming it.
                raise ConfigError(f"cannot serve {self._task} at {address}: {exc}") from exc
        self._rpc.register("health.ping", self._ping)
        if start:
            self.start()

    @property
    def target(self) -> str:
        """The address a client session dials, as ``tcp://host:port``."""
        return self._rpc.endpoint

    @property
    def task(self) -> TaskId:
        return self._task

    @property
    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    @property
    def credentials(self) -> Credentials | None:
        return self._credentials

    @property
    def auth_mode(self) -> str:
        """How peers prove membership: ``plain`` (loopback) or ``curve`` (encrypted)."""
        return self._rpc.auth_mode

    def register(
        self,
        method: str,
        handler: Callable[[Request], Any],
        *,
        blocking: bool = False,
        framed: bool = False,
        check: Callable[[str, Any], None] | None = None,
    ) -> None:
        """Serves one more method; services use a ``service.method`` naming scheme.

        ``framed``, ``check``: see ``RpcServer.register`` (tensors in several frames come
        unjoined; the frames of a request sent in parts checked as they arrive).
        """
        self._rpc.register(method, handler, blocking=blocking, framed=framed, check=check)

    def drop_partials(self, match: Callable[[str, Any], bool]) -> int:
        """Drops requests sent in parts not all arrived (``RpcServer.drop_partials``)."""
        return self._rpc.drop_partials(match)

    def enable_side_channel(self) -> bool:
        """Large requests and replies over a TCP socket of their own where auth is
        ``plain`` (``RpcServer.enable_side_channel``); whether it was."""
        return self._rpc.enable_side_channel()

    def partials(self) -> int:
        """Requests sent in parts whose last part has not come (``RpcServer.partials``)."""
        return self._rpc.partials()

    def register_service(
        self, name: str, handlers: Mapping[str, Callable[[Request], Any]], *, blocking: bool = False
    ) -> None:
        """Serves ``name.<method>`` for each handler."""
        for method, handler in handlers.items():
            self._rpc.register(f"{name}.{method}", handler, blocking=blocking)

    def reserve_handler_threads(self, count: int) -> None:
        """Room for ``count`` blocking handlers waiting at once (see ``RpcServer``)."""
        self._rpc.reserve_workers(count)

    def start(self) -> None:
        """Starts serving (a no-op when already started)."""
        self._rpc.start()
        log.info("server for %s serving at %s", self._task, self.target)

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until ``stop()`` is called; returns False if ``timeout`` passed first."""
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        """Stops serving and frees the port."""
        self._rpc.stop()
        self._stopped.set()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ping(self, request: Request) -> dict[str, Any]:
        return {
            "task": str(self._task),
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - self._started_at,
        }


def create_local_server(*, credentials: Credentials | None = None, start: bool = True) -> Server:
    """A single-process cluster ``{"localhost": ["127.0.0.1:<port>"]}``, as TensorFlow's.

    The port is picked by binding first, so there is no window for another process.
    """
    creds = credentials or Credentials.generate()
    rpc = RpcServer(creds, host="127.0.0.1", port=0, name="server-localhost")
    spec = ClusterSpec({"localhost": [rpc.address]})
    return Server(spec, "localhost", 0, credentials=creds, start=start, _rpc=rpc)


def server_from_env(environ: Mapping[str, str] | None = None, *, start: bool = True) -> Server:
    """The server of the task this process is, as ``TF_CONFIG`` describes it.

    ``start=False``: not yet serving; the caller registers its services (and loads what
    they serve) first, then calls ``start``. A request that comes before is queued on
    the bound socket, never answered "no such method" or from state not yet loaded.

    Raises:
        ConfigError: ``TF_CONFIG`` is unset or names no task.
    """
    config = TFConfig.from_env(environ)
    if config is None or config.task is None:
        raise ConfigError("TF_CONFIG is not set or has no 'task': cannot tell which task this is")
    return Server(config.cluster, config.task.job, config.task.index, start=start)


def _resolve_task(spec: ClusterSpec, job_name: str | None, task_index: int | None) -> TaskId:
    if job_name is None:
        if len(spec.jobs) != 1:
            raise ConfigError(f"job_name is required: the cluster has jobs {', '.join(spec.jobs)}")
        job_name = spec.jobs[0]
    indices = spec.task_indices(job_name)
    if task_index is None:
        if len(indices) != 1:
            raise ConfigError(f"task_index is required: job {job_name!r} has {len(indices)} tasks")
        task_index = indices[0]
    spec.task_address(job_name, task_index)  # raises naming the job or index
    return TaskId(job_name, task_index)


def _inherited_fd(task: TaskId) -> int | None:
    """The reserved socket a supervisor passed down, if it belongs to ``task``."""
    raw = os.environ.get(ENV_LISTEN_FD)
    if not raw or os.environ.get(ENV_TASK) != str(task):
        return None
    try:
        fd = int(raw)
        socket.socket(fileno=os.dup(fd)).close()  # check that it is a socket
    except (ValueError, OSError) as exc:
        log.warning("ignoring %s=%r: %s", ENV_LISTEN_FD, raw, exc)
        return None
    # Hand it over once: a second Server in this process must not adopt it again.
    del os.environ[ENV_LISTEN_FD]
    return fd
