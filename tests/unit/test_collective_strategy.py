"""The mirrored strategies in one process (a single replica), and their input checks.

A lone process runs the same code path as a cluster (nanoGPT's rule): scope() marks the
model, run() checks it, reduce() and save_model() work, so these tests need no peers.
Splitting batches is pure logic, tested for any replica count.
"""

from __future__ import annotations

import copy
import io
import json
import threading
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from clusterflow.collective import MembershipError
from clusterflow.strategies import (
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    StrategyError,
    unwrap,
)
from clusterflow.strategies.batches import (
    batch_size_of,
    check_divisible,
    distribute_batches,
    replica_slice,
    split_batch,
)


@pytest.fixture
def strategy(bare_env: pytest.MonkeyPatch) -> Iterator[MultiWorkerMirroredStrategy]:
    lone = MultiWorkerMirroredStrategy()
    yield lone
    lone.shutdown()


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# One replica ---------------------------------------------------------------------------


def test_a_lone_process_is_one_replica_and_the_chief(
    strategy: MultiWorkerMirroredStrategy,
) -> None:
    assert strategy.num_replicas_in_sync == 1
    assert strategy.is_chief
    assert strategy.device == torch.device("cpu")
    assert strategy.cluster_resolver is None


def test_scope_mirrors_the_model_the_user_keeps(strategy: MultiWorkerMirroredStrategy) -> None:
    with strategy.scope():
        model = _net()
        loss_fn = nn.CrossEntropyLoss()  # no parameters: left alone
    assert isinstance(model, nn.Sequential)
    assert type(model).__name__ == "MirroredSequential"
    assert type(loss_fn) is nn.CrossEntropyLoss
    assert type(model[0]) is nn.Linear  # only the root is switched
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert unwrap(model) is model
    # Copies and pickles are plain modules again.
    assert type(copy.deepcopy(model)) is nn.Sequential
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is nn.Sequential


def test_run_trains_the_mirrored_model(strategy: MultiWorkerMirroredStrategy) -> None:
    with strategy.scope():
        model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))

    def step() -> float:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    losses = [strategy.run(step) for _ in range(20)]
    assert losses[-1] < losses[0]


def test_a_model_created_outside_scope_is_refused_inside_run(
    strategy: MultiWorkerMirroredStrategy,
) -> None:
    outside = _net()
    with pytest.raises(StrategyError, match=r"Linear, ran inside strategy.run\(\) but was created"):
        strategy.run(lambda: outside(torch.randn(2, 4)))
    # Outside run() (evaluation code, say) it is the user's business.
    outside(torch.randn(2, 4))


def _on_another_thread(fn: Callable[[], Any]) -> list[Any]:
    """Runs ``fn`` on a thread of its own; its result or its exception."""
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out


def test_a_scope_and_a_step_are_their_threads_own(
    strategy: MultiWorkerMirroredStrategy,
) -> None:
    """torch's module hooks are global: a model another thread builds while the scope is
    open is not mirrored, and another thread's model may run while a step runs (an
    evaluation thread, say); the step's own checks still hold on its thread."""
    with strategy.scope():
        (theirs,) = _on_another_thread(_net)
        model = _net()
    assert type(theirs) is nn.Sequential and type(model) is not nn.Sequential

    def step() -> torch.Tensor:
        (out,) = _on_another_thread(lambda: theirs(torch.randn(2, 4)))
        assert isinstance(out, torch.Tensor), out  # not a StrategyError
        return model(torch.randn(2, 4))

    assert strategy.run(step).shape == (2, 2)
    with pytest.raises(StrategyError, match="was created"):
        strategy.run(lambda: theirs(torch.randn(2, 4)))


def test_a_submodule_called_past_its_model_is_refused(
    strategy: MultiWorkerMirroredStrategy,
) -> None:
    with strategy.scope():
        model = _net()
    with pytest.raises(StrategyError, match="part of the mirrored Sequential"):
        strategy.run(lambda: model[0](torch.randn(2, 4)))


def test_frozen_and_parameterless_modules_need_no_scope(
    strategy: MultiWorkerMirroredStrategy,
) -> None:
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with strategy.scope():
        model = _net()
    out = strategy.run(lambda: model(nn.functional.relu(frozen(torch.randn(2, 4)))))
    assert out.shape == (2, 2)


def test_prepare_mirrors_a_model_built_elsewhere(strategy: MultiWorkerMirroredStrategy) -> None:
    model = strategy.prepare(_net())
    assert strategy.prepare(model) is model  # idempotent
    assert strategy.run(lambda: model(torch.randn(3, 4))).shape == (3, 2)


def test_a_failed_scope_body_prepares_nothing(strategy: MultiWorkerMirroredStrategy) -> None:
    made: list[nn.Module] = []
    with pytest.raises(KeyError), strategy.scope():
        made.append(_net())
        raise KeyError("boom")
    assert type(made[0]) is nn.Sequential


def test_scopes_nest_and_do_not_mix(
    strategy: MultiWorkerMirroredStrategy, bare_env: pytest.MonkeyPatch
) -> None:
    other = MirroredStrategy()
    with strategy.scope(), strategy.scope():
        inner = _net()
        with pytest.raises(StrategyError, match="another strategy's scope"), other.scope():
            pass
    assert type(inner).__name__ == "MirroredSequential"


def test_reduce_of_one_replica_is_the_value(strategy: MultiWorkerMirroredStrategy) -> None:
    assert strategy.reduce("sum", 3) == 3
    assert strategy.reduce("mean", 3) == 3.0
    assert strategy.reduce("MEAN", torch.tensor([1, 3])).tolist() == [1.0, 3.0]
    assert strategy.reduce("sum", {"a": [1.5, 2]}) == {"a": [1.5, 2]}
    with pytest.raises(StrategyError, match="unknown reduce op 'max'"):
        strategy.reduce("max", 1)
    with pytest.raises(StrategyError, match="got str"):
        strategy.reduce("sum", "x")


def test_no_sync_is_harmless_alone(strategy: MultiWorkerMirroredStrategy) -> None:
    with strategy.scope():
        model = _net()
    with strategy.no_sync():
        strategy.run(lambda: model(torch.randn(2, 4)).sum().backward())
    assert all(p.grad is not None for p in model.parameters())


def test_save_model_writes_a_plain_state_dict(
    strategy: MultiWorkerMirroredStrategy, tmp_path: Path
) -> None:
    with strategy.scope():
        model = _net()
    path = tmp_path / "out" / "model.pt"
    strategy.save_model(model, path)
    plain = _net()
    plain.load_state_dict(torch.load(path, weights_only=True))
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no partial file left


def test_save_model_failure_is_a_strategy_error(
    strategy: MultiWorkerMirroredStrategy, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StrategyError, match="could not save the model"):
        strategy.save_model(_net(), tmp_path / "file" / "model.pt")


# Mismatched clusters --------------------------------------------------------------------


def _tf_config(workers: int, index: int) -> str:
    addresses = [f"127.0.0.1:{2300 + i}" for i in range(workers)]
    return json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )


def test_world_size_disagreeing_with_the_spec_is_refused_before_connecting(
    bare_env: pytest.MonkeyPatch,
) -> None:
    bare_env.setenv("TF_CONFIG", _tf_config(2, 0))
    bare_env.setenv("RANK", "0")
    bare_env.setenv("WORLD_SIZE", "3")
    with pytest.raises(MembershipError, match=r"WORLD_SIZE=3 but the cluster spec has 2"):
        MultiWorkerMirroredStrategy()


def test_mirrored_strategy_is_for_one_host(bare_env: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        bare_env.setenv(name, value)
    bare_env.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(MembershipError, match="use MultiWorkerMirroredStrategy"):
        MirroredStrategy()


def test_mirrored_devices_must_match_the_processes(bare_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(MembershipError, match="2 devices given"):
        MirroredStrategy(devices=["/cpu:0", "/cpu:1"])


# Splitting batches ------------------------------------------------------------------------


def test_indivisible_global_batch_names_both_numbers() -> None:
    with pytest.raises(StrategyError, match="global batch size 10 is not divisible by the 4"):
        check_divisible(10, 4)
    assert check_divisible(12, 4) == 3


def test_replica_slices_cover_a_batch_once_in_order() -> None:
    for size in range(1, 12):
        for replicas in range(1, 5):
            rows = [
                i for r in range(replicas) for i in range(size)[replica_slice(size, r, replicas)]
            ]
            assert rows == list(range(size))


def test_split_batch_keeps_the_structure() -> None:
    pair = namedtuple("pair", "x y")
    batch = {"a": (torch.arange(6), [torch.zeros(6, 2)]), "p": pair(torch.arange(6), "tag")}
    part = split_batch(batch, 1, 3)
    assert part["a"][0].tolist() == [2, 3]
    assert part["a"][1][0].shape == (2, 2)
    assert isinstance(part["p"], pair) and part["p"].y == "tag"
    with pytest.raises(StrategyError, match="different batch sizes"):
        batch_size_of((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(StrategyError, match="must hold tensors"):
        batch_size_of(["a", "b"])


def _shares(dataset: object, replicas: int, **kwargs: object) -> list[list[list[int]]]:
    return [
        [b.tolist() if isinstance(b, torch.Tensor) else b[1].tolist() for b in batches]
        for batches in (
            distribute_batches(
                dataset,  # type: ignore[arg-type]
                rank=r,
                replicas=replicas,
                device=torch.device("cpu"),
                **kwargs,  # type: ignore[arg-type]
            )
            for r in range(replicas)
        )
    ]


def test_map_style_datasets_are_batched_and_read_by_slice() -> None:
    data = TensorDataset(torch.zeros(7, 1), torch.arange(7))
    shares = _shares(data, 2, global_batch_size=4, drop_remainder=False)
    assert shares == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    dropped = _shares(data, 2, global_batch_size=4, drop_remainder=True)
    assert dropped == [[[0, 1]], [[2, 3]]]
    with pytest.raises(StrategyError, match="needs global_batch_size"):
        _shares(data, 2, global_batch_size=None, drop_remainder=False)


def test_iterables_of_global_batches_are_sliced() -> None:
    batches = [torch.arange(4), torch.arange(4, 8), torch.arange(8, 9)]
    # The last batch has one row for two replicas: dropped, not an empty (NaN) batch.
    shares = _shares(batches, 2, global_batch_size=None, drop_remainder=False)
    assert shares == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(StrategyError, match="exceeds the global batch size 2"):
        _shares(batches, 2, global_batch_size=2, drop_remainder=False)
    with pytest.raises(StrategyError, match="global batch size 3 is not divisible by the 2"):
        _shares([torch.arange(3)], 2, global_batch_size=None, drop_remainder=False)
