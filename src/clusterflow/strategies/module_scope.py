"""What ``strategy.scope()`` does to modules: record them, then route their calls to DDP.

A TensorFlow user writes ``with strategy.scope(): model = build()`` and then calls
``model(x)``; the variables are mirrored without the user holding a wrapper. The same
here: while a scope is open, torch's global registration hooks record every module that
gains a parameter or a submodule; when it closes, each *root* (a recorded module that is
no recorded module's child) with trainable parameters is wrapped in
``DistributedDataParallel``, and the user's own object is switched to a subclass whose
``__call__`` goes through that wrapper. ``fully_shard`` (FSDP2) switches the class of the
module it shards the same way. The user keeps one object: ``model.parameters()``,
``model.state_dict()`` (keys without ``module.``), ``isinstance(model, Net)`` all stay
as they were.

While ``strategy.run`` runs a step, a global forward pre-hook checks that every module
with trainable parameters runs inside such a routed call: a module created outside the
scope, or a submodule called past its root, would compute gradients that are never
all-reduced, and the replicas would silently drift apart.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, cast

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from clusterflow.strategies.api import StrategyError

__all__ = [
    "ModuleRecorder",
    "forward_check",
    "is_prepared",
    "prepare_module",
    "replica_wrapper",
    "unprepare_class",
]

_REPLICA_ATTR: Final = "_clusterflow_replica"
_INSIDE_ATTR: Final = "_clusterflow_inside"
_ROUTED: Final = threading.local()
"""``depth``: how many routed calls of prepared modules are running on this thread."""
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_CLASSES_LOCK: Final = threading.Lock()


class ModuleRecorder:
    """Records modules built or extended while it is active (a ``scope()`` body)."""

    def __init__(self) -> None:
        self._seen: list[weakref.ref[nn.Module]] = []
        self._known: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._children: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._thread = threading.get_ident()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Installs torch's global registration hooks for the block; removes them after.

        The hooks are global; only modules built on this thread are recorded (a scope is
        its thread's, as in TensorFlow): another thread's model is not this one's.
        """
        self._thread = threading.get_ident()
        handles = [
            module_hooks.register_module_parameter_registration_hook(self._on_parameter),
            module_hooks.register_module_module_registration_hook(self._on_submodule),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def roots(self) -> list[nn.Module]:
        """Recorded modules that are no recorded module's child, in creation order."""
        alive = (ref() for ref in self._seen)
        return [m for m in alive if m is not None and m not in self._children]

    def _note(self, module: nn.Module) -> None:
        if module not in self._known:
            self._known.add(module)
            self._seen.append(weakref.ref(module))

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if threading.get_ident() == self._thread:
            self._note(module)

    def _on_submodule(self, module: nn.Module, name: str, submodule: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self._note(module)
        if isinstance(submodule, nn.Module):
            self._note(submodule)
            self._children.add(submodule)


def trainable(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has a parameter that requires a gradient."""
    return any(p.requires_grad for p in module.parameters())


def is_prepared(module: nn.Module) -> bool:
    return _REPLICA_ATTR in module.__dict__


def replica_wrapper(module: nn.Module) -> nn.Module | None:
    """The DDP wrapper a prepared module's calls go through (None for one replica)."""
    return cast("nn.Module | None", module.__dict__.get(_REPLICA_ATTR))


def prepare_module(module: nn.Module, wrapper: nn.Module | None) -> None:
    """Routes ``module``'s calls through ``wrapper`` (its DDP), by switching its class.

    ``wrapper`` is None for a single replica: the module is still marked, so the checks
    of :func:`forward_check` hold in a one-process run exactly as in a cluster.
    """
    # object.__setattr__: kept out of Module's registries, so the wrapper (which holds
    # the module) is neither a submodule (a cycle) nor in state_dict().
    object.__setattr__(module, _REPLICA_ATTR, wrapper)
    object.__setattr__(module, _INSIDE_ATTR, False)
    if type(module) not in _CLASSES.values():
        module.__class__ = _mirrored_class(type(module))


def unprepare_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before it was prepared."""
    cls = type(module)
    return cls.__bases__[0] if cls in _CLASSES.values() else cls


def _mirrored_class(cls: type[nn.Module]) -> type[nn.Module]:
    with _CLASSES_LOCK:
        mirrored = _CLASSES.get(cls)
        if mirrored is None:
            mirrored = type(
                f"Mirrored{cls.__name__}",
                (cls,),
                {
                    "__call__": _routed_call,
                    "__reduce_ex__": _reduce_plain,
                    "__module__": cls.__module__,
                    "__doc__": cls.__doc__,
                },
            )
            _CLASSES[cls] = mirrored
        return mirrored


def _routed_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state = self.__dict__
    wrapper = state[_REPLICA_ATTR]
    depth = getattr(_ROUTED, "depth", 0)
    _ROUTED.depth = depth + 1
    try:
        # Through DDP only when gradients will flow: an inner call (from DDP's own
        # forward), or a call under no_grad (evaluation, maybe on the chief alone, which
        # must not start a collective), goes straight to the module.
        if wrapper is None or state[_INSIDE_ATTR] or not torch.is_grad_enabled():
            return nn.Module.__call__(self, *args, **kwargs)
        state[_INSIDE_ATTR] = True
        try:
            return wrapper(*args, **kwargs)
        finally:
            state[_INSIDE_ATTR] = False
    finally:
        _ROUTED.depth = depth


def _reduce_plain(self: nn.Module, protocol: Any) -> tuple[Any, ...]:
    """Pickles (``torch.save(model)``, ``copy.deepcopy``) as the plain, unprepared module."""
    state = self.__getstate__()  # type: ignore[no-untyped-call]
    plain = {k: v for k, v in state.items() if k not in (_REPLICA_ATTR, _INSIDE_ATTR)}
    return (_restore_plain, (unprepare_class(self), plain))


def _restore_plain(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    module = cls.__new__(cls)
    module.__setstate__(state)  # type: ignore[no-untyped-call]
    return module


@contextmanager
def forward_check(describe: Callable[[nn.Module], str]) -> Iterator[None]:
    """Within the block, a trainable module called on this thread must run inside a
    prepared module's call.

    Args:
        describe: the error message for an offending module (it says what to do).

    Raises:
        StrategyError: from the offending module's call, before its forward runs.
    """

    thread = threading.get_ident()

    def check(module: nn.Module, args: Any) -> None:
        # The hook is global: another thread's modules (an evaluation thread's, say) are
        # not this step's.
        if threading.get_ident() != thread or getattr(_ROUTED, "depth", 0) > 0:
            return
        # Own parameters only: a container (Sequential) is checked through its children.
        if any(p is not None and p.requires_grad for p in module._parameters.values()):
            raise StrategyError(describe(module))

    handle = module_hooks.register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
