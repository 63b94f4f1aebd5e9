"""The dataflow rule of the coordinator, as a pure graph: no threads, no sockets, no clock.

A scheduled function runs once every function whose result it takes has succeeded
(TensorFlow's executor keeps a pending-input counter per node; so does this). When one
fails, every function that waits for it, directly or through others, fails too
without running.

Only unfinished functions are nodes: a finished one leaves the graph at once, so a
long training loop that schedules a step per batch holds only what is in flight. The
caller says which inputs already finished: it holds their results.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["DependencyGraph"]


class DependencyGraph:
    """The unfinished functions, numbered by the caller (never reused), and what they wait for.

    Call order for each function: ``add`` once; then exactly one of ``succeed`` or
    ``fail`` (``fail`` of an input also finishes it). A function whose inputs are
    all done is *ready*: ``add`` or ``succeed`` says so once, and the caller runs it.
    """

    def __init__(self) -> None:
        self._waiting: dict[int, int] = {}
        """Every unfinished node: how many of its inputs are unfinished."""
        self._dependents: dict[int, list[int]] = {}
        """Unfinished nodes that others wait for: those others, in the order they came."""

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, node: object) -> bool:
        return node in self._waiting

    def add(self, node: int, inputs: Iterable[int]) -> bool:
        """Adds ``node``, waiting for those of ``inputs`` still in the graph; True if ready.

        Inputs not in the graph count as succeeded: check first that none failed.

        Raises:
            ValueError: ``node`` is in the graph already, or is among its own inputs.
        """
        if node in self._waiting:
            raise ValueError(f"node {node} is in the graph already")
        inputs = list(inputs)
        if node in inputs:
            raise ValueError(f"node {node} cannot wait for itself")
        pending = dict.fromkeys(i for i in inputs if i in self._waiting)
        for source in pending:
            self._dependents.setdefault(source, []).append(node)
        self._waiting[node] = len(pending)
        return not pending

    def succeed(self, node: int) -> list[int]:
        """Finishes ``node``; the nodes that became ready, in the order they were added.

        A node not in the graph (finished before) is ignored: nothing becomes ready.
        """
        if self._waiting.pop(node, None) is None:
            return []
        ready = []
        for dependent in self._dependents.pop(node, []):
            if dependent not in self._waiting:
                continue  # failed meanwhile through another of its inputs
            self._waiting[dependent] -= 1
            if self._waiting[dependent] == 0:
                ready.append(dependent)
        return ready

    def fail(self, node: int) -> list[tuple[int, int]]:
        """Finishes ``node`` and every node that waits for it, directly or not.

        Returns ``(dependent, failed input)`` for each dependent that failed with it,
        each after its failed input (so the caller can say which input it lost), in
        breadth-first order. A node not in the graph is ignored.
        """
        if self._waiting.pop(node, None) is None:
            return []
        failed: list[tuple[int, int]] = []
        frontier = deque([node])
        while frontier:
            source = frontier.popleft()
            for dependent in self._dependents.pop(source, []):
                if self._waiting.pop(dependent, None) is not None:
                    failed.append((dependent, source))
                    frontier.append(dependent)
        return failed
