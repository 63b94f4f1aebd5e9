"""What the dense (``protocol.py``) and sparse (``rows_protocol.py``) ps contracts share.

A message on the wire is a msgpack-able body and named tensors; both halves read a
request's body the same way and wait the same default bound. They live here, below both,
because ``protocol.py`` routes the ``rows_*`` names to ``rows_protocol.py`` (so the sparse
half cannot import the dense one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from clusterflow.ps.api import MalformedRequest
from clusterflow.ps.applied import Key
from clusterflow.rpc.message import body_map

if TYPE_CHECKING:
    import torch

# torch by name only: the manager reads these helpers (``ps/membership.py``) and must not
# pay torch's import (docs/architecture.md section 2).
Tensors = dict[str, "torch.Tensor"]
"""Named tensors, as a message carries them and the ps and its clients hold them."""
Wire = tuple[Any, Tensors]
"""A message as it travels: a msgpack-able body and named tensors."""

DEFAULT_TIMEOUT_S = 60.0
"""How long a ps waits for a version or a quiesced store when a request names no bound."""


def split_keys(method: str, field: str, value: Any) -> tuple[Key, ...]:
    """A message's list of split keys, ``[dataset, epoch, split]`` triples (``None``:
    none), or ``MalformedRequest``: the one decoder for the dense and the row pushes and
    their replies, so both refuse the same bodies (a string epoch, a bool, a pair)."""
    if value is None:
        return ()
    ok = isinstance(value, list | tuple) and all(
        isinstance(k, list | tuple)
        and len(k) == 3
        and isinstance(k[0], str)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in k[1:])
        for k in value
    )
    if not ok:
        raise MalformedRequest(
            f"ps.{method}: {field!r} must be [dataset, epoch, split] triples, got {value!r:.80}"
        )
    return tuple((str(d), int(e), int(s)) for d, e, s in value)


def request_body(method: str, body: Any) -> Mapping[str, Any]:
    """A request's body as a map (``None`` is an empty one), or ``MalformedRequest``."""
    return body_map(f"ps.{method} request body", body, none_is_empty=True, error=MalformedRequest)


MAX_WAIT_S = 3600.0
"""The longest wait a request may ask for: a NaN, an infinity or a year would hold a
handler thread of the ps for good (docs/failure-semantics.md, "Hostile bytes")."""

BOUNDED: Mapping[str, tuple[float, float]] = {
    "timeout": (0.0, MAX_WAIT_S),
    "min_version": (-(2.0**62), 2.0**62),
    "version": (-(2.0**62), 2.0**62),
}
"""Fields whose value must lie in ``low..high`` (a NaN lies nowhere): a version is a step
counter, so one near 2**63 is not a version a ps will ever reach, only a handler thread
held for nothing. Both halves of the contract check them through ``in_bounds``."""


def in_bounds(method: str, key: str, value: float) -> None:
    """``MalformedRequest`` when ``key`` is a bounded field and ``value`` lies outside it."""
    low, high = BOUNDED.get(key, (None, None))
    if low is not None and high is not None and not low <= value <= high:
        raise MalformedRequest(
            f"ps.{method} request: {key!r} must be in {low:g}..{high:g}, got {value!r:.80}"
        )
