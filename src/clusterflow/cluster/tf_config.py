"""``TF_CONFIG``: TensorFlow's environment variable that tells a task its cluster and role.

Every task that clusterflow launches gets one, byte-compatible with what TensorFlow's
``TFConfigClusterResolver`` reads, so an unmodified TensorFlow script runs under
``clusterflow start``; clusterflow's own runtime reads the same variable, so one code
path serves both.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from clusterflow.cluster.contract import TF_CONFIG
from clusterflow.cluster.errors import ClusterSpecError, TFConfigError
from clusterflow.cluster.spec import ClusterSpec, TaskId

__all__ = ["TF_CONFIG_ENV", "TFConfig"]

TF_CONFIG_ENV: Final = TF_CONFIG
"""The environment variable TensorFlow reads (this package's public name for
``cluster/contract.py``'s ``TF_CONFIG``)."""

# TensorFlow lets an evaluator's TF_CONFIG name the training cluster without listing the
# evaluator itself: it is a side task that never talks to the others.
_SIDE_TASK_JOB: Final = "evaluator"
_MAX_QUOTED: Final = 200
_CANONICAL_INDEX_RE: Final = re.compile(r"0|[1-9][0-9]*")


def _quote(text: str) -> str:
    if len(text) > _MAX_QUOTED:
        text = text[:_MAX_QUOTED] + "..."
    return repr(text)


@dataclass(frozen=True, slots=True)
class TFConfig:
    """The parsed content of ``TF_CONFIG``.

    Keys that TensorFlow defines but clusterflow does not use are kept
    (``environment``, ``rpc_layer``); unknown keys are ignored, as TensorFlow does.

    Raises:
        TFConfigError: on construction, when ``task`` is not in ``cluster`` (except an
            evaluator, which TensorFlow allows outside the cluster) or a field has the
            wrong type.
    """

    cluster: ClusterSpec
    """Every task of the cluster and its address."""
    task: TaskId | None = None
    """This process's task; ``None`` for a client that is not a task of the cluster."""
    environment: str | None = None
    """TensorFlow's ``environment`` (e.g. ``"cloud"``); passed through untouched."""
    rpc_layer: str | None = None
    """TensorFlow's ``rpc_layer`` (e.g. ``"grpc"``); passed through untouched."""

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterSpec):
            raise TFConfigError(f"TF_CONFIG cluster must be a ClusterSpec, got {self.cluster!r}")
        if self.task is not None and not isinstance(self.task, TaskId):
            raise TFConfigError(f"TF_CONFIG task must be a TaskId, got {self.task!r}")
        for name in ("environment", "rpc_layer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TFConfigError(f"TF_CONFIG {name!r} must be a string, got {value!r}")
        task = self.task
        if task is None or task in self.cluster:
            return
        if task.job not in self.cluster.jobs:
            if task.job == _SIDE_TASK_JOB:
                return
            raise TFConfigError(
                f"TF_CONFIG task type {task.job!r} is not a job of the cluster; it has jobs: "
                + (", ".join(self.cluster.jobs) or "(none)")
            )
        raise TFConfigError(
            f"TF_CONFIG task index {task.index} is not in job {task.job!r}; it has tasks: "
            + ", ".join(map(str, self.cluster.task_indices(task.job)))
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in TensorFlow's order: cluster, task, then the others."""
        result: dict[str, Any] = {"cluster": self.cluster.as_dict()}
        if self.task is not None:
            result["task"] = {"type": self.task.job, "index": self.task.index}
        if self.environment is not None:
            result["environment"] = self.environment
        if self.rpc_layer is not None:
            result["rpc_layer"] = self.rpc_layer
        return result

    def to_json(self) -> str:
        """Compact, stable JSON: equal configs give byte-equal strings."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_env(self) -> dict[str, str]:
        """``{"TF_CONFIG": json}``, ready to merge into a child process's environment."""
        return {TF_CONFIG_ENV: self.to_json()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TFConfig:
        """Builds a config from an already decoded ``TF_CONFIG`` object.

        Raises:
            TFConfigError: a key is missing or has the wrong type or value.
        """
        if not isinstance(data, Mapping):
            raise TFConfigError(f"TF_CONFIG must be a JSON object, got {data!r}")
        # No "cluster" key is TensorFlow's "no cluster": an empty spec (TF_CONFIG={}).
        cluster_data = data.get("cluster", {})
        if not isinstance(cluster_data, Mapping):
            raise TFConfigError(f"TF_CONFIG 'cluster' must be an object, got {cluster_data!r}")
        try:
            cluster = ClusterSpec(cluster_data)
        except ClusterSpecError as err:
            raise TFConfigError(f"TF_CONFIG 'cluster' is invalid: {err}") from err
        return cls(
            cluster=cluster,
            task=_parse_task(data.get("task")),
            environment=data.get("environment"),
            rpc_layer=data.get("rpc_layer"),
        )

    @classmethod
    def from_json(cls, text: str) -> TFConfig:
        """Parses ``TF_CONFIG``'s JSON text.

        Raises:
            TFConfigError: the text is not JSON (the message gives the position) or not
                TensorFlow's format.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TFConfigError(
                f"TF_CONFIG is not valid JSON ({err.msg} at line {err.lineno} column "
                f"{err.colno}, char {err.pos}): {_quote(text)}"
            ) from err
        except TypeError as err:
            raise TFConfigError(f"TF_CONFIG must be a JSON string, got {text!r}") from err
        if not isinstance(data, dict):
            raise TFConfigError(f"TF_CONFIG must be a JSON object, got {_quote(text)}")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TFConfig | None:
        """Reads ``TF_CONFIG`` from ``environ`` (default: ``os.environ``).

        Returns:
            The config, or ``None`` when the variable is unset or blank: the process is
            then a single-process run, not a task of a cluster.

        Raises:
            TFConfigError: the variable is set but invalid.
        """
        text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV)
        if text is None or not text.strip():
            return None
        return cls.from_json(text)


def _parse_task(task: object) -> TaskId | None:
    if task is None:
        return None
    if not isinstance(task, Mapping):
        raise TFConfigError(f"TF_CONFIG 'task' must be an object, got {task!r}")
    job, index = task.get("type"), task.get("index")
    if not isinstance(job, str):
        raise TFConfigError(f"TF_CONFIG task 'type' must be a job name, got {job!r}")
    # TensorFlow casts the index with int(), and launchers do write "1": a string in
    # canonical decimal is read as that integer. A bool, float or "01" is refused.
    if isinstance(index, str) and _CANONICAL_INDEX_RE.fullmatch(index):
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TFConfigError(f"TF_CONFIG task 'index' must be an integer >= 0, got {index!r}")
    try:
        return TaskId(job, index)
    except ClusterSpecError as err:
        raise TFConfigError(f"TF_CONFIG 'task' is invalid: {err}") from err
