"""The GPU path, tested without a GPU (docs/gpu.md).

What does not need a device is tested here: the pinned host buffers a ps worker moves
its device tensors through (CPU tensors stand in for CUDA ones: ``HostStaging`` is told
to stage them, unpinned), the collective backend a replica's group asks torch for, and
the device each replica takes from ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from clusterflow.collective import group as group_module
from clusterflow.collective.api import CollectiveError, CommunicationOptions
from clusterflow.collective.group import CollectiveGroup, select_device
from clusterflow.collective.membership import Membership
from clusterflow.ps.api import Shard, VariableSpec
from clusterflow.ps.local import LocalPS
from clusterflow.strategies import SimpleClusterResolver
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.strategies.parameter_server.shards import TrackedVar, gradients, load_into
from clusterflow.strategies.parameter_server.staging import HostStaging

pytestmark = pytest.mark.timeout(60)


def stand_in() -> HostStaging:
    """Stages every tensor, unpinned: CPU tensors play the part of CUDA ones."""
    return HostStaging(stage=lambda t: True, pin=False)


def tracked(name: str, rows: int, cols: int, *, shards: int = 1) -> TrackedVar:
    tensor = torch.zeros(rows, cols, requires_grad=True)
    spec = VariableSpec(name=name, shape=(rows, cols), dtype="float32")
    cut = [round(i * rows / shards) for i in range(shards + 1)]
    parts = tuple(
        Shard(
            variable=name,
            name=name if shards == 1 else f"{name}/part_{i}",
            ps=i,
            start=cut[i],
            stop=cut[i + 1],
            shape=(cut[i + 1] - cut[i], cols),
        )
        for i in range(shards)
    )
    return TrackedVar(tensor, spec, parts)


def test_device_tensors_are_staged_and_host_tensors_are_not() -> None:
    staging = HostStaging(pin=False)
    host = torch.ones(3)
    assert staging.to_host("w", host) is host  # the wire views host memory as it is
    assert staging.allocations == 0
    meta = torch.empty(3, device="meta")
    assert HostStaging(pin=False)._stage(meta)  # any device but the CPU is staged


def test_push_buffers_are_allocated_once_and_reused_every_other_step() -> None:
    staging = stand_in()
    vars_ = [tracked("a", 4, 3), tracked("b", 6, 2, shards=2)]
    seen: list[dict[str, int]] = []
    for step in range(6):
        for var in vars_:
            var.tensor.grad = torch.full_like(var.tensor, float(step + 1))
        per_ps = gradients(vars_, 2, "float32", staging)
        for var in vars_:
            for shard in var.shards:
                got = per_ps[shard.ps][shard.name]
                assert torch.equal(got, var.tensor.grad[shard.start : shard.stop])
                assert got is not var.tensor.grad  # a staged copy, not the gradient
        seen.append({k: t.data_ptr() for ps in per_ps for k, t in ps.items()})
    # Two slots of three shards, allocated in the first two steps, then only reused.
    assert staging.allocations == 6
    assert seen[0] == seen[2] == seen[4] and seen[1] == seen[3] == seen[5]
    assert set(seen[0].values()).isdisjoint(seen[1].values())  # a push in flight keeps its own


def test_bf16_compression_stages_the_cast_gradient() -> None:
    staging = stand_in()
    var = tracked("w", 5, 4)
    var.tensor.grad = torch.linspace(-1, 1, 20).reshape(5, 4)
    for _ in range(3):
        got = gradients([var], 1, "bfloat16", staging)[0]["w"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, var.tensor.grad.to(torch.bfloat16))
    assert staging.allocations == 2  # half the bytes per copy, and still no new buffers


def test_pulled_values_reach_the_tensors_through_one_reused_buffer_each() -> None:
    staging = stand_in()
    vars_ = [tracked("a", 4, 3), tracked("b", 6, 2, shards=2)]
    for step in range(4):
        values = {
            "a": torch.full((4, 3), float(step)),
            "b/part_0": torch.full((3, 2), step + 0.5),
            "b/part_1": torch.full((3, 2), step + 0.25),
        }
        load_into(vars_, values, staging)
        assert torch.equal(vars_[0].tensor.detach(), values["a"])
        assert torch.equal(vars_[1].tensor.detach()[:3], values["b/part_0"])
        assert torch.equal(vars_[1].tensor.detach()[3:], values["b/part_1"])
    # one per shard: each shard goes into its rows of the tensor, never joined on the host
    assert staging.allocations == 3


def resolver() -> Any:
    spec = {"worker": ["127.0.0.1:2000"], "ps": ["127.0.0.1:3000"]}
    return SimpleClusterResolver(spec, task_type="worker", task_id=0)


def train(staging: HostStaging | None) -> tuple[list[torch.Tensor], ParameterServerStrategy]:
    strategy = ParameterServerStrategy(resolver(), _connection=LocalPS(), mode="sync")
    if staging is not None:
        strategy._staging = staging
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for i in range(5):
        g = torch.Generator().manual_seed(i)
        strategy.run(step, (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)))
    strategy.pull_values()
    values = [p.detach().clone() for p in model.parameters()]
    strategy.close()
    return values, strategy


def test_the_strategy_pushes_and_pulls_through_its_staging_with_no_allocation_per_step() -> None:
    plain, _ = train(None)
    staging = stand_in()
    staged, _ = train(staging)
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a, b)
    # 4 variables: two push slots and one pull buffer each, however many steps ran.
    assert staging.allocations == 4 * 3


@pytest.mark.parametrize(("device", "backend"), [("cuda:0", "nccl"), ("cpu", "gloo")])
def test_a_replica_group_asks_torch_for_nccl_on_cuda_and_gloo_on_cpu(
    monkeypatch: pytest.MonkeyPatch, device: str, backend: str
) -> None:
    asked: dict[str, Any] = {}

    def init(backend: str, **kwargs: Any) -> None:
        asked["backend"], asked["device_id"] = backend, kwargs.get("device_id")
        raise RuntimeError("stop here: the choice is what is tested")

    monkeypatch.setattr(group_module, "connect_store", lambda m, t: torch.distributed.HashStore())
    monkeypatch.setattr(group_module.dist, "init_process_group", init)
    membership = Membership(
        rank=0,
        world_size=2,
        local_rank=0,
        local_world_size=2,
        master_addr="127.0.0.1",
        master_port=1,
    )
    with pytest.raises(CollectiveError):
        CollectiveGroup.form(membership, CommunicationOptions(), torch.device(device))
    assert asked["backend"] == backend
    assert asked["device_id"] == (torch.device(device) if backend == "nccl" else None)


@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [
        ("0,1,2,3", 3, "cuda:3"),  # torchrun's way: every GPU visible, LOCAL_RANK picks
        ("5", 3, "cuda:0"),  # the supervisor's way: one visible GPU per replica
        ("2,3", 3, "cuda:1"),  # fewer GPUs than replicas: they share, round robin
        ("", 1, "cpu"),  # none visible: the CPU
    ],
)
def test_each_replica_takes_its_device_from_local_rank_and_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, local_rank: int, expected: str
) -> None:
    # The driver's view: CUDA_VISIBLE_DEVICES decides what torch can see.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    count = len([d for d in visible.split(",") if d])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    membership = Membership(
        rank=local_rank, world_size=4, local_rank=local_rank, local_world_size=4
    )
    assert select_device(membership) == torch.device(expected)
