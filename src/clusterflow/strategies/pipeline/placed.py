"""In-graph model parallelism: a module built under ``cf.device("/job:worker/task:k")``
runs on that task, driven by the chief over clusterflow's RPC (TensorFlow's in-graph
mode)::

    # train.py under `clusterflow start --chief --workers 1`: the chief drives
    if cf.TFConfig.from_env().task.job == "worker":
        cf.strategies.serve_worker()          # serves placed.* (and worker.*) until stopped
    else:
        with cf.device("/job:worker/task:0"):
            body = nn.Sequential(nn.Linear(64, 256), nn.ReLU())   # runs on worker:0
        head = nn.Linear(256, 10)                                 # runs here
        model = nn.Sequential(body, head)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # as usual

Calling the placed module sends its input to the task, which runs the forward and keeps
the autograd graph; the backward sends the output's gradient, and the task answers with
the gradients of the input and of the module's parameters, which land in the chief's
``.grad`` as if the module had run here. The variables stay with the chief (its
optimizer updates them, its checkpoints hold them); the task gets their values again
before the first forward after they changed (torch's version counters tell).

A placed module takes one tensor and returns one tensor. When the chief's interpreter
exits, the tasks it placed modules on are told to stop serving (``stop_placed_tasks``),
so the cluster ends with the chief.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import cloudpickle  # type: ignore[import-untyped]
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from clusterflow.cluster import TaskId, TFConfig
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.strategies.coordinator.protocol import METHOD_STOP
from clusterflow.strategies.pipeline.api import PipelineError
from clusterflow.strategies.pipeline.placed_protocol import (
    METHOD_BACKWARD,
    METHOD_FORWARD,
    METHOD_LOAD,
    METHOD_RELEASE,
)

__all__ = ["PlacedModule", "placing", "remote_task", "stop_placed_tasks"]

_log = logging.getLogger(__name__)

_REMOTE: Final = "_clusterflow_placed"
_ids = itertools.count()
_clients: dict[tuple[str, str], tuple[RpcClient, Credentials]] = {}
_clients_lock = threading.Lock()
_STOP_DEADLINE_S: Final = 5.0


def remote_task(task: TaskId) -> bool:
    """Whether modules placed on ``task`` run elsewhere: in a cluster, on another task."""
    config = TFConfig.from_env()
    if config is None or config.task is None or config.task == task:
        return False
    if task not in config.cluster.tasks():
        raise PipelineError(f"cf.device names {task}, which is not a task of this cluster")
    return True


@contextmanager
def placing(task: TaskId) -> Iterator[None]:
    """Records the modules built in the block; at its end, places the outermost ones
    with parameters on ``task`` (the body of a ``cf.device`` block outside a strategy)."""
    if not remote_task(task):
        yield
        return
    seen: list[weakref.ref[nn.Module]] = []
    children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    thread = threading.get_ident()

    def on_parameter(module: nn.Module, name: str, param: Any) -> None:
        if threading.get_ident() == thread and all(r() is not module for r in seen):
            seen.append(weakref.ref(module))

    def on_submodule(module: nn.Module, name: str, sub: Any) -> None:
        if threading.get_ident() == thread and isinstance(sub, nn.Module):
            children.add(sub)
            if all(r() is not module for r in seen):
                seen.append(weakref.ref(module))

    handles = [
        module_hooks.register_module_parameter_registration_hook(on_parameter),
        module_hooks.register_module_module_registration_hook(on_submodule),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    for ref in seen:
        module = ref()
        if module is not None and module not in children and list(module.parameters()):
            PlacedModule.place(module, task)


class PlacedModule:
    """The chief's handle on one module placed on another task."""

    def __init__(self, module: nn.Module, task: TaskId) -> None:
        self.task = task
        self.key = f"{os.getpid()}-{next(_ids)}"
        self.params = [p for p in module.parameters()]
        self._pushed: tuple[int, ...] | None = None
        self._client = _client_for(task)
        self._client.call(METHOD_LOAD, {"id": self.key, "module": cloudpickle.dumps(module)})
        self._calls = itertools.count()

    @classmethod
    def place(cls, module: nn.Module, task: TaskId) -> None:
        """Routes ``module``'s calls to ``task``; the module object stays the user's."""
        handle = cls(module, task)
        object.__setattr__(module, _REMOTE, handle)
        module.__class__ = _placed_class(type(module))
        _log.info("placed %s on %s", type(module).__name__, task)

    def _values(self) -> dict[str, torch.Tensor]:
        """The parameters' values when they changed since the task last got them."""
        versions = tuple(p._version for p in self.params)
        if versions == self._pushed:
            return {}
        self._pushed = versions
        return {f"p{i}": p.detach() for i, p in enumerate(self.params)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise PipelineError(
                f"a module placed on {self.task} takes one tensor, got {type(x).__name__}"
            )
        return _Remote.apply(self, x, *self.params)  # type: ignore[no-untyped-call,no-any-return]

    def call_forward(self, x: torch.Tensor, keep: bool) -> tuple[int, torch.Tensor]:
        call = next(self._calls)
        tensors = {"x": x.detach(), **self._values()}
        reply = self._client.call(
            METHOD_FORWARD, {"id": self.key, "call": call, "keep": keep}, tensors
        )
        return call, reply.tensors["y"]

    def call_backward(self, call: int, grad: torch.Tensor) -> tuple[Any, ...]:
        reply = self._client.call(METHOD_BACKWARD, {"id": self.key, "call": call}, {"gy": grad})
        grads = reply.tensors
        return (grads.get("gx"), *(grads.get(f"g{i}") for i in range(len(self.params))))

    def release(self, call: int) -> None:
        try:
            self._client.send(METHOD_RELEASE, {"id": self.key, "call": call})
        except Exception as exc:  # a lost release only costs the task memory until the cap
            _log.debug("could not release call %d on %s: %s", call, self.task, exc)


class _Remote(torch.autograd.Function):
    """Forward on the task; backward on the task; both over RPC."""

    @staticmethod
    def forward(ctx: Any, handle: PlacedModule, x: torch.Tensor, *params: torch.Tensor) -> Any:
        keep = torch.is_grad_enabled() or any(ctx.needs_input_grad[1:])
        call, y = handle.call_forward(x, keep=keep)
        ctx.handle, ctx.call = handle, call
        ctx.x_requires_grad = x.requires_grad
        if not keep:
            handle.release(call)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        gx, *gparams = ctx.handle.call_backward(ctx.call, grad.contiguous())
        return (None, gx if ctx.x_requires_grad else None, *gparams)


_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _placed_class(cls: type[nn.Module]) -> type[nn.Module]:
    placed = _CLASSES.get(cls)
    if placed is None:
        placed = type(
            f"Placed{cls.__name__}",
            (cls,),
            {"__call__": _placed_call, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
        _CLASSES[cls] = placed
    return placed


def _placed_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if kwargs or len(args) != 1:
        raise PipelineError(
            f"a placed {type(self).__bases__[0].__name__} takes one tensor argument; got "
            f"{len(args)} and {len(kwargs)} keywords"
        )
    handle: PlacedModule = self.__dict__[_REMOTE]
    return handle.forward(args[0])


def stop_placed_tasks() -> None:
    """Tells every task running this process's placed modules to stop serving.

    Their ``serve_worker()`` returns and they exit 0, so ``clusterflow start`` ends when
    the chief does. Runs by itself when the chief's interpreter exits; idempotent.
    """
    with _clients_lock:
        clients = dict(_clients)
        _clients.clear()
    for (address, _), (client, credentials) in clients.items():
        client.close()
        try:
            with RpcClient(address, credentials, deadline=_STOP_DEADLINE_S) as stopper:
                stopper.call(METHOD_STOP)
        except Exception as exc:  # it may be gone already: nothing left to stop
            _log.debug("could not stop the task at %s: %s", address, exc)


def _client_for(task: TaskId) -> RpcClient:
    """One client per task address and secret (a new cluster in this process gets its own)."""
    config = TFConfig.from_env()
    credentials = Credentials.from_env()
    if config is None or credentials is None:
        raise PipelineError(
            f"cannot reach {task}: no TF_CONFIG or cluster credentials; run under "
            "`clusterflow start`"
        )
    address = config.cluster.task_address(task.job, task.index)
    key = (address, credentials.to_hex())
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            if not _clients:
                atexit.register(stop_placed_tasks)
            found = _clients[key] = (RpcClient(address, credentials), credentials)
        return found[0]
