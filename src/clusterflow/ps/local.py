"""An in-process ps: ``CentralStorageStrategy``'s connection, and the tests'.

Beside ``ps/client.py``'s ``RemotePS``, not in it: this one holds the ps's state and
its handler, which a worker talking to remote ps tasks never loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from clusterflow.ps.handler import PSHandler
from clusterflow.ps.protocol import PullReply, PullRequest, PushReply, PushRequest
from clusterflow.ps.store import VariableStore
from clusterflow.ps.wire import Tensors

T = TypeVar("T")


class LocalPS:
    """One in-process ps: the same calls, no network, no copies on the wire."""

    def __init__(self, store: VariableStore | None = None) -> None:
        self.store = store or VariableStore(0)
        self.handler = PSHandler(self.store)

    @property
    def num_ps(self) -> int:
        return 1

    def call(
        self, index: int, method: str, body: Any = None, tensors: Tensors | None = None
    ) -> tuple[Any, Tensors]:
        return self.handler.dispatch(method, body, tensors or {})

    def pull(self, index: int, request: PullRequest) -> PullReply:
        return self.handler.pull(request)

    def push(self, index: int, request: PushRequest) -> PushReply:
        return self.handler.push(request)

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        return [fn(i) for i in indices]

    def close(self) -> None:
        pass
