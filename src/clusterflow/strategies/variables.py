"""Recording the variables created inside a strategy's ``scope()``.

torch has global hooks that fire whenever any module registers a parameter or a
buffer; a scope installs them while it is open, so ``model = Net()`` inside it is seen
without any change to ``Net`` (the role of TensorFlow's variable creator scope).
``clusterflow.device("/job:ps/task:1")`` pins the variables created under it, and
``clusterflow.Variable(tensor)`` creates a free-standing variable.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules import module as module_hooks

from clusterflow.cluster import DeviceSpec, TaskId
from clusterflow.errors import ConfigError

_local = threading.local()


@dataclass(slots=True)
class Recorded:
    tensor: torch.Tensor
    name: str
    trainable: bool
    device: int | None


class Recorder:
    """Collects the tensors registered while it is active, in creation order."""

    def __init__(self) -> None:
        self.items: list[Recorded] = []
        self._seen: set[int] = set()
        self.thread = threading.get_ident()

    def add(self, tensor: torch.Tensor, label: str, trainable: bool) -> None:
        # torch's hooks are global: modules built by other threads are not ours.
        if id(tensor) in self._seen or threading.get_ident() != self.thread:
            return
        self._seen.add(id(tensor))
        self.items.append(
            Recorded(tensor, f"v{len(self.items):04d}.{label}", trainable, current_device())
        )


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Records every parameter and buffer registered by any module while open."""
    recorder = Recorder()

    def on_parameter(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None:
            recorder.add(param, f"{type(module).__name__}.{name}", param.requires_grad)

    def on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> None:
        if buffer is not None and name not in getattr(module, "_non_persistent_buffers_set", ()):
            recorder.add(buffer, f"{type(module).__name__}.{name}", False)

    handles = [
        module_hooks.register_module_parameter_registration_hook(on_parameter),
        module_hooks.register_module_buffer_registration_hook(on_buffer),
    ]
    stack = _recorders()
    stack.append(recorder)
    try:
        yield recorder
    finally:
        stack.pop()
        for handle in handles:
            handle.remove()


def _recorders() -> list[Recorder]:
    if not hasattr(_local, "recorders"):
        _local.recorders = []
    stack: list[Recorder] = _local.recorders
    return stack


def _devices() -> list[int | None]:
    if not hasattr(_local, "devices"):
        _local.devices = []
    stack: list[int | None] = _local.devices
    return stack


def current_device() -> int | None:
    stack = _devices()
    return stack[-1] if stack else None


def _placements() -> list[TaskId]:
    if not hasattr(_local, "placements"):
        _local.placements = []
    stack: list[TaskId] = _local.placements
    return stack


def current_placement() -> TaskId | None:
    """The chief or worker task of the innermost ``device`` block, if any."""
    stack = _placements()
    return stack[-1] if stack else None


@contextlib.contextmanager
def device(name: str) -> Iterator[None]:
    """Places what is created inside on one task, as ``tf.device`` does.

    ``device("/job:ps/task:1")``: the variables go to that ps task (parameter servers).
    ``device("/job:worker/task:1")`` (or ``chief``): the modules built inside run on that
    task: a ``PipelineStrategy`` makes them that task's stage; outside its scope, on
    the chief of a cluster, they run on that task over RPC (in-graph; see
    ``strategies/pipeline/placed.py``).

    Raises:
        ConfigError: a device string that names no ps, chief or worker task.
    """
    spec = DeviceSpec.parse(name)
    task = spec.task_id
    if task is None or task.job not in ("ps", "chief", "worker"):
        raise ConfigError(f"device {name!r} names no task: give /job:ps|chief|worker/task:N")
    if task.job == "ps":
        ps_stack = _devices()
        ps_stack.append(task.index)
        try:
            yield
        finally:
            ps_stack.pop()
        return
    stack = _placements()
    stack.append(task)
    try:
        if getattr(_local, "pipeline_scopes", 0):
            yield  # a PipelineStrategy's scope makes the block's layers that task's stage
        else:
            from clusterflow.strategies.pipeline.placed import placing

            with placing(task):  # in-graph: the block's modules run on that task
                yield
    finally:
        stack.pop()


@contextlib.contextmanager
def pipeline_scope() -> Iterator[None]:
    """Inside, ``device`` blocks of chief or worker tasks name pipeline stages."""
    _local.pipeline_scopes = getattr(_local, "pipeline_scopes", 0) + 1
    try:
        yield
    finally:
        _local.pipeline_scopes -= 1


def Variable(
    initial_value: Any, *, trainable: bool = True, name: str | None = None
) -> torch.Tensor:
    """A variable outside any module: a tensor the enclosing strategy scope places.

    Returns a leaf tensor (``requires_grad`` if trainable) to use like a parameter.

    Raises:
        ConfigError: no strategy scope is open.
    """
    stack = _recorders()
    if not stack:
        raise ConfigError("clusterflow.Variable must be created inside strategy.scope()")
    tensor = torch.as_tensor(initial_value).detach().clone()
    if trainable:
        tensor = torch.nn.Parameter(tensor)
    stack[-1].add(tensor, name or "Variable", trainable)
    return tensor
