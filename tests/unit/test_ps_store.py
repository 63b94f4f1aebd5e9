"""The rules of a ps task's store: sync steps, backups, staleness, leases, bad pushes."""

from __future__ import annotations

import threading

import pytest
import torch

from clusterflow.errors import ConfigError
from clusterflow.ps.api import PSConfig, PSError, PushRejected, VersionTimeout
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.store import VariableStore


def make_store(config: PSConfig, optimizer: str = "SGD", **hyper: object) -> VariableStore:
    store = VariableStore(0)
    decl = [
        {"name": "w", "shape": [4, 3], "dtype": "float32"},
        {"name": "b", "shape": [3], "dtype": "float32"},
        {"name": "count", "shape": [], "dtype": "int64", "trainable": False},
    ]
    values = {"w": torch.ones(4, 3), "b": torch.zeros(3), "count": torch.tensor(0)}
    store.create(config, decl, values)
    groups = ({"lr": 0.1, **hyper},)
    store.set_optimizer(OptimizerSpec(optimizer, groups), {"w": 0, "b": 0})
    return store


def grads(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), value), "b": torch.full((3,), value)}


def test_create_keeps_the_first_value_and_rejects_redeclaration() -> None:
    store = make_store(PSConfig())
    again = store.create(
        PSConfig(), [{"name": "w", "shape": [4, 3], "dtype": "float32"}], {"w": torch.zeros(4, 3)}
    )
    assert again == []
    assert torch.equal(store.vars["w"], torch.ones(4, 3))
    with pytest.raises(PSError, match="'w'"):
        store.create(
            PSConfig(), [{"name": "w", "shape": [5], "dtype": "float32"}], {"w": torch.zeros(5)}
        )
    with pytest.raises(PSError, match="every worker must build the same strategy"):
        store.create(PSConfig(mode="sync"), [], {})


def test_async_applies_each_push_on_arrival() -> None:
    store = make_store(PSConfig())
    result = store.push(worker="worker:0", version=0, grads=grads(1.0), want_values=True)
    assert result.applied and result.version == 1
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 0.9))
    assert torch.allclose(result.values["w"], store.vars["w"])
    store.push(worker="worker:1", version=0, grads=grads(1.0))
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 0.8))


def test_sync_step_averages_n_replicas_once() -> None:
    store = make_store(PSConfig(mode="sync", num_replicas=2))
    first = store.push(worker="worker:0", version=0, grads=grads(1.0), commit=True)
    assert first.applied and store.version == 0  # waiting for the second replica
    second = store.push(worker="worker:1", version=0, grads=grads(3.0), commit=True)
    assert second.commit == {"version": 0, "workers": ["worker:0", "worker:1"]}
    assert store.version == 1
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 1.0 - 0.1 * 2.0))


def test_a_replica_that_commits_then_leaves_still_waits_for_the_others() -> None:
    # Its data ran out after its last push: the step it joined still takes the push of
    # the replica that trains on, rather than dropping it as late (its data lost).
    store = make_store(PSConfig(mode="sync", num_replicas=2))
    store.push(worker="worker:1", version=0, grads=grads(3.0), commit=True)
    assert store.leave("worker:1") is None and store.version == 0  # still waiting
    last = store.push(worker="worker:0", version=0, grads=grads(1.0), commit=True)
    assert last.applied and last.commit == {"version": 0, "workers": ["worker:1", "worker:0"]}
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 1.0 - 0.1 * 2.0))
    # From then on the one replica left makes each step alone.
    assert store.push(worker="worker:0", version=1, grads=grads(1.0), commit=True).commit
    assert store.version == 2


def test_a_replica_that_leaves_before_committing_no_longer_holds_a_step() -> None:
    store = make_store(PSConfig(mode="sync", num_replicas=2))
    store.push(worker="worker:0", version=0, grads=grads(1.0), commit=True)
    assert store.leave("worker:1") == {"version": 0, "workers": ["worker:0"]}
    assert store.version == 1


def test_backup_worker_push_is_dropped_and_counted() -> None:
    store = make_store(PSConfig(mode="sync", num_replicas=3, backup_workers=1))
    store.push(worker="worker:0", version=0, grads=grads(1.0), commit=True)
    store.push(worker="worker:2", version=0, grads=grads(1.0), commit=True)
    assert store.version == 1  # two of three made the step; nobody waited for worker:1
    late = store.push(worker="worker:1", version=0, grads=grads(100.0), commit=True)
    assert not late.applied and late.reason == "late"
    assert store.snapshot_stats()["dropped_late"] == 1
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 0.9))


def test_sync_fan_out_applies_the_chosen_replicas_on_other_shards() -> None:
    shard = make_store(PSConfig(mode="sync", num_replicas=3, backup_workers=1))
    for worker, value in (("worker:0", 1.0), ("worker:1", 50.0), ("worker:2", 3.0)):
        shard.push(worker=worker, version=0, grads=grads(value))  # buffered, no commit
    shard.apply_sync(0, ["worker:0", "worker:2"])  # ps 0 decided: worker:1 was late
    assert shard.version == 1
    assert torch.allclose(shard.vars["w"], torch.full((4, 3), 1.0 - 0.1 * 2.0))
    assert shard.apply_sync(0, ["worker:0", "worker:2"]) == 1  # a retried fan-out is a no-op
    shard.push(worker="worker:9", version=1, grads=grads(1.0))
    with pytest.raises(PSError, match=r"\['worker:8'\]"):
        shard.apply_sync(1, ["worker:9", "worker:8"])  # worker:8 never pushed here


@pytest.mark.parametrize("policy", ["drop", "scale"])
def test_max_staleness_drops_or_scales(policy: str) -> None:
    store = make_store(PSConfig(max_staleness=1, stale_policy=policy))  # type: ignore[arg-type]
    for _ in range(3):
        store.push(worker="worker:0", version=store.version, grads=grads(1.0))
    before = store.vars["w"].clone()
    result = store.push(worker="worker:1", version=0, grads=grads(1.0))
    assert result.staleness == 3
    if policy == "drop":
        assert not result.applied and result.reason == "stale"
        assert torch.equal(store.vars["w"], before)
        assert store.snapshot_stats()["dropped_stale"] == 1
    else:
        assert result.applied
        assert torch.allclose(store.vars["w"], before - 0.1 / 3)


@pytest.mark.parametrize("policy", ["drop", "scale"])
def test_a_push_exactly_max_staleness_old_is_applied_as_is_one_more_is_stale(
    policy: str,
) -> None:
    """The boundary ``PSConfig.max_staleness`` documents: ``too_stale`` is ``staleness >
    max_staleness``, so a push exactly that many versions old is applied at full lr."""
    store = make_store(PSConfig(max_staleness=2, stale_policy=policy))  # type: ignore[arg-type]
    for _ in range(2):
        store.push(worker="worker:0", version=store.version, grads=grads(1.0))
    before = store.vars["w"].clone()
    at_bound = store.push(worker="worker:1", version=0, grads=grads(1.0))
    assert (at_bound.staleness, at_bound.applied, at_bound.reason) == (2, True, "")
    assert torch.equal(store.vars["w"], before - 0.1)  # not scaled: it is not stale
    before = store.vars["w"].clone()
    past = store.push(worker="worker:1", version=0, grads=grads(1.0))
    assert past.staleness == 3
    if policy == "drop":
        assert (past.applied, past.reason) == (False, "stale")
        assert torch.equal(store.vars["w"], before)
    else:
        assert past.applied
        assert torch.allclose(store.vars["w"], before - 0.1 / 3)
    stats = store.snapshot_stats()
    assert (stats.get("dropped_stale", 0), stats.get("scaled_stale", 0)) == (
        (1, 0) if policy == "drop" else (0, 1)
    )


def test_staleness_aware_learning_rate() -> None:
    store = make_store(PSConfig(staleness_aware_lr=True))
    store.push(worker="worker:0", version=0, grads=grads(1.0))
    store.push(worker="worker:0", version=1, grads=grads(1.0))
    before = store.vars["b"].clone()
    store.push(worker="worker:1", version=0, grads=grads(1.0))  # staleness 2
    assert torch.allclose(store.vars["b"], before - 0.1 / 2)


def test_a_split_key_is_applied_at_most_once() -> None:
    store = make_store(PSConfig())
    key = ("ds", 0, 7)
    assert store.push(worker="worker:0", version=0, grads=grads(1.0), keys=[key]).applied
    again = store.push(worker="worker:1", version=1, grads=grads(1.0), keys=[key])
    assert not again.applied and again.reason == "duplicate"
    assert again.duplicates == [key] and store.version == 1


def test_a_push_with_one_applied_key_names_it_and_applies_nothing() -> None:
    store = make_store(PSConfig())
    store.push(worker="worker:0", version=0, grads=grads(1.0), keys=[("ds", 0, 1)])
    before = store.vars["w"].clone()
    mixed = store.push(
        worker="worker:0", version=1, grads=grads(1.0), keys=[("ds", 0, 2), ("ds", 0, 1)]
    )
    assert not mixed.applied and mixed.duplicates == [("ds", 0, 1)]
    assert torch.equal(store.vars["w"], before)
    # The other key was not applied: it goes through alone.
    assert store.push(worker="worker:0", version=1, grads=grads(1.0), keys=[("ds", 0, 2)]).applied


def test_a_sync_duplicate_joins_the_step_empty_so_no_step_waits_for_it() -> None:
    store = make_store(PSConfig(mode="sync", num_replicas=2))
    key = ("ds", 0, 3)
    store.push(worker="worker:0", version=0, grads=grads(1.0), keys=[key], commit=True)
    store.push(worker="worker:1", version=0, grads=grads(1.0), commit=True)
    assert store.version == 1
    before = store.vars["b"].clone()
    # worker:0 replays its split (it died before acking); worker:1 pushes a new one.
    dup = store.push(worker="worker:0", version=1, grads=grads(5.0), keys=[key], commit=True)
    assert dup.duplicates == [key]
    store.push(worker="worker:1", version=1, grads=grads(1.0), commit=True)
    assert store.version == 2  # the step did not wait for another push of worker:0
    # Only worker:1's gradient, averaged over the step's two parts: b -= 0.1 * 1 / 2.
    assert torch.allclose(store.vars["b"], before - 0.05)


def test_a_sync_push_with_one_applied_key_beside_new_ones_is_refused_whole() -> None:
    """Pins ``VariableStore.push``'s sync branch ``if duplicates: checked, keyed = {}, []``.

    A batch that spans several splits carries several keys; a replayed split beside new
    ones must not apply the push's gradients (they hold the replayed split's records a
    second time), and the new keys must stay unapplied, so their splits are handed out
    again and go through alone. Applying the push anyway, or marking only the new keys
    applied, fails here."""
    store = make_store(PSConfig(mode="sync", num_replicas=1))
    old, new = ("ds", 0, 1), ("ds", 0, 2)
    store.push(worker="worker:0", version=0, grads=grads(1.0), keys=[old], commit=True)
    assert store.version == 1
    before = {n: t.clone() for n, t in store.vars.items()}
    mixed = store.push(worker="worker:0", version=1, grads=grads(5.0), keys=[new, old], commit=True)
    assert mixed.duplicates == [old]
    assert store.version == 2  # the step did not wait for it: it joined empty
    for name, value in before.items():
        assert torch.equal(store.vars[name], value), name
    assert new not in store.applied and old in store.applied
    # The new split, pushed again alone (the data service lent it again), applies once.
    store.push(worker="worker:0", version=2, grads=grads(1.0), keys=[new], commit=True)
    assert new in store.applied
    assert torch.allclose(store.vars["b"], before["b"] - 0.1)


def test_applied_keys_of_a_whole_epoch_collapse_to_one_number() -> None:
    from clusterflow.ps.applied import AppliedKeys

    keys = AppliedKeys()
    order = [5, 0, 3, 1, 4, 2]
    keys.add([("ds", 1, s) for s in order[:3]])
    assert ("ds", 1, 3) in keys and ("ds", 1, 1) not in keys
    keys.add([("ds", 1, s) for s in order[3:]])
    assert keys.to_state() == [["ds", 1, 6, []]]  # bounded: one prefix per epoch
    assert ("ds", 1, 5) in keys and ("ds", 2, 0) not in keys and ("other", 1, 0) not in keys
    again = AppliedKeys.from_state(keys.to_state())
    assert ("ds", 1, 4) in again and len(again) == 6


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"nope": torch.zeros(3)}, "'nope'"),
        ({"w": torch.zeros(3, 4)}, r"\(3, 4\)"),
        ({"w": torch.zeros(4, 3, dtype=torch.int32)}, "int32"),
        ({"w": torch.full((4, 3), float("nan"))}, "NaN"),
        ({"b": torch.tensor([0.0, float("inf"), 0.0])}, "NaN or Inf"),
        ({"count": torch.tensor(1)}, "non-trainable"),
    ],
)
def test_bad_pushes_are_refused_and_the_store_keeps_serving(
    bad: dict[str, torch.Tensor], match: str
) -> None:
    store = make_store(PSConfig())
    before = store.vars["w"].clone()
    with pytest.raises(PushRejected, match=match):
        store.push(worker="worker:0", version=0, grads={"b": torch.ones(3), **bad})
    assert torch.equal(store.vars["w"], before) and store.version == 0
    assert store.push(worker="worker:0", version=0, grads=grads(1.0)).applied


def test_nonfinite_gradients_can_be_allowed() -> None:
    store = make_store(PSConfig(reject_nonfinite=False))
    assert store.push(
        worker="worker:0", version=0, grads={"b": torch.full((3,), float("nan"))}
    ).applied


def test_bf16_gradients_are_widened() -> None:
    store = make_store(PSConfig())
    store.push(worker="worker:0", version=0, grads={"w": torch.ones(4, 3, dtype=torch.bfloat16)})
    assert store.vars["w"].dtype == torch.float32
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 0.9))


def test_quiesce_holds_pushes_until_resume() -> None:
    store = make_store(PSConfig())
    assert store.quiesce() == 0
    done = threading.Event()

    def push() -> None:
        store.push(worker="worker:0", version=0, grads=grads(1.0))
        done.set()

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    assert not done.wait(0.3)  # held: the version cannot move while quiesced
    assert store.version == 0
    store.resume()
    thread.join(10)
    assert done.is_set() and store.version == 1
    with pytest.raises(PSError, match="quiesced"):
        store.quiesce()
        store.push(worker="worker:0", version=1, grads=grads(1.0), timeout=0.2)


def test_state_round_trip_restores_values_slots_and_applied_keys() -> None:
    store = make_store(PSConfig(), "Adam", betas=[0.9, 0.999])
    for i in range(3):
        store.push(worker="worker:0", version=i, grads=grads(float(i + 1)), keys=[("d", 0, i)])
    meta, tensors = store.state()
    restored = VariableStore(0)
    restored.load_state(meta, tensors)
    assert restored.version == 3
    assert restored.applied.applied([("d", 0, i) for i in range(4)]) == [
        ("d", 0, i) for i in range(3)
    ]
    # A restarted ps still refuses a split it applied before the restart.
    assert not restored.push(
        worker="worker:1", version=3, grads=grads(1.0), keys=[("d", 0, 1)]
    ).applied
    for name in ("w", "b", "count"):
        assert torch.equal(restored.vars[name], store.vars[name])
    # Both continue identically: Adam's moments and step counts came back too.
    store.push(worker="worker:0", version=3, grads=grads(0.5))
    restored.push(worker="worker:0", version=3, grads=grads(0.5))
    assert torch.equal(restored.vars["w"], store.vars["w"])


def test_pull_waits_for_a_version() -> None:
    store = make_store(PSConfig())
    with pytest.raises(VersionTimeout, match="version 1 did not come"):
        store.pull(None, min_version=1, timeout=0.1)
    threading.Timer(0.1, lambda: store.push(worker="w", version=0, grads=grads(1.0))).start()
    version, values = store.pull(["w"], min_version=1, timeout=10)
    assert version == 1 and set(values) == {"w"}


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="backup_workers"):
        PSConfig(mode="sync", num_replicas=2, backup_workers=2)
    with pytest.raises(ConfigError, match="needs mode='sync'"):
        PSConfig(num_replicas=3, backup_workers=1)
    with pytest.raises(ConfigError, match="'nope'"):
        PSConfig(mode="nope")  # type: ignore[arg-type]


def test_a_departed_replica_lowers_the_quorum_and_completes_a_waiting_step() -> None:
    store = make_store(PSConfig(mode="sync", num_replicas=3))
    store.push(worker="worker:0", version=0, grads=grads(1.0), commit=True)
    store.push(worker="worker:1", version=0, grads=grads(3.0), commit=True)
    assert store.version == 0  # 2 of 3
    assert store.leave("worker:2") == {"version": 0, "workers": ["worker:0", "worker:1"]}
    assert store.version == 1
    assert torch.allclose(store.vars["w"], torch.full((4, 3), 0.8))
    store.leave("worker:1")
    result = store.push(worker="worker:0", version=1, grads=grads(1.0), commit=True)
    assert result.commit == {"version": 1, "workers": ["worker:0"]}  # alone now
