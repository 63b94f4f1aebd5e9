"""The all-reduce strategies with real replica processes on 127.0.0.1.

This file is also the replicas' program: ``python test_mirrored.py SCENARIO OUT`` runs one
replica of a scenario and writes what it saw to ``OUT/result-<rank>.json``; the tests
launch the replicas, wait for them (killing any left, even when a test fails) and assert
on those files. Each scenario packs several checks into one launch, because every replica
pays torch's import (~2.5 s of CPU) and the suite runs on two cores.

The replicas get the environment ``clusterflow start`` gives its tasks (``TF_CONFIG``,
the torchrun variables, ``TORCHELASTIC_USE_AGENT_STORE``), with the TCPStore hosted here,
as the manager hosts it; one scenario uses TensorFlow's manual mode instead (``TF_CONFIG``
alone: the chief's address hosts the store). The last test goes through
``clusterflow start`` itself.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
HANG_DUMP_S = 90.0
"""A replica still running this long dumps its stacks (``Replicas.wait`` gives 100 s)."""
WORLD = 2

# ----------------------------------------------------------------------------------------
# The replicas' side


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return (_flat(a) - _flat(b)).abs().max().item()


def _spread_across_replicas(tensor: torch.Tensor) -> float:
    """The largest difference between any replica's copy of ``tensor`` and rank 0's."""
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.contiguous())
    return max((c - copies[0]).abs().max().item() for c in copies)


def _global_batches(n: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(123)  # the same global batches on every replica
    return [
        (torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen))
        for _ in range(n)
    ]


def scenario_train(out: Path) -> dict[str, Any]:
    """Equivalence with one process, accumulation, bf16, distribute, reduce, save_model."""
    from clusterflow.collective.hooks import CastState, bf16_allreduce_hook
    from clusterflow.strategies import (
        CommunicationOptions,
        Compression,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        StrategyError,
    )

    strategy = MirroredStrategy()
    rank, n = strategy.rank, strategy.num_replicas_in_sync
    result: dict[str, Any] = {"rank": rank, "replicas": n, "is_chief": strategy.is_chief}
    data = _global_batches(6)

    # 1. Step for step equal to one process training on the global batch.
    with strategy.scope():
        model = _mlp(seed=rank)  # unequal on purpose: the wrap must broadcast rank 0's
    reference = _mlp(seed=0)  # one process, whole global batches; never inside run()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    result["initial_diff"] = _max_diff(model, reference)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    diffs, spreads = [], []
    for (x, y), (mine_x, mine_y) in zip(data, strategy.distribute(data, 8), strict=True):
        strategy.run(step, (mine_x, mine_y))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        diffs.append(_max_diff(model, reference))
        spreads.append(_spread_across_replicas(_flat(model)))
    result["step_diffs"], result["step_spreads"] = diffs, spreads
    result["local_rows"] = len(mine_y)

    # 2. Gradient accumulation: two micro-batches, the first without synchronisation.
    with strategy.scope():
        acc = _mlp(seed=1)
    acc_ref = _mlp(seed=1)
    acc_opt = torch.optim.SGD(acc.parameters(), lr=0.5)
    acc_ref_opt = torch.optim.SGD(acc_ref.parameters(), lr=0.5)
    micro = list(strategy.distribute(data[:2], 8))

    def accumulate() -> float:
        acc_opt.zero_grad()
        with strategy.no_sync():
            F.cross_entropy(acc(micro[0][0]), micro[0][1]).backward()
        local = torch.cat([p.grad.flatten() for p in acc.parameters() if p.grad is not None])
        spread = _spread_across_replicas(local)
        F.cross_entropy(acc(micro[1][0]), micro[1][1]).backward()
        acc_opt.step()
        return spread

    result["no_sync_grad_spread"] = strategy.run(accumulate)
    acc_ref_opt.zero_grad()
    sum(F.cross_entropy(acc_ref(x), y) for x, y in data[:2]).backward()  # type: ignore[union-attr]
    acc_ref_opt.step()
    result["accumulate_diff"] = _max_diff(acc, acc_ref)

    # 3. bf16 compression, on a second strategy that adopts the group formed above.
    bf16 = MultiWorkerMirroredStrategy(CommunicationOptions(compression=Compression.BF16))
    with bf16.scope():
        small = _mlp(seed=10 + rank)
    small_ref = _mlp(seed=10)
    # The hook in chunks of 50 gradients (the model has 163): chunking must not change
    # a single bit of the result.
    chunked = DistributedDataParallel(_mlp(seed=10))
    chunked.register_comm_hook(CastState(None, chunk_elements=50), bf16_allreduce_hook)
    small_opt = torch.optim.SGD(small.parameters(), lr=0.5)
    small_ref_opt = torch.optim.SGD(small_ref.parameters(), lr=0.5)
    chunked_opt = torch.optim.SGD(chunked.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        for (x, y), (mx, my) in zip(data, bf16.distribute(data, 8), strict=True):

            def bf16_step(mx: torch.Tensor = mx, my: torch.Tensor = my) -> torch.Tensor:
                small_opt.zero_grad()
                loss = F.cross_entropy(small(mx), my)
                loss.backward()
                small_opt.step()
                return loss.detach()

            losses.append(bf16.reduce("mean", bf16.run(bf16_step)).item())
            small_ref_opt.zero_grad()
            F.cross_entropy(small_ref(x), y).backward()
            small_ref_opt.step()
            chunked_opt.zero_grad()
            F.cross_entropy(chunked(mx), my).backward()
            chunked_opt.step()
    result["bf16_spread"] = _spread_across_replicas(_flat(small))
    result["bf16_diff"] = _max_diff(small, small_ref)
    result["bf16_chunked_diff"] = _max_diff(small, chunked.module)
    result["bf16_first_loss"], result["bf16_last_loss"] = losses[0], losses[-1]

    # 4. distribute: contiguous slices of a map-style dataset and of an iterable.
    rows = TensorDataset(torch.arange(10).float().unsqueeze(1), torch.arange(10))
    result["map_rows"] = [y.tolist() for _, y in strategy.distribute(rows, global_batch_size=4)]
    result["iter_rows"] = [b.tolist() for b in strategy.distribute([torch.arange(6)] * 2, 6)]
    try:
        strategy.distribute(rows, global_batch_size=5)
    except StrategyError as exc:
        result["indivisible"] = str(exc)

    # 5. reduce across replicas.
    result["reduce_sum"] = strategy.reduce("sum", rank + 1)
    result["reduce_mean"] = strategy.reduce("mean", torch.tensor([2.0 * rank, 1.0])).tolist()
    result["reduce_dict"] = strategy.reduce("sum", {"n": 1, "x": 0.5})

    # 6. A model created outside scope() is refused inside run().
    try:
        strategy.run(lambda: reference(data[0][0]))
    except StrategyError as exc:
        result["unscoped"] = str(exc)

    # 7. save_model: each replica names its own path; only the chief's may appear.
    strategy.save_model(model, out / f"model-from-rank{rank}.pt")
    result["params"] = {k: v.tolist() for k, v in model.state_dict().items()}
    strategy.shutdown()
    return result


def _train_until_lost(strategy: Any, lose: Callable[[], None], lose_at: int = 3) -> dict[str, Any]:
    """Trains; rank 1 calls ``lose`` (kill or stop itself) at step ``lose_at``."""
    from clusterflow.strategies import PeerLost

    with strategy.scope():
        model = _mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _global_batches(1)[0]

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for n in range(100_000):
        if n == lose_at and strategy.rank == 1:
            lose()
        try:
            strategy.run(step)
        except PeerLost as exc:
            return {
                "error": type(exc).__name__,
                "message": str(exc),
                "ranks": list(exc.ranks),
                "tasks": [str(t) for t in exc.tasks],
                "step": n,
            }
    return {"error": None}


def scenario_kill(out: Path) -> dict[str, Any]:
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=30))
    return _train_until_lost(strategy, lambda: os.kill(os.getpid(), signal.SIGKILL))


def scenario_kill_hierarchical(out: Path) -> dict[str, Any]:
    """As ``kill``, through the hierarchical all-reduce: both replicas share one host."""
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy

    options = CommunicationOptions(timeout_seconds=30, algorithm="hierarchical")  # type: ignore[arg-type]
    strategy = MultiWorkerMirroredStrategy(options)
    result = _train_until_lost(strategy, lambda: os.kill(os.getpid(), signal.SIGKILL))
    result["buckets"] = [w.buckets for w in strategy._bucket_workers]
    return result


def scenario_stop(out: Path) -> dict[str, Any]:
    from clusterflow.strategies import CommunicationOptions, MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=4))
    return _train_until_lost(strategy, lambda: os.kill(os.getpid(), signal.SIGSTOP))


def scenario_replicas(out: Path, algorithm: str = "backend") -> dict[str, Any]:
    """Under ``--replicas-per-host``: ranks as launched, and training equal to one process."""
    from clusterflow.strategies import (
        CommunicationOptions,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
    )

    one_host = os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"]
    options = CommunicationOptions(algorithm=algorithm)  # type: ignore[arg-type]
    strategy = (
        MirroredStrategy(communication_options=options)
        if one_host
        else MultiWorkerMirroredStrategy(options)
    )
    result: dict[str, Any] = {
        "strategy": type(strategy).__name__,
        "rank": strategy.rank,
        "replicas": strategy.num_replicas_in_sync,
        "is_chief": strategy.is_chief,
        "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")},
        "task": json.loads(os.environ["TF_CONFIG"])["task"],
        "listen_fd": "CLUSTERFLOW_LISTEN_FD" in os.environ,
    }
    data = _global_batches(4)
    with strategy.scope():
        model = _mlp(seed=strategy.rank)
    reference = _mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    diffs = []
    for (x, y), mine in zip(data, strategy.distribute(data, 8), strict=True):
        strategy.run(step, mine)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        diffs.append(_max_diff(model, reference))
    result["step_diffs"] = diffs
    result["local_rows"] = len(mine[1])
    for worker in strategy._bucket_workers:
        result["buckets"] = worker.buckets
        if algorithm == "hierarchical":
            result["hosts"] = [list(h) for h in worker.reduce.hosts.ranks]  # type: ignore[attr-defined]
            result["crossed"] = worker.reduce.crossed  # type: ignore[attr-defined]
    print(f"rank {strategy.rank} trained", flush=True)
    return result


def scenario_shared_group(out: Path) -> dict[str, Any]:
    """Two strategies over one group; the owner shuts down first, while a gloo thread
    still needs the GIL: the other's shutdown must not hang.

    After the owner's shutdown the group lives on only in the other strategy's DDP
    reducer. A gloo worker thread that finishes a collective whose tensor Python let go
    of must take the GIL to drop it. Rank 1 makes that so: it submits an all-reduce,
    drops its tensor and Work, and only then lets rank 0 submit its half (through the
    store), so the collective ends in gloo's thread, which alone holds the tensor. Rank 1
    holds the GIL from then until its wrapper is dropped (a long switch interval, and a
    loop that does not block): were the group freed by the reducer, with the GIL held,
    its destructor would join that thread forever.
    """
    from clusterflow.strategies import MultiWorkerMirroredStrategy
    from clusterflow.strategies.module_scope import replica_wrapper

    owner = MultiWorkerMirroredStrategy()
    sharer = MultiWorkerMirroredStrategy()  # adopts the owner's group
    with sharer.scope():
        model = _mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _global_batches(1)[0]

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    sharer.run(step)
    owner.shutdown()
    wrapper = replica_wrapper(model)
    assert wrapper is not None
    group = wrapper.process_group
    del wrapper
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        datetime.timedelta(seconds=60),
    )
    landed = torch.ones(4)
    seen = landed.view(4).numpy()  # the same memory, through another tensor object
    if owner.rank == 0:
        store.wait(["shared-group/rank-1-submitted"])
    group.allreduce([landed])  # its Work dropped at once
    del group, landed  # ``landed``'s Python object now lives on in C++ only
    if owner.rank == 1:
        sys.setswitchinterval(600.0)
        store.set("shared-group/rank-1-submitted", "1")
        while seen[0] == 1.0:  # holds the GIL: nothing here releases it
            pass
    sharer.shutdown()
    sys.setswitchinterval(0.005)
    return {"sum": float(seen[0])}


SCENARIOS = {
    "shared-group": scenario_shared_group,
    "train": scenario_train,
    "kill": scenario_kill,
    "kill-hierarchical": scenario_kill_hierarchical,
    "stop": scenario_stop,
    "replicas": scenario_replicas,
    "replicas-hierarchical": lambda out: scenario_replicas(out, "hierarchical"),
}


def replica_main(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    # A replica still running near the test's limit prints where each thread is, so a
    # hang reads as a place, not as "still ran" (the tests wait 100 s at most).
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False)
    result = SCENARIOS[scenario](out)
    # Worker i is rank i, unless the launcher numbered several replicas per task.
    rank = os.environ.get("RANK") or json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    (out / f"result-{rank}.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------
# The tests' side


@pytest.fixture(scope="module")
def worker_addresses() -> Iterator[list[str]]:
    """TF_CONFIG's worker addresses, each port held for the module by a bound socket.

    The sockets never listen (SO_REUSEADDR): in TensorFlow's manual mode worker 0's
    replica binds its store beside the held socket, and no other process can take the
    port in between, as it could were the port found free, released and bound again.
    """
    held = []
    for _ in range(WORLD):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        held.append(sock)
    yield [f"127.0.0.1:{sock.getsockname()[1]}" for sock in held]
    for sock in held:
        sock.close()


def _clean_env() -> dict[str, str]:
    drop = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")
    }
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _tf_config(addresses: list[str], index: int) -> str:
    return json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    )


class Replicas:
    """Replica processes of one scenario; :meth:`close` kills any still running."""

    def __init__(self, scenario: str, out: Path, envs: list[dict[str, str]]) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[str]] = []
        for env in envs:
            self.procs.append(
                subprocess.Popen(
                    [PY, __file__, scenario, str(out)],
                    env={**_clean_env(), **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )

    def wait(self, rank: int, timeout: float) -> str:
        """Replica ``rank``'s output, once it exited; fails (not hangs) after ``timeout``,
        with the end of what it printed (its threads' stacks, past ``HANG_DUMP_S``)."""
        try:
            output, _ = self.procs[rank].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.procs[rank].kill()
            printed, _ = self.procs[rank].communicate(timeout=30)
            self.close()
            raise AssertionError(
                f"replica {rank} still ran after {timeout:g} s; its output ends:\n"
                f"{(printed or '')[-6000:]}"
            ) from None
        return output

    def result(self, rank: int, output: str) -> dict[str, Any]:
        path = self.out / f"result-{rank}.json"
        assert path.exists(), f"replica {rank} wrote no result; its output:\n{output}"
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            proc.communicate(timeout=30)


@pytest.fixture
def agent_store() -> Iterator[int]:
    """A TCPStore hosted here, as ``clusterflow start``'s manager hosts one: its port."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    yield int(store.port)
    del store


def _agent_envs(port: int, addresses: list[str]) -> list[dict[str, str]]:
    """The variables the manager gives worker tasks (manager/controller.py ``_job_env``).

    ``addresses`` go into TF_CONFIG; with the agent's store nothing binds them.
    """
    return [
        {
            "TF_CONFIG": _tf_config(addresses, rank),
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        for rank in range(WORLD)
    ]


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory, worker_addresses: list[str]
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """Runs the ``train`` scenario once for the tests that read its results."""
    out = tmp_path_factory.mktemp("train")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    replicas = Replicas("train", out, _agent_envs(int(store.port), worker_addresses))
    try:
        outputs = [replicas.wait(rank, 100) for rank in range(WORLD)]
        for rank, proc in enumerate(replicas.procs):
            assert proc.returncode == 0, f"replica {rank} failed:\n{outputs[rank]}"
        yield out, [replicas.result(rank, outputs[rank]) for rank in range(WORLD)]
    finally:
        replicas.close()
        del store


TOLERANCE = 1e-5  # float sums in another order: two half-batch means against one mean


@pytest.mark.timeout(150)
def test_two_replicas_match_one_process_on_the_global_batch_step_for_step(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    for result in results:
        assert result["replicas"] == WORLD
        assert result["initial_diff"] == 0.0  # rank 1's different init was overwritten
        assert result["local_rows"] == 4  # each replica computed on half the global batch
        assert len(result["step_diffs"]) == 6
        assert max(result["step_diffs"]) < TOLERANCE, result["step_diffs"]
        assert max(result["step_spreads"]) == 0.0  # replicas bit-identical
    assert [r["is_chief"] for r in results] == [True, False]


@pytest.mark.timeout(150)
def test_no_sync_accumulates_locally_then_equals_one_big_step(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    for result in results:
        assert result["no_sync_grad_spread"] > 0.0  # really not synchronised inside
        assert result["accumulate_diff"] < TOLERANCE


@pytest.mark.timeout(150)
def test_bf16_compression_trains_and_keeps_replicas_equal(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    for result in results:
        assert result["bf16_spread"] == 0.0
        assert result["bf16_chunked_diff"] == 0.0
        assert result["bf16_last_loss"] < result["bf16_first_loss"]
        # bf16 keeps 8 bits of mantissa: close to fp32 training, not equal to it.
        assert 0.0 < result["bf16_diff"] < 5e-2


@pytest.mark.timeout(150)
def test_distribute_gives_each_replica_its_contiguous_slice(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, (first, second) = trained
    assert first["map_rows"] == [[0, 1], [4, 5], [8]]
    assert second["map_rows"] == [[2, 3], [6, 7], [9]]
    assert first["iter_rows"] == [[0, 1, 2], [0, 1, 2]]
    assert second["iter_rows"] == [[3, 4, 5], [3, 4, 5]]
    for result in (first, second):
        assert "global batch size 5" in result["indivisible"]
        assert "2 replicas" in result["indivisible"]


@pytest.mark.timeout(150)
def test_reduce_sums_and_averages_across_replicas(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    for result in results:
        assert result["reduce_sum"] == 3
        assert result["reduce_mean"] == [1.0, 1.0]
        assert result["reduce_dict"] == {"n": 2, "x": 1.0}


@pytest.mark.timeout(150)
def test_a_model_made_outside_scope_is_refused_in_run(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    for result in results:
        assert "created outside strategy.scope()" in result["unscoped"]


@pytest.mark.timeout(150)
def test_save_model_writes_on_the_chief_only_and_loads_into_a_plain_module(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = trained
    assert (out / "model-from-rank0.pt").exists()
    assert not (out / "model-from-rank1.pt").exists()
    plain = _mlp(seed=99)
    plain.load_state_dict(torch.load(out / "model-from-rank0.pt", weights_only=True))
    assert type(plain) is nn.Sequential
    for name, value in plain.state_dict().items():
        assert torch.equal(value, torch.tensor(results[0]["params"][name]))


def _assert_names_lost_worker(result: dict[str, Any]) -> None:
    # Raised, not hung: the caller's wait for the process is the bound.
    assert result["error"] == "PeerLost", result
    assert result["ranks"] == [1]
    assert result["tasks"] == ["worker:1"]
    assert "rank 1 (worker:1)" in result["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["kill", "kill-hierarchical"])
def test_a_killed_replica_makes_the_other_raise_naming_it(
    tmp_path: Path, worker_addresses: list[str], scenario: str
) -> None:
    # TensorFlow's manual mode: TF_CONFIG alone; worker:0's address hosts the store.
    # Both addresses are this host's, so the hierarchical all-reduce sees one host of two.
    envs = [{"TF_CONFIG": _tf_config(worker_addresses, rank)} for rank in range(WORLD)]
    replicas = Replicas(scenario, tmp_path, envs)
    try:
        output = replicas.wait(0, 90)
        assert replicas.procs[0].returncode == 0, output
        result = replicas.result(0, output)
        _assert_names_lost_worker(result)
        # Not the 30 s timeout: a dead peer's closed socket fails the step at once.
        assert "Timed out" not in result["message"], result
        if scenario == "kill-hierarchical":
            assert result["buckets"][0] >= 3  # the steps before the loss went through it
        replicas.wait(1, 30)
        assert replicas.procs[1].returncode == -signal.SIGKILL
    finally:
        replicas.close()


@pytest.mark.timeout(120)
def test_a_hung_replica_makes_the_other_raise_within_the_timeout(
    tmp_path: Path, agent_store: int, worker_addresses: list[str]
) -> None:
    replicas = Replicas("stop", tmp_path, _agent_envs(agent_store, worker_addresses))
    try:
        output = replicas.wait(0, 90)
        assert replicas.procs[0].returncode == 0, output
        result = replicas.result(0, output)
        _assert_names_lost_worker(result)
        assert "Timed out" in result["message"]  # the group's timeout fired, not a reset
    finally:
        replicas.close()


@pytest.mark.timeout(120)
def test_a_strategy_shut_down_after_its_groups_owner_does_not_hang(
    tmp_path: Path, agent_store: int, worker_addresses: list[str]
) -> None:
    replicas = Replicas("shared-group", tmp_path, _agent_envs(agent_store, worker_addresses))
    try:
        for rank in range(WORLD):
            output = replicas.wait(rank, 90)
            assert replicas.procs[rank].returncode == 0, output
            assert replicas.result(rank, output) == {"sum": float(WORLD)}
    finally:
        replicas.close()


@pytest.mark.timeout(180)
def test_digits_example_trains_under_clusterflow_start(cf: Clusterflow, tmp_path: Path) -> None:
    saved = tmp_path / "digits.pt"
    done = cf.run(
        "start",
        "--workers",
        "2",
        "--",
        PY,
        str(ROOT / "examples" / "digits_mirrored.py"),
        "--epochs",
        "12",
        "--save",
        str(saved),
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    final = [line for line in done.stdout.splitlines() if "final test_accuracy" in line]
    assert len(final) == 1 and final[0].startswith("[worker:0]"), done.stdout  # chief only
    assert float(final[0].split()[-1]) >= 0.95
    plain = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    plain.load_state_dict(torch.load(saved, weights_only=True))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("workers", "replicas", "scenario"),
    [
        ("1", 2, "replicas"),
        ("2", 2, "replicas"),
        ("2", 2, "replicas-hierarchical"),
    ],
    ids=[
        "mirrored-1x2",
        "multi-worker-2x2",
        "multi-worker-2x2-hierarchical",
    ],
)
def test_replicas_per_host_launch_ranked_replicas_that_train_as_one_process(
    cf: Clusterflow, tmp_path: Path, workers: str, replicas: int, scenario: str
) -> None:
    done = cf.run(
        "start",
        "--workers",
        workers,
        "--replicas-per-host",
        str(replicas),
        "--",
        PY,
        __file__,
        scenario,
        str(tmp_path),
        timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    world = int(workers) * replicas
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]
    expected = "MirroredStrategy" if workers == "1" else "MultiWorkerMirroredStrategy"
    for rank, result in enumerate(results):
        task, replica = divmod(rank, replicas)
        assert result["strategy"] == expected
        assert result["rank"] == rank and result["replicas"] == world
        assert result["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(replica),
            "GROUP_RANK": str(task),
            "LOCAL_WORLD_SIZE": str(replicas),
        }
        assert result["task"] == {"type": "worker", "index": task}  # one TF_CONFIG per task
        assert result["listen_fd"] == (replica == 0)  # one server per task address
        assert result["is_chief"] == (rank == 0)
        assert result["local_rows"] == 8 // world
        assert max(result["step_diffs"]) < TOLERANCE, result["step_diffs"]
        if scenario == "replicas":
            assert "buckets" not in result  # the backend's own all-reduce
        else:
            # clusterflow's algorithm summed every bucket; without its hook none is counted
            assert result["buckets"] >= len(result["step_diffs"])  # a bucket or more a step
            assert result["buckets"] == results[0]["buckets"]
        if scenario == "replicas-hierarchical":
            # Each host's leader (its first rank) took every bucket across hosts; the
            # others only inside their host.
            assert result["hosts"] == [[0, 1], [2, 3]]
            assert result["crossed"] == (result["buckets"] if replica == 0 else 0)
        # Each replica's output is prefixed with its task and replica.
        assert f"[worker:{task}/{replica}] rank {rank} trained" in done.stdout, done.stdout


if __name__ == "__main__":
    replica_main(sys.argv[1], Path(sys.argv[2]))
