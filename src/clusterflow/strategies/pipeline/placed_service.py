"""The task's side of in-graph placement: the ``placed.*`` service (``placed_protocol.py``).

Registered on a worker's ``Server`` by ``serve_worker``. A module arrives pickled by the
chief, over the task's authenticated channel only (the same rule as the coordinator's
functions); each forward keeps its graph until its backward, at most ``KEPT_CALLS`` per
module.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import torch
from torch import nn

from clusterflow.rpc import Request, Response
from clusterflow.server import Server
from clusterflow.strategies.pipeline.api import PipelineError
from clusterflow.strategies.pipeline.placed_protocol import (
    KEPT_CALLS,
    METHOD_BACKWARD,
    METHOD_FORWARD,
    METHOD_LOAD,
    METHOD_RELEASE,
)

__all__ = ["PlacedService"]

_log = logging.getLogger(__name__)


class PlacedService:
    """Runs the chief's placed modules on this task."""

    def __init__(self, server: Server) -> None:
        self._modules: dict[str, nn.Module] = {}
        self._graphs: dict[str, OrderedDict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.calls = 0
        server.register(METHOD_LOAD, self._on_load, blocking=True)
        server.register(METHOD_FORWARD, self._on_forward, blocking=True)
        server.register(METHOD_BACKWARD, self._on_backward, blocking=True)
        server.register(METHOD_RELEASE, self._on_release)

    def _module(self, key: str) -> nn.Module:
        module = self._modules.get(key)
        if module is None:
            raise PipelineError(f"no placed module {key!r} on this task (was it loaded?)")
        return module

    def _on_load(self, request: Request) -> dict[str, Any]:
        module = cloudpickle.loads(request.body["module"])
        if not isinstance(module, nn.Module):
            raise PipelineError(f"placed.load got a {type(module).__name__}, not a module")
        with self._lock:
            self._modules[request.body["id"]] = module
            self._graphs[request.body["id"]] = OrderedDict()
        _log.info("running placed %s (%s)", type(module).__name__, request.body["id"])
        return {"ok": True}

    def _on_forward(self, request: Request) -> Response:
        key, call, keep = request.body["id"], int(request.body["call"]), bool(request.body["keep"])
        module = self._module(key)
        params = list(module.parameters())
        with torch.no_grad():
            for i, param in enumerate(params):
                value = request.tensors.get(f"p{i}")
                if value is not None:
                    param.copy_(value)
        x = request.tensors["x"].clone()
        self.calls += 1
        if not keep:
            with torch.no_grad():
                return Response({}, {"y": module(x)})
        x.requires_grad_(x.is_floating_point())
        with torch.enable_grad():
            y = module(x)
        graphs = self._graphs[key]
        with self._lock:
            graphs[call] = (x, y)
            while len(graphs) > KEPT_CALLS:
                graphs.popitem(last=False)
        return Response({}, {"y": y.detach()})

    def _on_backward(self, request: Request) -> Response:
        key, call = request.body["id"], int(request.body["call"])
        module = self._module(key)
        with self._lock:
            found = self._graphs[key].pop(call, None)
        if found is None:
            raise PipelineError(f"no forward {call} of placed module {key!r} awaits a backward")
        x, y = found
        params = list(module.parameters())
        inputs = [x, *params] if x.requires_grad else params
        grads = torch.autograd.grad(y, inputs, request.tensors["gy"], allow_unused=True)
        tensors: dict[str, torch.Tensor] = {}
        if x.requires_grad:
            gx, *rest = grads
            if gx is not None:
                tensors["gx"] = gx
        else:
            rest = list(grads)
        for i, grad in enumerate(rest):
            if grad is not None:
                tensors[f"g{i}"] = grad
        return Response({}, tensors)

    def _on_release(self, request: Request) -> None:
        with self._lock:
            graphs = self._graphs.get(request.body["id"])
            if graphs is not None:
                graphs.pop(int(request.body["call"]), None)
