"""The dense variables and the embedding rows apply pushes by the same rules (``ps/engine.py``).

Each scenario runs the same pushes on a ``VariableStore`` and on a ``RowStore`` and
asserts the same replies and the same counters. Before the engine was one, a scaled
stale row push went uncounted (``scaled_stale``), which the first test pins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from clusterflow.ps.api import PSConfig, PSError
from clusterflow.ps.engine import PushResult
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.rows import RowOptimizerSpec, TableSpec
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore

Push = Callable[..., PushResult]
RULES = (
    "pushes",
    "applied",
    "dropped_stale",
    "scaled_stale",
    "dropped_late",
    "duplicate_keys",
    "dropped_not_member",
)


def _dense(config: PSConfig) -> tuple[VariableStore, Push]:
    store = VariableStore(0)
    store.create(config, [{"name": "w", "shape": [2], "dtype": "float32"}], {"w": torch.zeros(2)})
    store.set_optimizer(OptimizerSpec("SGD", ({"lr": 1.0},)), {"w": 0})

    def push(worker: str, version: int, keys: list[Any] = (), **kw: Any) -> PushResult:  # type: ignore[assignment]
        grads = {"w": torch.ones(2)}
        return store.push(worker=worker, version=version, grads=grads, keys=keys, commit=True, **kw)

    return store, push


def _rows(config: PSConfig) -> tuple[RowStore, Push]:
    store = RowStore(0)
    store.create(config, [TableSpec(name="t", rows=4, dim=2, num_shards=1, init="zeros")])
    store.set_optimizer({"t": RowOptimizerSpec(name="SGD", hyper={"lr": 1.0})})

    def push(worker: str, version: int, keys: list[Any] = (), **kw: Any) -> PushResult:  # type: ignore[assignment]
        grads = {"t": (torch.tensor([1]), torch.ones(1, 2))}
        return store.push(worker=worker, version=version, grads=grads, keys=keys, **kw)

    return store, push


def _rules(store: VariableStore | RowStore) -> dict[str, int]:
    stats = dict(store.stats)
    stats["pushes"] = stats.pop("pushes", 0) + stats.pop("row_pushes", 0)
    return {rule: stats.get(rule, 0) for rule in RULES}


def _replies(results: list[PushResult]) -> list[tuple[bool, int, str, int, list[Any]]]:
    return [(r.applied, r.version, r.reason, r.staleness, r.duplicates) for r in results]


def _both(config: PSConfig, scenario: Callable[[Push, Any], list[PushResult]]) -> list[Any]:
    seen = []
    for make in (_dense, _rows):
        store, push = make(config)
        replies = _replies(scenario(push, store))
        seen.append((replies, _rules(store), store.version, store.applied.to_state()))
    assert seen[0] == seen[1]
    return seen[0]


@pytest.mark.parametrize("policy", ["drop", "scale"])
def test_async_staleness_and_duplicates_are_judged_alike(policy: str) -> None:
    config = PSConfig(mode="async", max_staleness=1, stale_policy=policy)  # type: ignore[arg-type]

    def scenario(push: Push, store: Any) -> list[PushResult]:
        return [
            push("w0", 0, [("d", 0, 0)]),
            push("w0", 1, [("d", 0, 1)]),
            push("w1", 0, [("d", 0, 2)]),  # two versions old: past max_staleness
            push("w1", 0, [("d", 0, 0)]),  # a key applied before: refused
        ]

    replies, rules, _, _ = _both(config, scenario)
    stale = replies[2]
    assert stale[2:4] == ("stale" if policy == "drop" else "", 2)
    assert replies[3][:3] == (False, 3 if policy == "scale" else 2, "duplicate")
    assert rules["dropped_stale" if policy == "drop" else "scaled_stale"] == 1
    assert rules["duplicate_keys"] == 1


def test_the_sync_barrier_late_pushes_leaving_and_duplicates_are_judged_alike() -> None:
    config = PSConfig(mode="sync", num_replicas=2)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        out = [push("w0", 0, [("d", 0, 0)]), push("w1", 0, [("d", 0, 1)])]
        out.append(push("w1", 0, [("d", 0, 2)]))  # a step already taken: late
        out.append(push("w0", 1, [("d", 0, 0)]))  # a duplicate: an empty part of step 1
        out.append(push("w1", 1, [("d", 0, 3)]))
        store.leave("w1")  # step 2 no longer waits for w1
        out.append(push("w0", 2, [("d", 0, 4)]))
        return out

    replies, rules, version, applied = _both(config, scenario)
    assert [r[2] for r in replies] == [
        "committed",
        "applied",
        "late",
        "committed",
        "applied",
        "applied",
    ]
    assert replies[3][4] == [("d", 0, 0)]
    assert (version, rules["dropped_late"], rules["applied"]) == (3, 1, 3)
    assert applied == [["d", 0, 2, [3, 4]]]  # split 2 came late and stays unapplied


def test_a_quiesced_store_holds_pushes_alike() -> None:
    config = PSConfig(mode="async")

    def scenario(push: Push, store: Any) -> list[PushResult]:
        assert store.quiesce(1.0) == 0
        with pytest.raises(PSError, match=r"stayed quiesced for 0\.05s"):
            push("w0", 0, timeout=0.05)
        store.resume()
        return [push("w0", 0)]

    replies, rules, _, _ = _both(config, scenario)
    assert replies == [(True, 1, "", 0, [])]
    assert rules["pushes"] == 1  # the held push never entered


def test_a_replica_that_left_and_pushes_again_is_waited_for_again_alike() -> None:
    """A respawned replica takes part again (``admit``: ``_departed.discard``): without
    that, the step after its return would be taken without it, and its push dropped
    as late, its records lost."""
    config = PSConfig(mode="sync", num_replicas=2)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        store.leave("w1")
        out = [push("w0", 0)]  # w1 left: step 0 is w0's alone
        out += [push("w1", 1), push("w0", 1)]  # w1 came back: step 1 takes both
        out.append(push("w0", 2))  # and step 2 waits for w1 again
        return out

    replies, rules, version, _ = _both(config, scenario)
    assert [r[2] for r in replies] == ["applied", "committed", "applied", "committed"]
    assert (version, rules["dropped_late"]) == (2, 0)


def _save(store: VariableStore | RowStore) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if isinstance(store, VariableStore):
        return store.state()
    meta: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    store.add_state(meta, tensors)
    return meta, tensors


def test_a_restored_store_forgets_the_parts_buffered_before_alike() -> None:
    """A checkpoint restore drops buffered sync parts (``ApplyEngine.restore``): the
    replicas push their step again after a restore, and a part from before it must not
    make up a step with them (its split would count twice)."""
    config = PSConfig(mode="sync", num_replicas=2)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        saved = _save(store)
        out = [push("w0", 0, [("d", 0, 0)])]  # buffered, then the cluster restores
        store.load_state(*saved)
        out.append(push("w1", 0, [("d", 0, 1)]))  # waits for w0's new push
        out.append(push("w0", 0, [("d", 0, 0)]))
        return out

    replies, _, version, applied = _both(config, scenario)
    assert [r[2] for r in replies] == ["committed", "committed", "applied"]
    assert (version, applied) == (1, [["d", 0, 2, []]])


# Membership: an elastic cluster's sync steps (issue 32) ----------------------------------


def test_the_quorum_follows_the_membership_from_the_next_step_alike() -> None:
    """``ps.members`` at step 0 (of 2 replicas) names 3: step 0 still takes the 2 it
    began with and refuses the newcomer's push (``not_member``: not counted, its key
    unapplied); step 1 waits for all 3. A late push is still dropped, a duplicate still
    joins as an empty part. A shrink to 2 at step 2 takes effect at step 3, and
    ``leave`` stops step 2 waiting for the one that left."""
    config = PSConfig(mode="sync", num_replicas=2)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        out = [push("w0", 0, [("d", 0, 0)])]
        # the step after this one; step 0 was counted by number: w0 and w1 by name
        assert store.members(["w0", "w1", "w2"], None, ["w0", "w1"]) == 1
        out.append(push("w2", 0, [("d", 0, 9)]))  # the newcomer, a step early: refused
        out.append(push("w1", 0, [("d", 0, 1)]))  # step 0 is w0's and w1's
        out += [push("w0", 1, [("d", 0, 2)]), push("w1", 1, [("d", 0, 3)])]
        out.append(push("w2", 1, [("d", 0, 9)]))  # step 1 waited for the newcomer
        out.append(push("w2", 0, [("d", 0, 8)]))  # late, as before
        out.append(push("w0", 2, [("d", 0, 0)]))  # a duplicate: an empty part of step 2
        assert store.members(["w0", "w1"], 2) == 3  # step 2 is being collected: from 3
        store.leave("w2")  # step 2 no longer waits for w2
        out.append(push("w1", 2, [("d", 0, 4)]))
        out += [push("w0", 3, [("d", 0, 5)]), push("w1", 3, [("d", 0, 6)])]
        return out

    replies, rules, version, applied = _both(config, scenario)
    assert [r[2] for r in replies] == [
        "committed",
        "not_member",
        "applied",
        "committed",
        "committed",
        "applied",
        "late",
        "committed",
        "applied",
        "committed",
        "applied",
    ]
    assert replies[1][:2] == (False, 0) and replies[7][4] == [("d", 0, 0)]
    assert (version, rules["applied"], rules["dropped_not_member"]) == (4, 4, 1)
    assert rules["dropped_late"] == 1
    # splits 0-6 applied, and 9 (the newcomer's, in step 1 only); 8 came late
    assert applied == [["d", 0, 7, [9]]]


def test_no_step_waits_for_a_member_that_left_and_one_that_committed_still_counts_alike() -> None:
    """With the membership known, ``leave`` lowers the quorum of the step being
    collected at once (and completes it if the others committed); a member that
    committed before it left stays in its step."""
    config = PSConfig(mode="sync", num_replicas=3)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        store.members(["w0", "w1", "w2"], None)
        out = [push("w0", 0), push("w1", 0), push("w2", 0)]  # step 0 before the members
        out += [push("w0", 1), push("w1", 1)]
        store.leave("w2")  # w2 never pushed step 1: the step is taken without it
        out.append(push("w0", 2))
        store.leave("w0")  # w0 committed step 2 and left: step 2 still holds it
        out.append(push("w1", 2))
        out.append(push("w1", 3))  # w1 alone from step 3
        return out

    replies, rules, version, _ = _both(config, scenario)
    assert [r[2] for r in replies] == [
        "committed",
        "committed",
        "applied",
        "committed",
        "committed",
        "committed",
        "applied",
        "applied",
    ]
    assert (version, rules["applied"], rules["dropped_late"]) == (4, 4, 0)


def test_a_name_the_membership_adds_back_is_waited_for_again_alike() -> None:
    """``clusterflow scale`` may add ``worker:2`` again after it left: the new task is
    waited for from the step the membership names, not dropped as one that left."""
    config = PSConfig(mode="sync", num_replicas=2)

    def scenario(push: Push, store: Any) -> list[PushResult]:
        store.members(["w0", "w1"], None)
        out = [push("w0", 0), push("w1", 0)]
        store.leave("w1")
        store.members(["w0"], None)
        out.append(push("w0", 1))  # w1 gone: step 1 is w0's
        assert store.members(["w0", "w1"], None) == 3
        out.append(push("w0", 2))  # step 2 began before w1 came back: w0's alone
        out.append(push("w0", 3))  # step 3 waits for the new w1
        out.append(push("w1", 3))
        return out

    replies, _, version, _ = _both(config, scenario)
    assert [r[2] for r in replies] == [
        "committed",
        "applied",
        "applied",
        "applied",
        "committed",
        "applied",
    ]
    assert version == 4


def test_a_ps_told_the_members_takes_a_sync_worker_counting_other_replicas_alike() -> None:
    """``PSConfig.agrees_with``: a newcomer of a grown cluster counts more replicas than
    the first creator did. A sync ps takes it once the manager named the members (the
    cluster resizes), and refuses it otherwise, as before."""
    first, grown = PSConfig(mode="sync", num_replicas=2), PSConfig(mode="sync", num_replicas=4)
    assert not first.agrees_with(grown)
    assert first.agrees_with(grown, resizable=True)
    assert not first.agrees_with(PSConfig(mode="async", num_replicas=4), resizable=True)
    assert not first.agrees_with(replace(grown, backup_workers=1), resizable=True)
    dense, _ = _dense(first)
    rows, _ = _rows(first)
    var = [{"name": "w", "shape": [2], "dtype": "float32"}]
    table = [TableSpec(name="t", rows=4, dim=2, num_shards=1, init="zeros")]
    with pytest.raises(PSError, match="every worker must build the same strategy"):
        dense.create(grown, var, {"w": torch.zeros(2)})
    with pytest.raises(PSError, match="a worker asked for"):
        rows.create(grown, table)
    for store in (dense, rows):
        store.members(["w0", "w1", "w2", "w3"], None)
    assert dense.create(grown, var, {"w": torch.zeros(2)}) == []
    assert rows.create(grown, table) == []
