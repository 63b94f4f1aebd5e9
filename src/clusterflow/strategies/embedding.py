"""``nn.Embedding`` and ``nn.EmbeddingBag`` built in a ps scope become ps-sharded tables.

While ``ParameterServerStrategy.scope()`` is open on a thread, the two classes' weights
are created on the ``meta`` device: a 50M-row table allocates nothing on the worker.
When the scope closes each such module is switched to ``PSEmbedding`` /
``PSEmbeddingBag`` (subclasses: ``isinstance`` holds, the constructor's settings stay),
whose forward de-duplicates the batch's ids, fetches those rows from the ps tasks
through its ``TableSession`` (``parameter_server/tables.py``), and runs torch's own
``F.embedding``/``F.embedding_bag`` over the small local block of rows. Backward fills
that block's gradient: one row per unique id, already coalesced, which the session
pushes as ``(ids, rows)``. ``sparse=True`` or not, the result is the same.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from clusterflow.errors import ConfigError

_local = threading.local()
_PATCH_LOCK = threading.Lock()
_patched = [0]
"""How many scopes are open, on any thread: the classes are patched while one is."""
_ORIGINAL: dict[type[nn.Module], Callable[..., None]] = {
    nn.Embedding: nn.Embedding.__init__,
    nn.EmbeddingBag: nn.EmbeddingBag.__init__,
}


class RowSource(Protocol):
    """Where a table module gets its rows (``TableSession``)."""

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (unique, in range) as a leaf that collects their gradient."""
        ...

    def read(self, table: str) -> torch.Tensor:
        """The whole table, joined from every shard (tests and small tables only)."""
        ...


def _stack() -> list[list[nn.Module]]:
    if not hasattr(_local, "tables"):
        _local.tables = []
    stack: list[list[nn.Module]] = _local.tables
    return stack


def _meta_init(cls: type[nn.Module]) -> Callable[..., None]:
    original = _ORIGINAL[cls]

    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        stack = _stack()
        if not stack or kwargs.get("_weight") is not None:
            original(self, *args, **kwargs)
            return
        kwargs["device"] = "meta"
        original(self, *args, **kwargs)
        if getattr(self, "max_norm", None) is not None:
            raise ConfigError(
                f"{cls.__name__}(max_norm=...) renormalises rows in place; a ps-sharded "
                "table cannot do that: drop max_norm"
            )
        stack[-1].append(self)

    return init


@contextlib.contextmanager
def intercepting() -> Iterator[list[nn.Module]]:
    """Within the block, embeddings built on this thread are meta tables; yields them."""
    found: list[nn.Module] = []
    with _PATCH_LOCK:
        if _patched[0] == 0:
            for cls in _ORIGINAL:
                cls.__init__ = _meta_init(cls)  # type: ignore[method-assign]
        _patched[0] += 1
    _stack().append(found)
    try:
        yield found
    finally:
        _stack().pop()
        with _PATCH_LOCK:
            _patched[0] -= 1
            if _patched[0] == 0:
                for cls, original in _ORIGINAL.items():
                    cls.__init__ = original  # type: ignore[method-assign]


def attach(module: nn.Module, name: str, source: RowSource) -> None:
    """Makes a meta embedding module read its rows from ``source`` as table ``name``."""
    object.__setattr__(module, "_cf_table", (name, source))
    if isinstance(module, nn.EmbeddingBag):
        module.__class__ = PSEmbeddingBag
    else:
        module.__class__ = PSEmbedding


def _rows(module: nn.Module, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(local ids of ``input``, the leaf of their rows, the local padding index)."""
    name, source = module.__dict__["_cf_table"]
    unique, inverse = torch.unique(input.reshape(-1).to(torch.int64), return_inverse=True)
    rows = source.lookup(name, unique)
    padding = getattr(module, "padding_idx", None)
    local_pad = None
    if padding is not None and unique.numel():
        at = torch.searchsorted(unique, torch.tensor([padding]))
        if int(at) < unique.numel() and int(unique[at]) == padding:
            local_pad = int(at)
    return inverse.view(input.shape), rows, local_pad


class PSEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose rows live on the ps tasks (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        local, rows, pad = _rows(self, input)
        return F.embedding(
            local, rows, pad, None, self.norm_type, self.scale_grad_by_freq, sparse=False
        )


class PSEmbeddingBag(nn.EmbeddingBag):
    """An ``nn.EmbeddingBag`` whose rows live on the ps tasks (see the module docstring)."""

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        local, rows, pad = _rows(self, input)
        return F.embedding_bag(
            local,
            rows,
            offsets,
            None,
            self.norm_type,
            self.scale_grad_by_freq,
            self.mode,
            False,
            per_sample_weights,
            self.include_last_offset,
            pad,
        )


def table_modules(model: nn.Module) -> list[nn.Module]:
    """The ps-sharded tables among ``model``'s modules."""
    return [m for m in model.modules() if "_cf_table" in m.__dict__]


def read_table(module: nn.Module) -> torch.Tensor:
    """The whole of a ps-sharded table's weight, joined from every shard.

    For tests and small tables: the point of a ps table is never to build it whole.
    """
    name, source = module.__dict__["_cf_table"]
    return source.read(name)  # type: ignore[no-any-return]
