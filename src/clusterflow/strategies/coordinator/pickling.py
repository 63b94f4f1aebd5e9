"""How the chief pickles what it sends to the workers.

cloudpickle, because a scheduled function is usually a closure or a lambda of the
user's script, which the standard pickle refuses. What it makes travels only over the
cluster's authenticated RPC channel (the worker unpickles nothing else; see
``worker``).

Two things are not pickled by value:

- the strategy's variables (and the strategy itself) travel as references, which the
  worker binds to its own strategy's tensors, so a function closing over the chief's
  model trains the variables on the ps, not a copy;
- a ``RemoteValue`` among the arguments travels as a placeholder: the worker puts the
  input's value in its place, once it exists.

A function is pickled once, at its first ``schedule``, and identified by the hash of
its bytes; later calls send that hash and the arguments only.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import torch

from clusterflow.errors import ConfigError
from clusterflow.strategies.coordinator.api import (
    CoordinatorError,
    RemoteValue,
    SerializationError,
)
from clusterflow.strategies.coordinator.protocol import StrategySettings, digest_of
from clusterflow.strategies.coordinator.worker import bound_strategy, bound_variable
from clusterflow.strategies.parameter_server import ParameterServerStrategy

__all__ = ["FUNCTION_CACHE", "Packer", "PickledFunction"]

FUNCTION_CACHE = 128
"""Pickled functions kept on the chief (keyed by the function object)."""


@dataclass(frozen=True, slots=True)
class PickledFunction:
    """A function as the workers cache it: under the hash of its pickled bytes."""

    digest: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class _VariableRef:
    name: str
    is_parameter: bool
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class _Binding:
    """How the chief's strategy and its variables pickle: as references for the workers."""

    strategy: ParameterServerStrategy
    settings: StrategySettings
    tensors: dict[int, _VariableRef]
    count: int


class Packer:
    """Pickles the functions and arguments of one coordinator; safe to call from any thread.

    Args:
        strategy: the chief's strategy, whose variables travel as references.
        owner: the coordinator: a ``RemoteValue`` of another one is refused.
    """

    def __init__(self, strategy: ParameterServerStrategy, owner: object) -> None:
        self._strategy = strategy
        self._owner = owner
        self._lock = threading.Lock()
        self._functions: OrderedDict[Any, PickledFunction] = OrderedDict()
        self._binding: _Binding | None = None

    def pack(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        name: str,
    ) -> tuple[PickledFunction, bytes, list[RemoteValue]]:
        """``fn`` (pickled at its first call only), the pickled arguments, and their inputs.

        The inputs are the ``RemoteValue`` s among the arguments, each once, in the
        order of their placeholders.

        Raises:
            SerializationError: ``fn`` or the arguments cannot be pickled, or ``fn``
                closes over a ``RemoteValue``.
            ConfigError: a ``RemoteValue`` of another coordinator is among the arguments.
        """
        with self._lock:
            function = self._function(fn, name)
            blob, inputs = self._dumps((args, dict(kwargs)), what=f"arguments of {name}")
        return function, blob, inputs

    def _function(self, fn: Callable[..., Any], name: str) -> PickledFunction:
        try:
            cached = self._functions.get(fn)
        except TypeError:  # an unhashable bound method's object: pickle every time
            cached, fn_key = None, None
        else:
            fn_key = fn
        if cached is not None:
            self._functions.move_to_end(fn_key)
            return cached
        payload, _ = self._dumps(fn, what=name, inputs_allowed=False)
        function = PickledFunction(digest_of(payload), payload)
        if fn_key is not None:
            self._functions[fn_key] = function
            while len(self._functions) > FUNCTION_CACHE:
                self._functions.popitem(last=False)
        return function

    def _dumps(
        self, obj: Any, *, what: str, inputs_allowed: bool = True
    ) -> tuple[bytes, list[RemoteValue]]:
        buffer = io.BytesIO()
        pickler = _ChiefPickler(buffer, self._owner, self._current_binding(), inputs_allowed)
        try:
            pickler.dump(obj)
        except CoordinatorError:
            raise
        except ConfigError:
            raise
        except Exception as exc:
            raise SerializationError(f"cannot send {what} to the workers: {exc}") from exc
        return buffer.getvalue(), pickler.inputs

    def _current_binding(self) -> _Binding:
        """The strategy's variables as the workers bind them; rebuilt when more are created."""
        variables = self._strategy.variables()
        if self._binding is None or self._binding.count != len(variables):
            settings = StrategySettings(
                options=tuple(self._strategy.replica_options().items()),
                variables=tuple((spec, shards) for _, spec, shards in variables),
            )
            tensors = {
                id(tensor): _VariableRef(
                    spec.name, isinstance(tensor, torch.nn.Parameter), tensor.requires_grad
                )
                for tensor, spec, _ in variables
            }
            self._binding = _Binding(self._strategy, settings, tensors, len(variables))
        return self._binding


class _ChiefPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, with the strategy's variables as references and inputs as placeholders."""

    def __init__(
        self, file: io.BytesIO, owner: object, binding: _Binding, inputs_allowed: bool
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._owner = owner
        self._bound = binding
        self._inputs_allowed = inputs_allowed
        self._input_index: dict[int, int] = {}
        self.inputs: list[RemoteValue] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, RemoteValue):
            return None
        if not self._inputs_allowed:
            raise SerializationError(
                f"the function closes over {obj!r}; pass it as an argument to schedule() so "
                "the function waits for it"
            )
        if obj.owner is not self._owner:
            raise ConfigError(f"{obj!r} belongs to another ClusterCoordinator")
        if id(obj) not in self._input_index:
            self._input_index[id(obj)] = len(self.inputs)
            self.inputs.append(obj)
        return ("input", self._input_index[id(obj)])

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            ref = self._bound.tensors.get(id(obj))
            if ref is not None:
                args = (self._bound.settings, ref.name, ref.is_parameter, ref.requires_grad)
                return bound_variable, args
        elif obj is self._bound.strategy:
            return bound_strategy, (self._bound.settings,)
        return super().reducer_override(obj)
