"""Where a strategy learns its cluster: the spec, its own task and the credentials.

Kept apart from the spec (a value), as TensorFlow keeps ``ClusterResolver`` apart from
``ClusterSpec``, and with TensorFlow's surface: ``cluster_spec()`` is a method,
``master()`` gives a task's address (with the ``rpc_layer`` as a scheme), and
``task_type``, ``task_id`` and ``rpc_layer`` can be set after construction.
``TFConfigClusterResolver`` reads what ``clusterflow start`` injected;
``SimpleClusterResolver`` takes values from code (tests, manual mode). Unlike
TensorFlow's, they also carry the cluster's :class:`~clusterflow.rpc.Credentials`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from clusterflow._checks import whole
from clusterflow.cluster import TF_CONFIG_ENV, ClusterSpec, ClusterSpecLike, TaskId, TFConfig
from clusterflow.errors import ConfigError
from clusterflow.rpc import Credentials

__all__ = ["ClusterResolver", "SimpleClusterResolver", "TFConfigClusterResolver"]


def _as_task_id(value: object) -> int | None:
    # TensorFlow casts with int(): launchers hand over "1" as often as 1.
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit() and value == str(int(value)):
        return int(value)
    return whole("task_id", value)


def _as_task_type(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"task_type must be a job name, got {value!r}")
    return value


def format_master_url(address: str, rpc_layer: str | None) -> str:
    """``"grpc://host:port"`` with a layer, the bare address without (TensorFlow's form)."""
    return f"{rpc_layer}://{address}" if rpc_layer else address


class ClusterResolver:
    """A resolved cluster: what every strategy needs to find its peers.

    Args:
        cluster_spec: the cluster.
        task: this process's task; ``None`` for a process outside the cluster.
        credentials: the cluster's secret, for the RPC layer.
        rpc_layer: TensorFlow's ``rpc_layer``; only :meth:`master` uses it.
        environment: TensorFlow's ``environment``; passed through untouched.

    Raises:
        ClusterSpecError: ``cluster_spec`` is not a valid spec.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpecLike,
        task: TaskId | None = None,
        credentials: Credentials | None = None,
        *,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self._task_type = task.job if task is not None else None
        self._task_id = task.index if task is not None else None
        self._rpc_layer = rpc_layer
        self.credentials = credentials
        self.environment = environment

    def cluster_spec(self) -> ClusterSpec:
        """The cluster, as TensorFlow's ``ClusterResolver.cluster_spec()``."""
        return self._spec

    @property
    def task_type(self) -> str | None:
        """This process's job (``None`` outside the cluster); settable, as in TensorFlow."""
        return self._task_type

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = _as_task_type(value)

    @property
    def task_id(self) -> int | None:
        """This process's index in its job; settable, a string ``"1"`` is cast."""
        return self._task_id

    @task_id.setter
    def task_id(self, value: int | str | None) -> None:
        self._task_id = _as_task_id(value)

    @property
    def rpc_layer(self) -> str | None:
        """TensorFlow's ``rpc_layer`` (e.g. ``"grpc"``); settable. clusterflow's own
        transport is ZeroMQ whatever it says: it only prefixes :meth:`master`."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def task(self) -> TaskId | None:
        """``task_type:task_id`` as a :class:`TaskId` (index 0 when only the type is set)."""
        if self._task_type is None:
            return None
        return TaskId(self._task_type, self._task_id or 0)

    @property
    def is_chief(self) -> bool:
        """The chief task, or any task of a cluster that has none (a single process)."""
        task = self.task
        if task is None:
            return True
        return self._spec.is_chief(task)

    def num_workers(self) -> int:
        """Tasks that compute: the chief and the workers."""
        jobs = self._spec.jobs
        return sum(self._spec.num_tasks(j) for j in ("chief", "worker") if j in jobs)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of ``task_type:task_id`` (default: this task), as TensorFlow gives it.

        ``""`` for a cluster of at most one task (nothing to connect to), as in
        TensorFlow; prefixed with ``rpc_layer://`` when a layer is set.

        Raises:
            ConfigError: no task is given and this resolver has none.
            ClusterSpecError: the task is not in the cluster.
        """
        if not self._spec.jobs or (
            len(self._spec.jobs) == 1 and len(self._spec.job_tasks(self._spec.jobs[0])) == 1
        ):
            return ""
        job = task_type if task_type is not None else self._task_type
        index = _as_task_id(task_id) if task_id is not None else self._task_id
        if job is None or index is None:
            raise ConfigError(
                "master() needs a task: pass task_type and task_id, or set them on the resolver"
            )
        layer = rpc_layer if rpc_layer is not None else self._rpc_layer
        return format_master_url(self._spec.task_address(job, index), layer)

    def require_credentials(self) -> Credentials:
        if self.credentials is None:
            raise ConfigError(
                "no cluster credentials: run under `clusterflow start`, or set "
                "CLUSTERFLOW_SECRET_FILE, or pass credentials to the resolver"
            )
        return self.credentials

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._spec!r}, task_type={self._task_type!r}, "
            f"task_id={self._task_id!r}, rpc_layer={self._rpc_layer!r})"
        )


class TFConfigClusterResolver(ClusterResolver):
    """The cluster that ``TF_CONFIG`` (and the launcher's secret) describes.

    As TensorFlow's: the arguments override what ``TF_CONFIG`` says; an unset
    ``TF_CONFIG``, or ``{}``, is an empty cluster with no task. Unlike TensorFlow's, the
    variable is read once, here: a spec is a value, and a newer version of it comes from
    the manager (``ManagerLink.spec()``), not from this process's environment.

    Args:
        task_type: overrides ``TF_CONFIG``'s task type.
        task_id: overrides ``TF_CONFIG``'s task index (``"1"`` is cast, as TensorFlow does).
        rpc_layer: overrides ``TF_CONFIG``'s ``rpc_layer``.
        environment: overrides ``TF_CONFIG``'s ``environment``.
        environ: where to read ``TF_CONFIG`` and the secret (default ``os.environ``).

    Raises:
        TFConfigError: ``TF_CONFIG`` is set but invalid.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | str | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        config = TFConfig.from_env(env)
        super().__init__(
            config.cluster if config is not None else {},
            config.task if config is not None else None,
            Credentials.from_env(env),
            rpc_layer=config.rpc_layer if config is not None else None,
            environment=config.environment if config is not None else None,
        )
        self._session_master = _session_master(env.get(TF_CONFIG_ENV))
        if task_type is not None:
            self.task_type = task_type
        if task_id is not None:
            self.task_id = task_id
        if rpc_layer is not None:
            self.rpc_layer = rpc_layer
        if environment is not None:
            self.environment = environment
        overridden = task_type is not None or task_id is not None
        if overridden and self.task is not None and self._spec.jobs:
            # An override must name a task of the cluster TF_CONFIG describes.
            self._spec.task_address(self.task.job, self.task.index)

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """TensorFlow's ``session_master`` from ``TF_CONFIG`` when it has one, else as
        :meth:`ClusterResolver.master`."""
        if self._session_master is not None:
            return self._session_master
        return super().master(task_type, task_id, rpc_layer)


def _session_master(text: str | None) -> str | None:
    # TFConfig validated the text already; this reads the one key it does not model.
    if not text or not text.strip():
        return None
    data: Any = json.loads(text)
    value = data.get("session_master") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


class SimpleClusterResolver(ClusterResolver):
    """A resolver from values, as ``tf.distribute.cluster_resolver.SimpleClusterResolver``.

    The arguments are TensorFlow's, in TensorFlow's order (``master`` second), plus
    ``credentials``. ``num_accelerators`` is not taken: torch finds the devices.

    Raises:
        ConfigError: ``task_type`` is not a string or ``task_id`` not an integer (the
            usual sign of ``SimpleClusterResolver(spec, "worker", 0)``: the second
            positional argument is ``master``, as in TensorFlow).
        ClusterSpecError: ``task_type:task_id`` is not in the cluster.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpecLike,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        rpc_layer: str | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        if not isinstance(master, str):
            raise ConfigError(f"master must be an address string, got {master!r}")
        job, index = _as_task_type(task_type), _as_task_id(task_id)
        spec = ClusterSpec(cluster_spec)
        task = None
        if job is not None:
            spec.task_address(job, index or 0)  # raises naming a bad job or index
            task = TaskId(job, index or 0)
        super().__init__(
            spec, task, credentials, rpc_layer=rpc_layer, environment=environment or None
        )
        self._task_id = index
        self._master = master

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of ``task_type:task_id`` when both are given, else the ``master``
        passed at construction; prefixed with ``rpc_layer://`` when a layer is set."""
        if task_type is not None and task_id is not None:
            address = self._spec.task_address(task_type, _as_task_id(task_id) or 0)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer)


def checked_resolver(value: object, strategy: str) -> ClusterResolver | None:
    """``value`` if it is a resolver, or None; else a ``ConfigError`` naming it. A
    strategy given a job's name or a spec's dict for its resolver failed later, deep in
    its own start, with an ``AttributeError``."""
    if value is not None and not isinstance(value, ClusterResolver):
        raise ConfigError(
            f"{strategy}: cluster_resolver must be a ClusterResolver (e.g. "
            f"SimpleClusterResolver(spec, task_type=..., task_id=...)), got {value!r}"
        )
    return value
