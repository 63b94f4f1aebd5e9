"""``overlap_push``: an async push travels while the next step computes.

What the overlap may change and what it must not: a step reads values at most one of
its own pushes old (one version of staleness more, within ``max_staleness``); every
push is still applied exactly once, the step counts and the settled keys are those of
the pushes, and the parameters follow the one-step-delayed trajectory exactly.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from clusterflow.data import SplitKey
from clusterflow.ps.local import LocalPS
from clusterflow.ps.protocol import PushReply, PushRequest
from clusterflow.strategies import SimpleClusterResolver
from clusterflow.strategies.parameter_server import ParameterServerStrategy

STEPS = 6
LR = 0.5
TARGET = torch.tensor([[1.0, -2.0, 3.0, 0.5]])


class Recording(LocalPS):
    """The in-process ps, recording the staleness of every push it answered."""

    def __init__(self) -> None:
        super().__init__()
        self.staleness: list[int] = []

    def push(self, index: int, request: PushRequest) -> PushReply:
        reply = super().push(index, request)
        self.staleness.append(reply.staleness)
        return reply


class Gated(Recording):
    """Holds each push until the next step has loaded its values (``release``), so a
    step computes while its predecessor's push is surely in flight: deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)

    def push(self, index: int, request: PushRequest) -> PushReply:
        assert self.gate.acquire(timeout=30), "no step let the push through"
        return super().push(index, request)


def strategy(connection: LocalPS, **options: Any) -> ParameterServerStrategy:
    spec = {"worker": ["127.0.0.1:2000"], "ps": ["127.0.0.1:3000"]}
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=0)
    return ParameterServerStrategy(resolver, _connection=connection, **options)


def train(s: ParameterServerStrategy, before_step: Any = None) -> torch.Tensor:
    """``STEPS`` steps of SGD on 0.5 ||w - TARGET||^2 (gradient: w - TARGET); each
    completes one split. Returns the final values on the ps."""
    with s.scope():
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(model.weight)  # the values the ps starts from
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        if before_step is not None:
            before_step()
        (0.5 * (model.weight - TARGET).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()

    for k in range(STEPS):
        s.run(step, completes=[SplitKey("ds", 0, k)])
    return model.weight


def expected(delay: int) -> torch.Tensor:
    """The values after ``STEPS`` pushes whose gradient was taken ``delay`` versions back."""
    w = [torch.zeros(1, 4)]  # version 0: what every replica starts from (zeros on the ps)
    for k in range(STEPS):
        w.append(w[-1] - LR * (w[max(0, k - delay)] - TARGET))
    return w[-1]


def test_overlapped_pushes_follow_the_one_step_delayed_trajectory_exactly_once() -> None:
    connection = Gated()
    s = strategy(connection, max_staleness=1)
    first = [True]

    def release_previous_push() -> None:  # runs after run() loaded this step's values
        if first[0]:
            first[0] = False
        else:
            connection.gate.release()

    keys = [SplitKey("ds", 0, k) for k in range(STEPS)]
    final = train(s, before_step=release_previous_push)
    connection.gate.release()  # the last push, which no next step lets through
    settled = s.settled(wait=True)
    s.pull_values()

    assert torch.allclose(final.detach(), expected(delay=1), atol=1e-6)
    assert not torch.allclose(expected(delay=1), expected(delay=0))  # the test can tell
    # Each push one version old at the ps (its predecessor applied after it was read):
    # within max_staleness=1, so none dropped; every key applied exactly once.
    assert connection.staleness == [0] + [1] * (STEPS - 1)
    assert settled.applied == tuple(keys) and not settled.dropped
    stats = connection.store.snapshot_stats()
    assert stats["version"] == STEPS and stats["applied"] == STEPS
    assert s.steps == STEPS and s.dropped_pushes == 0 and s.global_step() == STEPS


def test_without_overlap_every_step_reads_the_newest_values() -> None:
    connection = Recording()
    s = strategy(connection, overlap_push=False)
    final = train(s)
    s.pull_values()
    assert torch.allclose(final.detach(), expected(delay=0), atol=1e-6)
    assert connection.staleness == [0] * STEPS


def test_max_staleness_zero_leaves_no_room_for_a_push_in_flight() -> None:
    """The bound wins over the overlap: no push is dropped as stale at one worker."""
    connection = Recording()
    s = strategy(connection, max_staleness=0)  # overlap_push left at its default, True
    final = train(s)
    settled = s.settled(wait=True)
    s.pull_values()
    assert connection.staleness == [0] * STEPS
    assert len(settled.applied) == STEPS and not settled.dropped and s.dropped_pushes == 0
    assert connection.store.snapshot_stats()["version"] == STEPS
    assert torch.allclose(final.detach(), expected(delay=0), atol=1e-6)


def test_an_unbounded_overlap_reads_values_at_most_one_push_old() -> None:
    """Without a gate the push may or may not be back when the next step starts: each
    step reads values from its last push's reply or the one before, never older."""
    connection = Recording()
    s = strategy(connection)
    final = train(s)
    settled = s.settled(wait=True)
    s.pull_values()
    assert all(st <= 1 for st in connection.staleness) and len(connection.staleness) == STEPS
    assert len(settled.applied) == STEPS and connection.store.snapshot_stats()["applied"] == STEPS
    assert (final.detach() - TARGET).norm() < TARGET.norm() and s.steps == STEPS


class GatedRows(LocalPS):
    """Holds each row push until the next step has looked its rows up (``gate``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)
        self.staleness: list[int] = []

    def call(self, index: int, method: str, body: Any = None, tensors: Any = None) -> Any:
        if method != "rows_push":
            return super().call(index, method, body, tensors)
        assert self.gate.acquire(timeout=30), "no step let the row push through"
        reply = super().call(index, method, body, tensors)
        self.staleness.append(int(reply[0]["staleness"]))
        return reply


@pytest.mark.parametrize("dense", [False, True], ids=["tables-alone", "with-dense"])
def test_a_row_push_travels_while_the_next_step_computes_and_applies_once(dense: bool) -> None:
    """Issue 28: row pushes of embedding tables overlap the next step, as dense ones do,
    alone or beside a dense push. Each row push is held at the ps until the next step
    looked its rows up: without the overlap the step that made it would wait for it
    forever (the gate times out). The rows follow the one-step-delayed trajectory and
    every key is applied once."""
    from torch import nn

    from clusterflow.strategies.embedding import read_table

    connection = GatedRows()
    s = strategy(connection, max_staleness=1)
    with s.scope():
        table = nn.Embedding(6, 4, sparse=True)
        weight = nn.Linear(4, 1, bias=False) if dense else None
    ids, target = torch.tensor([3]), TARGET
    params = [*table.parameters(), *(weight.parameters() if weight is not None else [])]
    opt = torch.optim.SGD(params, lr=LR)
    start = read_table(table)[3:4].clone()
    first = [True]

    def step() -> None:
        looked = table(ids)  # this step's rows pulled: the previous push may go now
        if first[0]:
            first[0] = False
        else:
            connection.gate.release()
        loss = 0.5 * (looked - target).pow(2).sum()
        if weight is not None:
            loss = loss + 0.5 * (weight.weight - target).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    keys = [SplitKey("ds", 0, k) for k in range(STEPS)]
    for key in keys:
        s.run(step, completes=[key])
    connection.gate.release()  # the last push, which no next step lets through
    settled = s.settled(wait=True)

    w = [start]
    for k in range(STEPS):
        w.append(w[-1] - LR * (w[max(0, k - 1)] - target))
    assert torch.allclose(read_table(table)[3:4], w[-1], atol=1e-6)
    assert connection.staleness == [0] + [1] * (STEPS - 1)
    assert settled.applied == tuple(keys) and not settled.dropped
    assert s.steps == STEPS and s.dropped_pushes == 0
