"""ParameterServerStrategy and CentralStorageStrategy, with replicas as threads on one store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from clusterflow.errors import ConfigError
from clusterflow.ps.local import LocalPS
from clusterflow.ps.placement import MinSizePartitioner
from clusterflow.strategies import SimpleClusterResolver, StrategyError
from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.strategies.variables import Variable, device

STEPS = 5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def resolver(index: int, workers: int) -> Any:
    spec = {"worker": [f"127.0.0.1:{2000 + i}" for i in range(workers)], "ps": ["127.0.0.1:3000"]}
    return SimpleClusterResolver(spec, task_type="worker", task_id=index)


def replicas(workers: int, connection: LocalPS, **options: Any) -> list[ParameterServerStrategy]:
    return [
        ParameterServerStrategy(resolver(i, workers), _connection=connection, **options)
        for i in range(workers)
    ]


def run_threads(fns: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    if errors:
        raise errors[0]


def step_fn(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sync_matches_one_process_on_the_concatenated_batch(optimizer: str) -> None:
    ref = make_model()
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    expected = []
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(2)), strict=True)
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append([p.detach().clone() for p in ref.parameters()])

    connection = LocalPS()
    strategies = replicas(2, connection, mode="sync")
    models, seen = [], [[] for _ in strategies]
    for s in strategies:
        with s.scope():
            model = make_model()
            models.append((model, OPTIMIZERS[optimizer](model.parameters())))

    def replica(i: int) -> Callable[[], None]:
        def go() -> None:
            s, (model, opt) = strategies[i], models[i]
            for step in range(STEPS):
                s.run(step_fn(model, opt), batch(step, i))
                s._load_values()
                seen[i].append([p.detach().clone() for p in model.parameters()])

        return go

    run_threads([replica(0), replica(1)])
    for step in range(STEPS):
        for i in range(2):
            for got, want in zip(seen[i][step], expected[step], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert connection.store.version == STEPS


def test_backup_worker_never_delays_a_step_and_its_push_is_dropped() -> None:
    connection = LocalPS()
    strategies = replicas(3, connection, mode="sync", backup_workers=1)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    store = connection.store

    def replica(i: int, steps: int, slow: bool) -> Callable[[], None]:
        def go() -> None:
            model, opt = models[i]
            inner = step_fn(model, opt)

            def step(x: torch.Tensor, y: torch.Tensor) -> float:
                if slow:  # held until the others made 3 steps: they must not wait for it
                    store.wait_version(3, timeout=30)
                return inner(x, y)

            for step_index in range(steps):
                strategies[i].run(step, batch(step_index, i))

        return go

    run_threads([replica(0, 3, False), replica(1, 3, False), replica(2, 1, True)])
    stats = store.snapshot_stats()
    assert stats["version"] == 3
    assert stats["dropped_late"] == 1
    assert strategies[2].dropped_pushes == 1


@pytest.mark.parametrize("policy", ["drop", "scale"])
def test_async_held_back_worker_is_stale(policy: str) -> None:
    connection = LocalPS()
    strategies = replicas(2, connection, max_staleness=2, stale_policy=policy)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    fast, slow = strategies
    fast_step = step_fn(*models[0])
    slow_model, slow_opt = models[1]
    slow_inner = step_fn(slow_model, slow_opt)

    def held(x: torch.Tensor, y: torch.Tensor) -> float:
        for k in range(4):  # the other worker moves 4 steps on meanwhile
            fast.run(fast_step, batch(k, 0))
        fast.flush()
        return slow_inner(x, y)

    before = [p.detach().clone() for p in connection.store.vars.values()]
    slow.run(held, batch(0, 1))
    slow.flush()
    stats = connection.store.snapshot_stats()
    if policy == "drop":
        assert stats["dropped_stale"] == 1 and stats["version"] == 4
        assert slow.dropped_pushes == 1
    else:
        assert stats["scaled_stale"] == 1 and stats["version"] == 5
    assert any(
        not torch.equal(a, b) for a, b in zip(before, connection.store.vars.values(), strict=True)
    )


def test_async_replicas_train() -> None:
    connection = LocalPS()
    strategies = replicas(2, connection)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
            models.append((model, torch.optim.Adam(model.parameters(), lr=0.02)))
    x, y = batch(0, 0)
    losses: list[list[float]] = [[], []]

    def replica(i: int) -> Callable[[], None]:
        def go() -> None:
            for _ in range(30):
                losses[i].append(strategies[i].run(step_fn(*models[i]), (x, y)))
            strategies[i].flush()

        return go

    run_threads([replica(0), replica(1)])
    assert connection.store.version == 60
    assert losses[0][-1] < losses[0][0] * 0.5


def test_partitioned_variables_and_explicit_devices_and_buffers() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Linear(6, 40)
            self.norm = torch.nn.BatchNorm1d(40)
            with device("/job:ps/task:0"):
                self.head = torch.nn.Linear(40, 3)

    connection = LocalPS()
    s = ParameterServerStrategy(
        resolver(0, 1),
        _connection=connection,
        variable_partitioner=MinSizePartitioner(min_shard_bytes=64, max_shards=3),
    )
    with s.scope():
        torch.manual_seed(0)
        net = Net()
        scale = Variable(torch.ones(3), name="scale")
        opt = torch.optim.SGD([*net.parameters(), scale], lr=0.1)
    names = list(s.placement.shards)
    # emb 2 + norm 5 (weight, bias, running stats, batch count) + head 2 + scale
    assert len(names) == 10 and names[-1] == "v0009.scale"
    assert len(s.placement.shards[names[0]]) == 3  # the 40x6 weight was split in three
    head = [n for n in names if n.startswith(("v0007.", "v0008."))]
    assert all(sh.ps == 0 for n in head for sh in s.placement.shards[n])

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(net.head(net.norm(net.emb(x))) * scale, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    s.run(step, batch(0, 0))
    s.pull_values()
    store = connection.store

    def on_ps(name: str) -> torch.Tensor:
        return torch.cat([store.vars[shard.name] for shard in s.placement.shards[name]])

    assert [sh.name for sh in s.placement.shards[names[0]]] == [
        f"{names[0]}/part_{i}" for i in range(3)
    ]
    assert torch.equal(on_ps(names[0]), net.emb.weight.detach())
    running_mean = next(n for n in names if n.endswith("running_mean"))
    assert torch.equal(on_ps(running_mean), net.norm.running_mean)  # the chief's buffers
    assert not torch.equal(on_ps(running_mean), torch.zeros(40))


def test_central_storage_matches_plain_training_with_a_schedule() -> None:
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5)
    s = CentralStorageStrategy()
    with s.scope():
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for step in range(6):
        step_fn(ref, ref_opt)(*batch(step, 0))
        ref_sched.step()
        s.run(step_fn(model, opt), batch(step, 0))
        sched.step()
    s._load_values()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_misuse_gives_clear_errors() -> None:
    s = CentralStorageStrategy()
    with pytest.raises(StrategyError, match=r"inside strategy.scope\(\)"):
        s.run(lambda: None)
    with s.scope():
        model = make_model()
    with pytest.raises(StrategyError, match=r"did not call optimizer.step\(\)"):
        s.run(lambda: F.cross_entropy(model(batch(0, 0)[0]), batch(0, 0)[1]).backward())
    with pytest.raises(ConfigError, match="LBFGS"):
        s.run(step_fn(model, torch.optim.LBFGS(model.parameters())), batch(0, 0))
    with pytest.raises(ConfigError, match=r"inside strategy\.scope"):
        Variable(torch.zeros(2))
    with pytest.raises(ConfigError, match="names no task"), device("/job:evaluator/task:0"):
        pass
    with pytest.raises(ConfigError, match="wire_dtype"):
        ParameterServerStrategy(resolver(0, 1), _connection=LocalPS(), gradient_wire_dtype="int8")  # type: ignore[arg-type]


def test_bf16_on_the_wire_trains_and_keeps_float32_variables() -> None:
    connection = LocalPS()
    s = ParameterServerStrategy(
        resolver(0, 1),
        _connection=connection,
        gradient_wire_dtype="bfloat16",
        value_wire_dtype="bfloat16",
    )
    with s.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch(0, 0)
    losses = [s.run(step_fn(model, opt), (x, y)) for _ in range(20)]
    assert losses[-1] < losses[0] * 0.7
    assert all(v.dtype == torch.float32 for v in connection.store.vars.values())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    s.pull_values()
    for p, v in zip(model.parameters(), connection.store.vars.values(), strict=True):
        assert torch.equal(p.detach(), v.bfloat16().float())  # values came as bf16


def test_async_warmup_lets_the_chief_train_alone_first() -> None:
    connection = LocalPS()
    strategies = replicas(2, connection, warmup_steps=3)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    seen: list[int] = []

    def late_step(x: torch.Tensor, y: torch.Tensor) -> float:
        seen.append(connection.store.version)
        return step_fn(*models[1])(x, y)

    worker = threading.Thread(target=lambda: strategies[1].run(late_step, batch(0, 1)), daemon=True)
    worker.start()
    for k in range(3):
        strategies[0].run(step_fn(*models[0]), batch(k, 0))
    worker.join(30)
    assert seen and seen[0] >= 3  # worker 1 started only after the chief's 3 steps


def test_a_split_is_applied_once_and_settled_as_applied() -> None:
    from clusterflow.data import SplitKey

    connection = LocalPS()
    s = ParameterServerStrategy(resolver(0, 1), _connection=connection)
    with s.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    key = SplitKey("ds", 0, 7)
    s.run(step_fn(model, opt), batch(0, 0), completes=[key])
    # Under overlap_push the reply may still be on its way: settled(wait=True) waits.
    assert s.settled(wait=True).applied == (key,)
    s.run(step_fn(model, opt), batch(0, 0), completes=[key])  # a replayed split
    replay = s.settled(wait=True)
    assert replay.applied == (key,) and not replay.dropped  # applied before: ack it
    stats = connection.store.snapshot_stats()
    assert stats["version"] == 1 and stats["duplicate_keys"] == 1
    assert not s.settled()  # each key comes back once


def test_another_optimizer_stepped_during_the_step_does_not_settle_its_split_twice() -> None:
    """The step hook is global: a local optimizer stepped in the same step, or another
    thread's optimizer stepped meanwhile (as LocalPS's store does when it applies the
    push in the background), is not this strategy's push; each once settled the split a
    second time (CI caught the store's race once)."""
    from clusterflow.data import SplitKey

    connection = LocalPS()
    s = ParameterServerStrategy(resolver(0, 1), _connection=connection)
    with s.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    head = torch.nn.Linear(3, 3)  # outside scope(): a local variable
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)
    other = torch.nn.Linear(2, 1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = head.weight.detach().clone()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(head(model(x)), y).backward()
        opt.step()
        head_opt.step()
        other(torch.ones(1, 2)).sum().backward()
        stepper = threading.Thread(target=other_opt.step, daemon=True)
        stepper.start()
        stepper.join(10)
        opt.zero_grad()
        head_opt.zero_grad()

    key = SplitKey("ds", 0, 3)
    s.run(step, batch(0, 0), completes=[key])
    settled = s.settled(wait=True)
    assert settled.applied == (key,) and not settled.dropped
    assert connection.store.snapshot_stats()["version"] == 1
    assert not torch.equal(head.weight.detach(), before)  # the local optimizer stepped


def test_a_model_another_thread_builds_during_scope_stays_local() -> None:
    """Variables are recorded by torch's global hooks; only the scope's thread's count."""
    s = ParameterServerStrategy(resolver(0, 1), _connection=LocalPS())
    built: list[torch.nn.Module] = []
    with s.scope():
        thread = threading.Thread(target=lambda: built.append(make_model()), daemon=True)
        thread.start()
        thread.join(30)
        model = make_model()
    assert built and s.unplaced(built[0]) == [n for n, _ in built[0].named_parameters()]
    assert [t for t, _, _ in s.variables()] == list(model.parameters())
    s.close()


def test_a_stale_push_gives_its_split_back() -> None:
    from clusterflow.data import SplitKey

    connection = LocalPS()
    strategies = replicas(2, connection, max_staleness=0, overlap_push=False)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
        models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    # Both read version 0 when their variables were created; worker 0 moves the ps on,
    # so worker 1's push comes from values one version old: stale, dropped.
    strategies[0].run(step_fn(*models[0]), batch(0, 0), completes=[SplitKey("ds", 0, 0)])
    strategies[1].run(step_fn(*models[1]), batch(0, 1), completes=[SplitKey("ds", 0, 1)])
    assert strategies[0].settled(wait=True).applied == (SplitKey("ds", 0, 0),)
    late = strategies[1].settled(wait=True)
    assert late.dropped == (SplitKey("ds", 0, 1),) and not late.applied


def test_sync_keys_settle_when_the_step_commits_and_late_ones_go_back() -> None:
    from clusterflow.data import SplitKey

    connection = LocalPS()
    strategies = replicas(2, connection, mode="sync", backup_workers=1)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
        models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    first, second = SplitKey("ds", 0, 0), SplitKey("ds", 0, 1)
    strategies[0].run(step_fn(*models[0]), batch(0, 0), completes=[first])  # the step's one
    assert strategies[0].settled(wait=True).applied == (first,)
    strategies[1].run(step_fn(*models[1]), batch(0, 1), completes=[second])  # late for it
    late = strategies[1].settled(wait=True)
    assert late.dropped == (second,) and not late.applied


def test_distribute_deals_out_an_iterable_but_passes_a_data_client_whole() -> None:
    strategies = replicas(3, LocalPS())
    assert list(strategies[1].distribute(range(10))) == [1, 4, 7]
    from clusterflow.data import distributed_dataset

    data = distributed_dataset({"id": torch.arange(40)}, batch_size=8, split_size=8)
    ids = [int(i) for batch in strategies[1].distribute(data) for i in batch.data["id"]]
    data.close()
    assert sorted(ids) == list(range(40))  # the dispatcher already gave this worker its share


def test_a_keyed_step_does_not_wait_for_its_push_under_overlap() -> None:
    """Acking after the apply must not serialize the overlapped push: ``run`` returns
    while the push is still on its way, and its key settles when the reply comes."""
    from clusterflow.data import SplitKey

    class HeldPush(LocalPS):
        def __init__(self) -> None:
            super().__init__()
            self.hold = threading.Event()
            self.arrived = threading.Event()

        def push(self, index: int, request: Any) -> Any:
            self.arrived.set()
            assert self.hold.wait(30), "the test never let the push through"
            return super().push(index, request)

    connection = HeldPush()
    s = ParameterServerStrategy(resolver(0, 1), _connection=connection)
    with s.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    key = SplitKey("ds", 0, 3)
    s.run(step_fn(model, opt), batch(0, 0), completes=[key])  # returns, push held
    assert connection.arrived.wait(30)
    assert not s.settled()  # not applied yet: nothing to ack
    connection.hold.set()
    assert s.settled(wait=True).applied == (key,)
    assert connection.store.snapshot_stats()["applied"] == 1


def test_final_values_include_the_steps_other_replicas_applied_after_this_ones_last() -> None:
    # sync: after its last push a replica prefetches the next version; another replica's
    # later steps (it had splits left) are applied after that prefetch resolved. The
    # values a replica ends with (``finish``, what ``fit`` leaves in the model) must be
    # the ps's final ones: with the prefetch's, a chief that wrote its model after fit
    # lost the other replica's last updates (test_chaos's sync ps counted 4 splits once).
    connection = LocalPS()
    strategies = replicas(2, connection, mode="sync", backup_workers=1)
    models = []
    for s in strategies:
        with s.scope():
            model = make_model()
        models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    strategies[0].run(step_fn(*models[0]), batch(0, 0))  # step 0 -> version 1
    strategies[1].pull_values()  # at version 1, so its push counts
    for step in (1, 2):
        strategies[1].run(step_fn(*models[1]), batch(step, 1))
        assert strategies[1].last_push_applied
    assert connection.store.snapshot_stats()["version"] == 3
    strategies[1].finish(None, leave=True)
    strategies[0].finish(None, leave=True)
    final = [p.detach() for p in models[1][0].parameters()]
    ended = [p.detach() for p in models[0][0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ended, final, strict=True))
    initial = [p.detach() for p in make_model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(final, initial, strict=True))
