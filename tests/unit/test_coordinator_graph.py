"""The coordinator's dataflow rule and ``RemoteValue``, on plain values, without processes."""

from __future__ import annotations

import pickle
import threading

import pytest

from clusterflow.strategies.coordinator.api import (
    CoordinatorClosed,
    CoordinatorError,
    CoordinatorTimeout,
    RemoteValue,
)
from clusterflow.strategies.coordinator.graph import DependencyGraph


def test_a_function_without_unfinished_inputs_is_ready_at_once() -> None:
    graph = DependencyGraph()
    assert graph.add(0, []) is True
    # An input that left the graph (it succeeded earlier) holds nothing up.
    assert graph.add(1, [7]) is True
    assert len(graph) == 2 and 0 in graph and 7 not in graph


def test_a_chain_becomes_ready_one_link_at_a_time() -> None:
    graph = DependencyGraph()
    assert graph.add(0, [])
    assert not graph.add(1, [0])
    assert not graph.add(2, [1])
    assert graph.succeed(0) == [1]
    assert graph.succeed(1) == [2]
    assert graph.succeed(2) == []
    assert len(graph) == 0


def test_a_diamond_waits_for_every_input_and_counts_a_repeated_input_once() -> None:
    graph = DependencyGraph()
    graph.add(0, [])
    graph.add(1, [0])
    graph.add(2, [0, 0])
    graph.add(3, [1, 2, 1])
    assert graph.succeed(0) == [1, 2]  # in the order they were added
    assert graph.succeed(2) == []  # 3 still waits for 1
    assert graph.succeed(1) == [3]


def test_a_failure_fails_every_function_downstream_each_after_its_cause() -> None:
    graph = DependencyGraph()
    graph.add(0, [])
    graph.add(9, [])
    graph.add(1, [0])
    graph.add(2, [1, 9])
    graph.add(3, [2])
    graph.add(4, [9])
    failed = graph.fail(0)
    assert failed == [(1, 0), (2, 1), (3, 2)]
    assert 4 in graph and 9 in graph and all(n not in graph for n in (0, 1, 2, 3))
    # 2 also waited for 9: 9's success must not wake the failed 2.
    assert graph.succeed(9) == [4]


def test_finishing_twice_or_an_unknown_node_is_ignored() -> None:
    graph = DependencyGraph()
    graph.add(0, [])
    graph.add(1, [0])
    assert graph.fail(0) == [(1, 0)]
    assert graph.succeed(0) == []
    assert graph.succeed(1) == []
    assert graph.fail(5) == []
    assert len(graph) == 0


def test_a_node_cannot_be_added_twice_nor_wait_for_itself() -> None:
    graph = DependencyGraph()
    graph.add(0, [])
    with pytest.raises(ValueError, match="already"):
        graph.add(0, [])
    with pytest.raises(ValueError, match="itself"):
        graph.add(1, [0, 1])
    assert 1 not in graph


# RemoteValue --------------------------------------------------------------------


def test_a_remote_value_gives_its_result_once_set_and_unpickles_it_once() -> None:
    rv = RemoteValue(owner=None, index=4, name="step")
    assert not rv.done() and rv.error() is None and "pending" in repr(rv)
    with pytest.raises(CoordinatorTimeout):
        rv.fetch(timeout=0.01)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(rv.fetch(timeout=10)), daemon=True)
    reader.start()
    rv.set_result(pickle.dumps({"loss": 0.5}))
    reader.join(10)
    assert got == [{"loss": 0.5}]
    assert rv.get() is rv.fetch()  # unpickled on first use only
    assert rv.done() and rv.error() is None and "done" in repr(rv)
    assert pickle.loads(rv.pickled()) == {"loss": 0.5}


def test_a_failed_remote_value_raises_its_error_and_holds_no_result() -> None:
    rv = RemoteValue(owner=None, index=1, name="step")
    error = CoordinatorClosed("step: coordinator closed")
    rv.set_error(error)
    assert rv.error() is error and "failed" in repr(rv)
    with pytest.raises(CoordinatorClosed):
        rv.fetch()
    with pytest.raises(CoordinatorError, match="holds no result"):
        rv.pickled()
