"""``fit`` in one process: every strategy gives the single-process parameters.

Replicas of a synchronous parameter server run as threads on one in-process store (as
in test_ps_strategy.py), so a two-replica ``fit`` is checked against one process here;
the same under ``clusterflow start`` is in tests/integration/test_fit_in_cluster.py. The
split of global batches (including an uneven final batch) is checked as arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clusterflow.ps.local import LocalPS
from clusterflow.strategies import MultiWorkerMirroredStrategy, SimpleClusterResolver
from clusterflow.strategies.api import Replicas
from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.train import (
    Hook,
    StopAtStep,
    TrainConfigError,
    TrainingSession,
    fit,
)
from clusterflow.train.feed import Feeder
from tiny_model import flat, make_model

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("bare_env")]

ROWS = 203  # 6 global batches of 32 and a final one of 11, split 6/5 between 2 replicas


def make_data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen)


def reference(epochs: int = 2, **kwargs: Any) -> tuple[nn.Module, Any]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    history = fit(
        model,
        nn.CrossEntropyLoss(),
        optimizer,
        make_data(),
        epochs=epochs,
        global_batch_size=32,
        metrics=["accuracy"],
        seed=3,
        **kwargs,
    )
    return model, history


def test_single_process_trains_and_reports_epoch_figures() -> None:
    model, history = reference(epochs=3, validation_data=make_data(40))
    assert history.epoch == [0, 1, 2]
    assert history.step == 3 * 7
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert all(0.0 <= a <= 1.0 for a in history.history["accuracy"])
    assert model.training  # validation put it back in training mode


@pytest.mark.parametrize("name", ["central", "mirrored"])
def test_one_replica_strategies_equal_no_strategy(name: str) -> None:
    expected, want = reference()
    strategy: Any = CentralStorageStrategy() if name == "central" else MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = make_model()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        history = fit(
            model,
            nn.CrossEntropyLoss(),
            optimizer,
            make_data(),
            strategy=strategy,
            epochs=2,
            global_batch_size=32,
            metrics=["accuracy"],
            seed=3,
        )
    finally:
        strategy.close() if name == "central" else strategy.shutdown()
    torch.testing.assert_close(flat(model), flat(expected), rtol=0, atol=0)
    assert history.history == want.history


def _run_threads(fns: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in fns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    if errors:
        raise errors[0]


def test_two_sync_ps_replicas_equal_one_process_including_an_uneven_last_batch() -> None:
    expected, _ = reference()
    spec = {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"], "ps": ["127.0.0.1:3000"]}
    connection = LocalPS()
    strategies = [
        ParameterServerStrategy(
            SimpleClusterResolver(spec, task_type="worker", task_id=i),
            mode="sync",
            _connection=connection,
        )
        for i in range(2)
    ]
    replicas: list[tuple[nn.Module, torch.optim.Optimizer]] = []
    for strategy in strategies:
        with strategy.scope():
            model = make_model()
            replicas.append((model, torch.optim.Adam(model.parameters(), lr=0.01)))
    histories: list[Any] = [None, None]

    def replica(i: int) -> Callable[[], None]:
        def go() -> None:
            model, optimizer = replicas[i]
            histories[i] = fit(
                model,
                nn.CrossEntropyLoss(),
                optimizer,
                make_data(),
                strategy=strategies[i],
                epochs=2,
                global_batch_size=32,
                metrics=["accuracy"],
                seed=3,
            )

        return go

    try:
        _run_threads([replica(0), replica(1)])
    finally:
        for strategy in strategies:
            strategy.close()
    assert connection.store.version == 14  # 7 global steps per epoch, each applied once
    for model, _ in replicas:  # fit pulled the final values into every replica's model
        torch.testing.assert_close(flat(model), flat(expected), rtol=1e-5, atol=1e-6)
    for history in histories:
        assert history.step == 14 and history.epoch == [0, 1]


@pytest.mark.parametrize("rows", [64, 70, 79])
def test_replica_shares_cover_each_global_batch_and_average_to_its_mean(rows: int) -> None:
    x, y = make_data(rows)
    per_sample = (x.sum(1) + y).double()  # any per-row "loss"
    single = list(Feeder((x, y), Replicas(0, 1, True, False), **_feeder_args()).epoch(0))
    shares = [
        list(Feeder((x, y), Replicas(r, 2, True, False), **_feeder_args()).epoch(0))
        for r in range(2)
    ]
    assert len(shares[0]) == len(shares[1]) == len(single)
    for whole, part0, part1 in zip(single, *shares, strict=True):
        torch.testing.assert_close(torch.cat([part0.inputs, part1.inputs]), whole.inputs)
        assert part0.rows + part1.rows == whole.rows
        # DDP and a sync ps average the replicas' (scaled) mean losses: the global mean.
        means = [
            (p.inputs.sum(1) + p.targets).double().mean() * p.loss_scale for p in (part0, part1)
        ]
        want = (whole.inputs.sum(1) + whole.targets).double().mean()
        torch.testing.assert_close(sum(means) / 2, want)
    assert sum(f.rows for f in single) == len(per_sample)


def test_a_final_batch_smaller_than_the_replicas_is_dropped_by_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x, y = make_data(65)  # four batches of 16 and one of a single row
    shares = [
        list(Feeder((x, y), Replicas(r, 2, True, False), **_feeder_args()).epoch(0))
        for r in range(2)
    ]
    assert [len(s) for s in shares] == [4, 4]
    assert "its 1 rows are fewer than the 2 replicas" in caplog.text


def _feeder_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "global_batch_size": 16,
        "shuffle": True,
        "seed": 1,
        "steps_per_epoch": None,
        "device": torch.device("cpu"),
    }
    args.update(overrides)
    return args


def test_batches_from_a_loader_a_list_and_a_generator() -> None:
    x, y = make_data(96)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    listed = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]
    results = []
    for data in (loader, listed):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history = fit(model, nn.CrossEntropyLoss(), opt, data, epochs=2)
        assert history.step == 6
        results.append(flat(model))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)

    def forever() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from listed

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(model, nn.CrossEntropyLoss(), opt, forever(), epochs=2, steps_per_epoch=3)
    assert history.step == 6 and history.epoch == [0, 1]
    torch.testing.assert_close(flat(model), results[0], rtol=0, atol=0)


def test_stop_at_step_ends_inside_an_epoch() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(
        model,
        nn.CrossEntropyLoss(),
        opt,
        make_data(),
        epochs=5,
        global_batch_size=32,
        hooks=[StopAtStep(10)],
    )
    assert history.step == 10
    assert history.epoch == [0, 1]  # the second epoch stopped after 3 of its 7 steps


class _Resume(Hook):
    """Stands in for a Checkpoint hook that restored ``step``."""

    restores = True

    def __init__(self, step: int) -> None:
        self.step = step

    def begin(self, session: TrainingSession) -> None:
        session.restored(self.step)


@pytest.mark.parametrize("stop", [7, 10])
def test_a_resumed_fit_continues_on_the_same_global_batches(stop: int) -> None:
    expected, _ = reference(epochs=3)

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    args: dict[str, Any] = {"epochs": 3, "global_batch_size": 32, "seed": 3}
    fit(model, nn.CrossEntropyLoss(), opt, make_data(), hooks=[StopAtStep(stop)], **args)
    # A new process would load these from the checkpoint:
    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    resumed_opt.load_state_dict(opt.state_dict())
    history = fit(
        resumed, nn.CrossEntropyLoss(), resumed_opt, make_data(), hooks=[_Resume(stop)], **args
    )
    assert history.step == 21
    assert history.epoch[0] == stop // 7
    torch.testing.assert_close(flat(resumed), flat(expected), rtol=0, atol=0)


def test_a_fit_resumed_after_its_last_step_gives_the_restored_models_figures() -> None:
    """A finished run run again (``start --resume``, or the script with its checkpoint
    folder) has no step left; ``fit`` must still return the restored model's figures,
    never an empty History (the example then printed ``final loss nan``). Pins
    ``_Loop._restored_figures``: the training loss over every batch with no update,
    the same figures ``evaluate`` gives, and the validation figures."""
    model, _ = reference(epochs=2)
    before = flat(model).clone()
    history = fit(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.Adam(model.parameters(), lr=0.01),
        make_data(),
        epochs=2,
        global_batch_size=32,
        metrics=["accuracy"],
        seed=3,
        validation_data=make_data(40),
        hooks=[_Resume(2 * 7)],
    )
    assert history.step == 14 and history.epoch == [1]
    torch.testing.assert_close(flat(model), before, rtol=0, atol=0)  # nothing trained
    x, y = make_data()
    vx, vy = make_data(40)
    with torch.no_grad():
        want_loss = float(nn.CrossEntropyLoss(reduction="sum")(model(x), y)) / len(y)
        want_val = float((model(vx).argmax(1) == vy).float().mean())
    last = history.last()
    assert set(last) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert last["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert last["val_accuracy"] == pytest.approx(want_val, rel=1e-6)


def test_a_data_service_fit_resumed_after_its_end_gives_the_validation_figures() -> None:
    """The data service's records are all acked after a finished run, so a resumed
    ``fit`` reads no batch; it still returns the restored model's validation figures
    (pins the end of ``_Loop.run_client``)."""
    from clusterflow.data import distributed_dataset

    x, y = make_data(64)
    with distributed_dataset(
        {"x": x.numpy(), "y": y.numpy()},
        batch_size=16,
        split_size=32,
        epochs=1,
        collate_fn=lambda cols: (torch.as_tensor(cols["x"]), torch.as_tensor(cols["y"])),
    ) as data:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first = fit(model, nn.CrossEntropyLoss(), opt, data, epochs=1)
        assert first.step == 4
        history = fit(
            model,
            nn.CrossEntropyLoss(),
            opt,
            data,
            epochs=1,
            metrics=["accuracy"],
            validation_data=make_data(40),
            hooks=[_Resume(4)],
        )
    assert history.epoch == [0] and history.step == 4
    assert set(history.last()) == {"val_loss", "val_accuracy"}


def test_data_service_client_feeds_fit() -> None:
    from clusterflow.data import distributed_dataset

    x, y = make_data(96)
    with distributed_dataset(
        {"x": x.numpy(), "y": y.numpy()},
        batch_size=16,
        split_size=32,
        epochs=2,
        collate_fn=lambda cols: (torch.as_tensor(cols["x"]), torch.as_tensor(cols["y"])),
    ) as data:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history = fit(model, nn.CrossEntropyLoss(), opt, data, epochs=2, metrics=["accuracy"])
    assert history.step == 12
    assert history.epoch == [0, 1]


def _fit(**overrides: Any) -> Any:
    model = overrides.pop("model", None) or make_model()
    args: dict[str, Any] = {
        "model": model,
        "loss_fn": nn.CrossEntropyLoss(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data": make_data(64),
    }
    args.update(overrides)
    return fit(**args)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"steps_per_epoch": 0}, "steps_per_epoch must be an integer >= 1"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1"),
        ({"metrics": ["f1"]}, "unknown metric 'f1'"),
        ({"metrics": ["accuracy", "accuracy"]}, "repeated or reserved"),
        ({"optimizer": "adam"}, "optimizer must be a torch.optim.Optimizer"),
        ({"strategy": "mirrored"}, "strategy must be a clusterflow Strategy"),
        ({"hooks": [object()]}, "hooks must be clusterflow.train.Hook"),
        ({"data": 3}, "data must be tensors"),
        ({"data": [{"x": torch.ones(2, 6)}]}, r"must be \(inputs, targets\), got a dict"),
        ({"data": iter([]), "epochs": 2}, "one-pass iterator: give steps_per_epoch"),
        ({"loss_fn": nn.CrossEntropyLoss(reduction="none")}, "one-element tensor"),
        ({"data": (torch.ones(4, 6), torch.ones(3))}, "different lengths"),
    ],
)
def test_bad_input_is_one_clear_error(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(TrainConfigError, match=match) as info:
        _fit(**overrides)
    assert "\n" not in str(info.value)


def test_global_batch_not_divisible_by_replicas_names_both() -> None:
    x, y = make_data(64)
    with pytest.raises(TrainConfigError, match=r"\(15 rows\) is not divisible by the 2 replicas"):
        Feeder((x, y), Replicas(0, 2, True, False), **_feeder_args(global_batch_size=15))


@pytest.mark.parametrize("name", ["central", "mirrored"])
def test_a_model_made_outside_scope_is_refused(name: str) -> None:
    strategy: Any = CentralStorageStrategy() if name == "central" else MultiWorkerMirroredStrategy()
    if name == "central":
        with strategy.scope():
            torch.nn.Linear(2, 2)  # the strategy has variables, but not the model's
    try:
        with pytest.raises(TrainConfigError, match=r"outside strategy\.scope") as info:
            _fit(strategy=strategy)
        assert "\n" not in str(info.value)
    finally:
        strategy.close() if name == "central" else strategy.shutdown()


def test_two_sync_ps_replicas_fed_unevenly_by_the_data_service_both_finish() -> None:
    """A replica whose leases ran out leaves the sync steps, so its peer's last steps run."""
    from clusterflow.data import DataClient, DataConfig, DispatcherService, TensorSource
    from clusterflow.rpc import Credentials, RpcServer

    x, y = make_data(110)
    credentials = Credentials.generate()
    server = RpcServer(credentials, name="dispatcher")
    DispatcherService().register_on(server)
    server.start()
    # Read-ahead held to one split each. With the defaults, a replica whose first step
    # waits for its peer goes on leasing and reading ahead: 10 of the 11 splits after
    # 3 s, all 11 after 8 s, so a peer whose thread asked late found none left and
    # never took part (all(steps) failed once in a suite run). Bounded, a replica
    # holds at most 5 while it waits, and both take part however late either starts.
    config = DataConfig(batch_size=10, split_size=10, epochs=1, prefetch=1, leases_ahead=1)
    spec = {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"], "ps": ["127.0.0.1:3000"]}
    connection = LocalPS()
    strategies = [
        ParameterServerStrategy(
            SimpleClusterResolver(spec, task_type="worker", task_id=i),
            mode="sync",
            _connection=connection,
        )
        for i in range(2)
    ]
    clients = [
        DataClient(
            TensorSource({"x": x.numpy(), "y": y.numpy()}),
            config,
            dispatcher=server.address,
            credentials=credentials,
            collate_fn=lambda c: (torch.as_tensor(c["x"]), torch.as_tensor(c["y"])),
            worker=f"worker:{i}",
        )
        for i in range(2)
    ]
    models = []
    for strategy in strategies:
        with strategy.scope():
            model = make_model()
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    steps = [0, 0]

    def replica(i: int) -> Callable[[], None]:
        def go() -> None:
            model, optimizer = models[i]
            history = fit(
                model, nn.CrossEntropyLoss(), optimizer, clients[i], strategy=strategies[i]
            )
            steps[i] = history.step

        return go

    try:
        _run_threads([replica(0), replica(1)])
        (stats,) = strategies[0].ps_stats()
    finally:
        for strategy in strategies:
            strategy.close()
        for client in clients:
            client.close()
        server.stop()
    assert sum(steps) == 11  # every split trained on once, by one replica or the other
    assert all(steps)
    # ... and every push reached the store and went into a step: the steps both replicas
    # made together took two pushes each, the rest one, so the store's version is the
    # longer replica's step count. A dropped or lost push would leave it short.
    assert stats["pushes"] == 11, stats
    assert stats["version"] == stats["applied"] == max(steps), (stats, steps)
    assert sum(s.dropped_pushes for s in strategies) == 0
