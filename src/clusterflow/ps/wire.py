"""What the dense (``protocol.py``) and sparse (``rows_protocol.py``) ps contracts share.

A message on the wire is a msgpack-able body and named tensors; both halves read a
request's body the same way and wait the same default bound. They live here, below both,
because ``protocol.py`` routes the ``rows_*`` names to ``rows_protocol.py`` (so the sparse
half cannot import the dense one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from clusterflow.ps.api import MalformedRequest

Tensors = dict[str, torch.Tensor]
Wire = tuple[Any, Tensors]
"""A message as it travels: a msgpack-able body and named tensors."""

DEFAULT_TIMEOUT_S = 60.0
"""How long a ps waits for a version or a quiesced store when a request names no bound."""


def request_body(method: str, body: Any) -> Mapping[str, Any]:
    """A request's body as a map (``None`` is an empty one), or ``MalformedRequest``."""
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise MalformedRequest(f"ps.{method} request body must be a map, got {body!r:.80}")
    return body
