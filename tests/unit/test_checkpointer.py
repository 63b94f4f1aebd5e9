"""``Checkpointer`` in one process: a single model, and a ps strategy on an in-process store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clusterflow.checkpoint import CheckpointError, CheckpointStorage
from clusterflow.checkpoint.names import ENV_CHECKPOINT_DIR, ENV_RESTORE, ps_part
from clusterflow.errors import ConfigError
from clusterflow.ps.local import LocalPS
from clusterflow.ps.restore import restore_shard
from clusterflow.ps.store import VariableStore
from clusterflow.strategies import SimpleClusterResolver
from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.train.cut import Checkpointer
from tiny_model import flat, make_model

pytestmark = pytest.mark.usefixtures("bare_env")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_a_single_process_resumes_exactly_where_it_saved(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ckpt = Checkpointer(
        model=model, optimizer=opt, directory=str(tmp_path), every_steps=4, state={"lr": sched}
    )
    assert ckpt.restore() == 0  # nothing saved yet
    saved_at = None
    for step in range(1, 7):
        train(model, opt, range(step - 1, step))
        sched.step()
        if ckpt.maybe_save(step):
            saved_at = (flat(model).clone(), torch.rand(3), opt.param_groups[0]["lr"])
    assert saved_at is not None and ckpt.last_saved_step == 4
    # Uninterrupted: steps 5..8 from the state at step 4.
    continued = flat(model)

    fresh = make_model()
    torch.manual_seed(123)  # another RNG state, which the restore must replace
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    again = Checkpointer(
        model=fresh, optimizer=fresh_opt, directory=str(tmp_path), state={"lr": fresh_sched}
    )
    assert again.restore() == 4
    assert torch.equal(flat(fresh), saved_at[0])
    assert fresh_opt.param_groups[0]["lr"] == saved_at[2]
    assert fresh_sched.last_epoch == 4
    # Adam's moments came back too: the same two steps give the same parameters.
    train(fresh, fresh_opt, range(4, 6))
    assert torch.equal(flat(fresh), continued)


def test_the_rng_state_is_part_of_a_tasks_own_part(tmp_path: Path) -> None:
    model = make_model()
    ckpt = Checkpointer(model=model, directory=str(tmp_path))
    torch.manual_seed(7)
    ckpt.save(1)
    expected = torch.rand(4)
    torch.manual_seed(99)
    Checkpointer(model=make_model(), directory=str(tmp_path)).restore()
    assert torch.equal(torch.rand(4), expected)


def test_every_steps_schedule_and_retention(tmp_path: Path) -> None:
    ckpt = Checkpointer(model=make_model(), directory=str(tmp_path), every_steps=3, keep=2)
    saved = [step for step in range(1, 13) if ckpt.maybe_save(step)]
    assert saved == [3, 6, 9, 12]
    assert [m.step for m in CheckpointStorage(str(tmp_path)).committed()] == [9, 12]


def test_central_storage_restores_variables_slots_and_version(tmp_path: Path) -> None:
    strategy = CentralStorageStrategy()
    with strategy.scope():
        model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    ckpt = Checkpointer(strategy, directory=str(tmp_path))
    for step in range(3):
        strategy.run(step_fn, batch(step))
    ckpt.save(3)
    manifest = CheckpointStorage(str(tmp_path)).latest()
    assert manifest is not None and manifest.step == strategy.global_step() == 3
    for step in range(3, 5):
        strategy.run(step_fn, batch(step))
    strategy.pull_values()
    continued = flat(model)

    other = CentralStorageStrategy()
    with other.scope():
        model2 = make_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    assert Checkpointer(other, directory=str(tmp_path)).restore() == 3
    assert other.global_step() == 3

    def step_fn2(x: torch.Tensor, y: torch.Tensor) -> None:
        opt2.zero_grad()
        F.cross_entropy(model2(x), y).backward()
        opt2.step()

    for step in range(3, 5):
        other.run(step_fn2, batch(step))
    other.pull_values()
    assert torch.allclose(flat(model2), continued, atol=1e-6)  # momentum slots came back


def test_a_ps_task_restores_its_shard_from_the_named_checkpoint(tmp_path: Path) -> None:
    strategy = CentralStorageStrategy()
    with strategy.scope():
        model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)

        def step_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        strategy.run(step_fn)
    Checkpointer(strategy, directory=str(tmp_path)).save(2)

    store = VariableStore(0)
    env = {ENV_CHECKPOINT_DIR: str(tmp_path), ENV_RESTORE: "2"}
    assert restore_shard(store, 1, env) == 2
    assert store.version == 2
    _, tensors = CheckpointStorage(str(tmp_path)).read_tensors(
        CheckpointStorage(str(tmp_path)).latest(),
        ps_part(0),  # type: ignore[arg-type]
    )
    assert set(store.vars) == {k[4:] for k in tensors if k.startswith("var/")}
    assert restore_shard(VariableStore(0), 1, {}) is None  # a first start: nothing to load
    with pytest.raises(CheckpointError, match="holds 1 ps shard"):
        restore_shard(VariableStore(0), 2, env)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        restore_shard(VariableStore(0), 1, {**env, ENV_RESTORE: "7"})


def test_bad_arguments_and_a_checkpoint_of_another_kind_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="every_steps must be an integer >= 1, got 0"):
        Checkpointer(model=make_model(), directory=str(tmp_path), every_steps=0)
    with pytest.raises(ConfigError, match="every_secs must be a positive, finite number"):
        Checkpointer(model=make_model(), directory=str(tmp_path), every_secs=-1)
    with pytest.raises(ConfigError, match="every_secs must be a positive, finite number"):
        Checkpointer(model=make_model(), directory=str(tmp_path), every_secs=float("nan"))
    with pytest.raises(ConfigError, match="needs the model"):
        Checkpointer(directory=str(tmp_path))
    Checkpointer(model=make_model(), directory=str(tmp_path)).save(5)
    strategy = ParameterServerStrategy(
        SimpleClusterResolver(
            {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="worker", task_id=0
        ),
        _connection=LocalPS(),
    )
    with strategy.scope():
        make_model()
    with pytest.raises(CheckpointError, match="written by a 'replicated' job"):
        Checkpointer(strategy, directory=str(tmp_path)).restore()
    monkeypatch.setenv(ENV_RESTORE, "9")
    with pytest.raises(CheckpointError, match="CLUSTERFLOW_RESTORE=9"):
        Checkpointer(model=make_model(), directory=str(tmp_path)).restore()


def test_load_module_rebuilds_a_plain_model_from_either_kind_of_checkpoint(tmp_path: Path) -> None:
    from clusterflow.ps.placement import FixedShardsPartitioner
    from clusterflow.train.cut import load_module

    strategy = ParameterServerStrategy(
        SimpleClusterResolver(
            {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="worker", task_id=0
        ),
        _connection=LocalPS(),
        variable_partitioner=FixedShardsPartitioner(3),  # shards joined back on load
    )
    with strategy.scope():
        model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    strategy.run(step_fn, batch(0))
    Checkpointer(strategy, directory=str(tmp_path / "ps")).save(1)
    strategy.pull_values()
    loaded = load_module(str(tmp_path / "ps"), make_model)
    assert loaded is not None and loaded[1] == 1
    assert torch.equal(flat(loaded[0]), flat(model))
    assert not torch.equal(flat(loaded[0]), flat(make_model()))  # trained values, not fresh

    plain = make_model()
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), range(2))
    Checkpointer(model=plain, directory=str(tmp_path / "plain")).save(2)
    again = load_module(str(tmp_path / "plain"), make_model)
    assert again is not None and again[1] == 2 and torch.equal(flat(again[0]), flat(plain))
    assert load_module(str(tmp_path / "none"), make_model) is None


def test_load_into_fills_a_plain_model_from_a_parameter_server_checkpoint(tmp_path: Path) -> None:
    from clusterflow.ps.placement import FixedShardsPartitioner
    from clusterflow.train.cut import load_into

    strategy = ParameterServerStrategy(
        SimpleClusterResolver(
            {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="worker", task_id=0
        ),
        _connection=LocalPS(),
        variable_partitioner=FixedShardsPartitioner(2),
    )
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    strategy.run(step_fn, batch(0))
    Checkpointer(strategy, directory=str(tmp_path)).save(1)
    strategy.pull_values()
    plain = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)
    )
    assert load_into(plain, str(tmp_path)) == 1
    assert torch.equal(flat(plain), flat(model))
    other = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 3))
    with pytest.raises(CheckpointError, match="build it as the training job did"):
        load_into(other, str(tmp_path))
    assert load_into(make_model(), str(tmp_path / "none")) == 0


def _ps_chief(connection: LocalPS) -> tuple[ParameterServerStrategy, torch.nn.Module]:
    strategy = ParameterServerStrategy(
        SimpleClusterResolver(
            {"worker": ["127.0.0.1:1", "127.0.0.1:3"], "ps": ["127.0.0.1:2"]},
            task_type="worker",
            task_id=0,  # no chief job: worker 0 leads
        ),
        _connection=connection,
    )
    with strategy.scope():
        model = make_model()
    return strategy, model


def _sgd_step(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One SGD step of ``model`` on a batch, as ``strategy.run`` takes it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step_fn


def test_a_chief_respawned_alone_never_rolls_back_a_live_ps(tmp_path: Path) -> None:
    """Issue 31: the leading worker of a cluster without a ``chief`` job, respawned alone
    while the ps lives on, restores the checkpoint without writing it into the ps.

    Pins ``ParameterServerStrategy.restore``'s ``self._ps_fresh()``: without it the
    respawned chief loads the step-1 shard into the live ps and undoes steps 2 and 3,
    whose records the data service has acknowledged and will not hand out again.
    """
    connection = LocalPS()
    strategy, model = _ps_chief(connection)
    step_fn = _sgd_step(model)
    strategy.run(step_fn, batch(0))
    Checkpointer(strategy, directory=str(tmp_path)).save(1)
    for step in (1, 2):
        strategy.run(step_fn, batch(step))
    strategy.pull_values()
    live = flat(model).clone()
    version = strategy.ps_stats()[0]["version"]

    # The same task again, in a new process: the ps it talks to is the live one.
    again, model2 = _ps_chief(connection)
    assert Checkpointer(again, directory=str(tmp_path)).restore() == 1
    assert again.ps_stats()[0]["version"] == version
    assert torch.equal(flat(model2), live)


def test_a_chief_of_fresh_parameter_servers_loads_the_checkpoint_into_them(
    tmp_path: Path,
) -> None:
    """The other side of the rule above: a cluster without the manager, all of it
    started again (fresh ps), resumes from the checkpoint the chief loads."""
    strategy, model = _ps_chief(LocalPS())
    strategy.run(_sgd_step(model), batch(0))
    Checkpointer(strategy, directory=str(tmp_path)).save(1)
    strategy.pull_values()
    saved = flat(model).clone()
    again, model2 = _ps_chief(LocalPS())
    assert not torch.equal(flat(model2), saved)
    assert Checkpointer(again, directory=str(tmp_path)).restore() == 1
    assert torch.equal(flat(model2), saved)
