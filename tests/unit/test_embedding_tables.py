"""Embedding tables on the ps (issue 21): sparse training equals dense training.

In one process, over in-process ps shards (the same ``PSHandler`` the RPC service
runs): a model with an ``nn.EmbeddingBag`` and an ``nn.Embedding`` built in a sync
``ParameterServerStrategy`` scope trains on the same batches as the same model built
plainly, with torch's own optimizers; the tables and the dense layers agree to 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from clusterflow.errors import ConfigError
from clusterflow.ps.api import PSConfig, PushRejected
from clusterflow.ps.handler import PSHandler
from clusterflow.ps.protocol import (
    ApplyRequest,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
)
from clusterflow.ps.rows import RowOptimizerSpec, TableIndexError, TableSpec
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore, join_tables
from clusterflow.strategies.embedding import read_table, table_modules
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.strategies.resolver import SimpleClusterResolver

T = TypeVar("T")
TOLERANCE = 1e-5


class LocalShards:
    """``num_ps`` in-process ps tasks: a ``PSConnection`` without sockets."""

    def __init__(self, num_ps: int) -> None:
        self.handlers = [
            PSHandler(VariableStore(i), self._fan_out if num_ps > 1 else None)
            for i in range(num_ps)
        ]

    def _fan_out(self, request: ApplyRequest) -> None:
        for handler in self.handlers[1:]:
            handler.apply(request)

    @property
    def num_ps(self) -> int:
        return len(self.handlers)

    def call(
        self, index: int, method: str, body: Any = None, tensors: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        return self.handlers[index].dispatch(method, body, tensors or {})

    def pull(self, index: int, request: PullRequest) -> PullReply:
        return self.handlers[index].pull(request)

    def push(self, index: int, request: PushRequest) -> PushReply:
        return self.handlers[index].push(request)

    def map(self, fn: Callable[[int], T], indices: Sequence[int]) -> list[T]:
        return [fn(i) for i in indices]

    def close(self) -> None:
        pass


class Ranker(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(97, 8, mode="mean", sparse=sparse)
        self.item = nn.Embedding(61, 8, padding_idx=0, sparse=sparse)
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, bag: torch.Tensor, offsets: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.bag(bag, offsets), self.item(item)], 1)
        return self.head(x).squeeze(1)


def _batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 5, (16,), generator=gen)
        bag = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)  # hot, repeated ids
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        item = torch.randint(0, 61, (16,), generator=gen)
        target = torch.rand(16, generator=gen)
        out.append((bag, offsets, item, target))
    return out


def _strategy(num_ps: int, **options: Any) -> ParameterServerStrategy:
    resolver = SimpleClusterResolver({"chief": ["127.0.0.1:1"]}, task_type="chief", task_id=0)
    options.setdefault("mode", "sync")
    return ParameterServerStrategy(resolver, _connection=LocalShards(num_ps), **options)


def _optimizers(name: str, model: nn.Module, reference: bool) -> list[torch.optim.Optimizer]:
    if name == "SGD":
        return [torch.optim.SGD(model.parameters(), lr=0.3)]
    if name == "Adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.3, initial_accumulator_value=0.1)]
    if not reference:
        return [torch.optim.Adam(model.parameters(), lr=0.05)]
    tables = [*model.bag.parameters(), *model.item.parameters()]  # type: ignore[union-attr]
    return [
        torch.optim.SparseAdam(tables, lr=0.05),
        torch.optim.Adam(model.head.parameters(), lr=0.05),  # type: ignore[union-attr]
    ]


@pytest.mark.parametrize(
    ("optimizer", "num_ps", "sharding"),
    [("SGD", 2, "hash"), ("Adagrad", 3, "range"), ("Adam", 2, "hash"), ("Adam", 1, "range")],
)
def test_sparse_training_equals_dense_training(optimizer: str, num_ps: int, sharding: str) -> None:
    strategy = _strategy(num_ps, table_sharding=sharding)
    with strategy.scope():
        model = Ranker(sparse=optimizer == "Adam")
    assert [m.weight.is_meta for m in table_modules(model)] == [True, True]  # never built whole
    reference = Ranker(sparse=optimizer == "Adam")
    with torch.no_grad():
        reference.head.load_state_dict(model.head.state_dict())
        reference.bag.weight.copy_(read_table(model.bag))
        reference.item.weight.copy_(read_table(model.item))
    (opt,) = _optimizers(optimizer, model, reference=False)
    ref_opts = _optimizers(optimizer, reference, reference=True)

    def step(
        bag: torch.Tensor, offsets: torch.Tensor, item: torch.Tensor, y: torch.Tensor
    ) -> float:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(bag, offsets, item), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    for bag, offsets, item, y in _batches(8):
        loss = strategy.run(step, (bag, offsets, item, y))
        for o in ref_opts:
            o.zero_grad()
        ref_loss = nn.functional.mse_loss(reference(bag, offsets, item), y)
        ref_loss.backward()
        for o in ref_opts:
            o.step()
        assert abs(loss - float(ref_loss.detach())) < TOLERANCE
    strategy.pull_values()
    torch.testing.assert_close(read_table(model.bag), reference.bag.weight, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(
        read_table(model.item), reference.item.weight, atol=TOLERANCE, rtol=0
    )
    for (name, mine), theirs in zip(
        model.head.state_dict().items(), reference.head.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=TOLERANCE, rtol=0, msg=name)
    assert float(read_table(model.item)[0].abs().sum()) == 0.0  # padding_idx stays zero
    strategy.close()


def test_dense_allreduce_in_one_process_trains_tables_and_keeps_dense_local() -> None:
    strategy = _strategy(2, dense="allreduce")
    with strategy.scope():
        model = Ranker(sparse=True)
    assert not strategy.unplaced(model)
    assert strategy.variables() == []  # nothing dense on the ps
    opt = torch.optim.Adagrad(model.parameters(), lr=0.5)
    before = model.head[0].weight.detach().clone()
    table_before = read_table(model.bag).clone()

    def step(bag: torch.Tensor, offsets: torch.Tensor, item: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(bag, offsets, item), y).backward()
        opt.step()

    for batch in _batches(3):
        strategy.run(step, batch)
    assert not torch.equal(before, model.head[0].weight)  # the local optimizer applied it
    changed = (read_table(model.bag) != table_before).any(1)
    assert changed[:20].all() and not changed[20:].any()  # only the rows the batches used
    strategy.close()


def test_a_strategy_owns_its_own_tables_not_another_strategys() -> None:
    """Table weights are meta tensors on every strategy: ownership is by identity, so one
    strategy's optimizer-step hook does not take another's table optimizer for its own."""
    first, second = _strategy(1), _strategy(1)
    with first.scope():
        mine = Ranker(sparse=False)
    with second.scope():
        theirs = Ranker(sparse=False)
    assert not first.unplaced(mine)
    assert first.unplaced(theirs) == [n for n, _ in theirs.named_parameters()]
    first.close()
    second.close()


def test_an_id_out_of_range_names_table_and_id_and_the_ps_keeps_serving() -> None:
    strategy = _strategy(2)
    with strategy.scope():
        model = Ranker(sparse=False)
    bag = torch.tensor([3, 97])
    with pytest.raises(TableIndexError) as caught:
        model.bag(bag, torch.tensor([0]))
    assert str(caught.value).count("\n") == 0
    assert "97" in str(caught.value) and "EmbeddingBag.weight" in str(caught.value)
    # A client that skips the check: the ps refuses it in one line and keeps serving.
    handler = strategy._ps.handlers[1]  # type: ignore[attr-defined]
    name = next(iter(handler.tables.tables))
    with pytest.raises(TableIndexError, match="id 1001 is out of range"):
        handler.dispatch("rows_pull", {}, {f"i/{name}": torch.tensor([1001])})
    _, rows = handler.dispatch("rows_pull", {}, {f"i/{name}": torch.tensor([1, 3])})
    assert rows[f"r/{name}"].shape == (2, 8)
    strategy.close()


def _store(mode: str = "async", replicas: int = 1) -> RowStore:
    store = RowStore(0)
    spec = TableSpec(name="t", rows=10, dim=2, num_shards=1, init="zeros")
    store.create(PSConfig(mode=mode, num_replicas=replicas), [spec])  # type: ignore[arg-type]
    store.set_optimizer({"t": RowOptimizerSpec(name="SGD", hyper={"lr": 1.0})})
    return store


def test_a_split_key_moves_rows_once_and_rows_are_coalesced() -> None:
    store = _store()
    ids, grads = torch.tensor([4, 2, 4]), -torch.ones(3, 2)
    first = store.push(worker="w0", version=0, grads={"t": (ids, grads)}, keys=[("d", 0, 7)])
    again = store.push(worker="w1", version=1, grads={"t": (ids, grads)}, keys=[("d", 0, 7)])
    assert first.applied and not again.applied and again.duplicates == [("d", 0, 7)]
    _, rows = store.pull({"t": torch.tensor([2, 4, 5])})
    assert rows["t"][:, 0].tolist() == [1.0, 2.0, 0.0]  # id 4 twice in one push: summed
    with pytest.raises(PushRejected, match="NaN"):
        store.push(worker="w0", version=1, grads={"t": (ids, torch.full((3, 2), float("nan")))})


def test_sync_rows_wait_for_every_replica_and_average() -> None:
    store = _store("sync", replicas=2)
    grads = {"t": (torch.tensor([1]), -torch.ones(1, 2))}
    first = store.push(worker="a", version=0, grads=grads)
    assert (first.applied, first.reason, store.version) == (True, "committed", 0)  # waits for b
    last = store.push(
        worker="b", version=0, grads={"t": (torch.tensor([1]), -3 * torch.ones(1, 2))}
    )
    assert (last.reason, last.commit, store.version) == (
        "applied",
        {"version": 0, "workers": ["a", "b"]},
        1,
    )
    assert store.pull({"t": torch.tensor([1])})[1]["t"].tolist() == [[2.0, 2.0]]
    store.leave("b")  # the others' steps stop waiting for a replica that left
    store.push(worker="a", version=1, grads=grads)
    assert store.version == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_with_one_applied_key_beside_new_ones_moves_no_row(mode: str) -> None:
    """Pins ``RowStore.push``: ``if duplicates: ... checked, keyed = {}, []`` (sync) and
    the refusal (async). A push naming a split applied before beside new splits moves
    no row and marks none of its new keys applied (their splits go through again,
    alone); applying it anyway, or only its new keys, fails here."""
    store = _store(mode)
    old, new = ("d", 0, 1), ("d", 0, 2)
    ids = torch.tensor([3])
    store.push(worker="w0", version=0, grads={"t": (ids, -torch.ones(1, 2))}, keys=[old])
    assert store.version == 1
    before = store.pull({"t": ids})[1]["t"].clone()
    mixed = store.push(
        worker="w0", version=1, grads={"t": (ids, -5 * torch.ones(1, 2))}, keys=[new, old]
    )
    assert mixed.duplicates == [old]
    assert torch.equal(store.pull({"t": ids})[1]["t"], before)
    assert new not in store.applied and old in store.applied
    again = store.push(
        worker="w0", version=store.version, grads={"t": (ids, -torch.ones(1, 2))}, keys=[new]
    )
    assert again.applied and new in store.applied
    assert store.pull({"t": ids})[1]["t"].tolist() == [[2.0, 2.0]]


def test_a_sync_step_of_tables_alone_gives_back_the_new_keys_of_a_mixed_push() -> None:
    """Pins ``RowStore.push``'s ``result.duplicates = duplicates`` where it matters: with
    tables alone, ps 0's rows reply decides the step's keys (``KeyLedger.sync_reply``).
    A step completing a split applied before and a new one moves no row, reports the
    old key applied and gives the new one back (its records are read again). Without
    the duplicates in the reply the new key came back applied, to be acked although
    nothing of it was applied: its records lost."""
    from clusterflow.data.api import SplitKey

    strategy = _strategy(1)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.tensor([2, 5])

    def step() -> None:
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()

    old, new = SplitKey("d", 0, 1), SplitKey("d", 0, 2)
    strategy.run(step, completes=[old])
    assert strategy.settled(wait=True).applied == (old,)
    before = read_table(model).clone()
    strategy.run(step, completes=[new, old])
    settled = strategy.settled(wait=True)
    assert settled.applied == (old,) and settled.dropped == (new,), settled
    assert torch.equal(read_table(model), before)
    strategy.close()


def test_checkpoint_state_round_trips_and_shards_join_into_one_table() -> None:
    specs = [TableSpec(name="t", rows=11, dim=3, num_shards=2, sharding="hash")]
    stores = [RowStore(i) for i in range(2)]
    for store in stores:
        store.create(PSConfig(), specs)
        store.set_optimizer(
            {
                "t": RowOptimizerSpec(
                    name="Adam", hyper={"lr": 0.1, "eps": 1e-8, "betas": [0.9, 0.99]}
                )
            }
        )
    stores[1].push(
        worker="w",
        version=0,
        grads={"t": (torch.tensor([1, 5]), torch.ones(2, 3))},
        keys=[("d", 0, 1)],
    )
    parts = []
    for store in stores:
        meta: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        store.add_state(meta, tensors)
        parts.append((meta, tensors))
    whole = join_tables(parts)["t"]
    assert whole.shape == (11, 3)
    for store in stores:
        ids, rows = store.read_rows("t")
        torch.testing.assert_close(whole[ids], rows)
    # A ps started outside a cluster knows no index: the worker's create names its shard.
    local = RowStore(0)
    local.create(PSConfig(), specs, shard=1)
    assert local.read_rows("t")[0].tolist() == [1, 3, 5, 7, 9]
    restored = RowStore(1)
    restored.load_state(*parts[1])
    assert restored.version == 1 and ("d", 0, 1) in restored.applied
    step = {"t": (torch.tensor([5]), torch.ones(1, 3))}
    stores[1].push(worker="w", version=1, grads=step)
    restored.push(worker="w", version=1, grads=step)  # the same Adam state and step count
    torch.testing.assert_close(restored.read_rows("t")[1], stores[1].read_rows("t")[1])


@pytest.mark.parametrize("dense", ["ps", "allreduce"])
def test_a_checkpoint_restores_rows_and_state_and_load_module_joins_the_shards(
    tmp_path: Path, dense: str
) -> None:
    from clusterflow.train.cut import Checkpointer, load_module

    def train(strategy: ParameterServerStrategy, model: Ranker, batches: list[Any]) -> None:
        opt = torch.optim.Adam(model.parameters(), lr=0.05)

        def step(
            bag: torch.Tensor, offsets: torch.Tensor, item: torch.Tensor, y: torch.Tensor
        ) -> None:
            opt.zero_grad()
            nn.functional.mse_loss(model(bag, offsets, item), y).backward()
            opt.step()

        for batch in batches:
            strategy.run(step, batch)

    batches = _batches(6)
    strategy = _strategy(2, dense=dense)
    with strategy.scope():
        model = Ranker(sparse=False)
    train(strategy, model, batches[:3])
    Checkpointer(strategy, model=model, directory=str(tmp_path)).save(3)
    train(strategy, model, batches[3:])
    strategy.pull_values()
    expected = read_table(model.bag), read_table(model.item), model.head.state_dict()

    again = _strategy(2, dense=dense)
    with again.scope():
        resumed = Ranker(sparse=False)
    assert Checkpointer(again, model=resumed, directory=str(tmp_path)).restore() == 3
    train(again, resumed, batches[3:])  # the same steps from the restored rows and slots
    again.pull_values()
    torch.testing.assert_close(read_table(resumed.bag), expected[0], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(read_table(resumed.item), expected[1], atol=TOLERANCE, rtol=0)
    for mine, theirs in zip(resumed.head.state_dict().values(), expected[2].values(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=TOLERANCE, rtol=0)

    loaded = load_module(str(tmp_path), lambda: Ranker(sparse=False))
    assert loaded is not None and loaded[1] == 3
    plain = loaded[0]
    assert type(plain.bag) is nn.EmbeddingBag and not plain.bag.weight.is_meta
    restored_rows = _strategy(2, dense=dense)
    with restored_rows.scope():
        third = Ranker(sparse=False)
    Checkpointer(restored_rows, model=third, directory=str(tmp_path)).restore()
    torch.testing.assert_close(plain.bag.weight, read_table(third.bag))
    torch.testing.assert_close(plain.item.weight, read_table(third.item))
    for strat in (strategy, again, restored_rows):
        strat.close()


def test_the_row_cache_serves_hot_rows_at_most_its_staleness_old() -> None:
    """The cache alone: without ``overlap_push`` every push is applied before the next
    step pulls, so which step reads what is exact (with it, a pull may also miss the one
    push in flight: ``test_ps_overlap.py`` pins that)."""
    strategy = _strategy(2, mode="async", row_cache_steps=2, row_cache_rows=64, overlap_push=False)
    with strategy.scope():
        model = Ranker(sparse=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tables = strategy._sparse.tables
    assert tables is not None
    bag, offsets = torch.tensor([1, 2, 3]), torch.tensor([0])
    seen = []

    def step() -> None:
        opt.zero_grad()
        out = model.bag(bag, offsets)
        seen.append(out.detach().clone())
        out.sum().backward()
        opt.step()

    for _ in range(5):
        strategy.run(step)
    # Steps 0-2 read the rows cached at step 0 (stale by up to 2 steps); step 3 pulls
    # again and sees the three updates applied meanwhile; step 4 reads that cache.
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[0], seen[2])
    assert not torch.equal(seen[2], seen[3]) and torch.equal(seen[3], seen[4])
    assert tables.stats.cache_hits == 9 and tables.stats.rows_pulled == 6
    # Each step moves each of the three rows by -0.5 / 3 (the mean's gradient, lr 0.5).
    torch.testing.assert_close(seen[3], seen[0] - 0.5)
    strategy.close()


def test_stale_row_pushes_are_dropped_or_scaled_as_dense_ones() -> None:
    grads = {"t": (torch.tensor([1]), -torch.ones(1, 2))}
    for policy, expected in (("drop", 1.0), ("scale", 1.5)):
        store = RowStore(0)
        spec = TableSpec(name="t", rows=10, dim=2, num_shards=1, init="zeros")
        config = PSConfig(max_staleness=1, stale_policy=policy)  # type: ignore[arg-type]
        store.create(config, [spec])
        store.set_optimizer({"t": RowOptimizerSpec(name="SGD", hyper={"lr": 1.0})})
        for version in range(2):
            assert store.push(worker="fast", version=version, grads=grads).applied
        late = store.push(worker="slow", version=0, grads=grads)  # 2 steps behind
        assert late.staleness == 2 and late.applied == (policy == "scale")
        assert store.pull({"t": torch.tensor([1])})[1]["t"][0, 0] == 2.0 + expected - 1.0


def test_a_row_push_exactly_max_staleness_old_is_applied_one_more_is_dropped() -> None:
    """The tables decide staleness as the dense store does (``PSConfig.too_stale``): a
    push exactly ``max_staleness`` versions old is applied, one more is stale."""
    grads = {"t": (torch.tensor([1]), -torch.ones(1, 2))}
    store = RowStore(0)
    spec = TableSpec(name="t", rows=10, dim=2, num_shards=1, init="zeros")
    store.create(PSConfig(max_staleness=2, stale_policy="drop"), [spec])
    store.set_optimizer({"t": RowOptimizerSpec(name="SGD", hyper={"lr": 1.0})})
    for version in range(2):
        assert store.push(worker="fast", version=version, grads=grads).applied
    at_bound = store.push(worker="slow", version=0, grads=grads)
    assert (at_bound.staleness, at_bound.applied) == (2, True)
    past = store.push(worker="slow", version=0, grads=grads)
    assert (past.staleness, past.applied) == (3, False)
    assert store.pull({"t": torch.tensor([1])})[1]["t"][0, 0] == 3.0  # three applied


def test_warmup_with_no_dense_variable_on_the_ps_is_refused_in_one_line() -> None:
    strategy = _strategy(1, mode="async", dense="allreduce", warmup_steps=3)
    with pytest.raises(ConfigError, match="warmup_steps"), strategy.scope():
        Ranker(sparse=False)
    strategy.close()
