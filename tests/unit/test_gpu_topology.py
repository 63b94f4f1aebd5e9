"""GPU choice by topology, on matrices in the format of ``nvidia-smi topo -m``.

DGX1 is NVIDIA's published DGX-1 (V100) hybrid cube-mesh, as ``nvidia-smi topo -m``
prints it (NIC columns and CPU affinity included); PCIE is a 4-GPU server with two PCIe
switches; A100_BOX an 8-GPU NVSwitch machine (every pair NV12). Nothing here has a GPU.
"""

from __future__ import annotations

import pytest

from clusterflow.backends.gpu_topology import choose, parse_topology, replica_devices, split
from clusterflow.backends.local import LocalBackend
from clusterflow.cluster import TaskId
from clusterflow.manager.config import RunConfig

DGX1_HEADER = (  # underlined on a terminal: the escapes are part of the record
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7"
    "\tmlx5_0\tmlx5_2\tmlx5_1\tmlx5_3\tCPU Affinity\x1b[0m\n"
)
DGX1 = (
    DGX1_HEADER
    + """\
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\tSYS\tPHB\tSYS\t0-19,40-59
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\tSYS\tPHB\tSYS\t0-19,40-59
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\tSYS\tPIX\tSYS\t0-19,40-59
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\tSYS\tPIX\tSYS\t0-19,40-59
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\tPIX\tSYS\tPHB\t20-39,60-79
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\tPIX\tSYS\tPHB\t20-39,60-79
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\tPHB\tSYS\tPIX\t20-39,60-79
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\tPHB\tSYS\tPIX\t20-39,60-79
mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X \tSYS\tPHB\tSYS
mlx5_2\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tPHB\tPHB\tSYS\t X \tSYS\tPHB

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""
)

PCIE = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PIX     SYS     SYS     0-11    0               N/A
GPU1    PIX      X      SYS     SYS     0-11    0               N/A
GPU2    SYS     SYS      X      PIX     12-23   1               N/A
GPU3    SYS     SYS     PIX      X      12-23   1               N/A
"""

A100_BOX = (
    "\t"
    + "\t".join(f"GPU{i}" for i in range(8))
    + "\tCPU Affinity\n"
    + "".join(
        f"GPU{r}\t" + "\t".join(" X " if r == c else "NV12" for c in range(8)) + "\t0-63\n"
        for r in range(8)
    )
)


def test_the_matrix_holds_gpu_pairs_only() -> None:
    links = parse_topology(DGX1)
    assert links[(0, 3)] == "NV2" and links[(0, 5)] == "SYS" and links[(4, 6)] == "NV1"
    assert len(links) == 8 * 7  # no self, no NIC, no affinity column
    assert parse_topology(PCIE)[(2, 3)] == "PIX"


def test_no_matrix_is_an_error() -> None:
    with pytest.raises(ValueError, match="no GPU matrix"):
        parse_topology("NVIDIA-SMI has failed because it couldn't communicate with the driver")


@pytest.mark.parametrize(
    ("matrix", "visible", "n", "chosen"),
    [
        (DGX1, range(8), 2, [0, 3]),  # a double NVLink first
        (DGX1, range(8), 4, [0, 1, 2, 3]),  # a fully NVLinked quad, not across sockets
        (DGX1, [0, 5, 6], 2, [5, 6]),  # NV2 over two SYS links
        (DGX1, [1, 2, 4, 7], 2, [1, 2]),
        (PCIE, range(4), 2, [0, 1]),
        (PCIE, [1, 2, 3], 2, [2, 3]),  # the pair behind one switch
        (A100_BOX, range(8), 3, [0, 1, 2]),  # all alike: the lowest ids
    ],
)
def test_the_best_connected_gpus_are_chosen(
    matrix: str, visible: range | list[int], n: int, chosen: list[int]
) -> None:
    assert choose(parse_topology(matrix), list(visible), n) == chosen


def test_more_gpus_than_visible_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 GPUs wanted, 2 visible"):
        choose(parse_topology(PCIE), [0, 1], 3)


def test_each_replica_gets_one_of_the_tasks_best_gpus() -> None:
    dgx = parse_topology(DGX1)
    # Ray assigned four GPUs to the task: its two replicas take the NV2 pair among them.
    assert replica_devices({"CUDA_VISIBLE_DEVICES": "4,0,5,1"}, 2, dgx) == ["0", "4"]
    # Nothing set (the local backend): every GPU of the machine is a candidate.
    assert replica_devices({}, 4, dgx) == ["0", "1", "2", "3"]
    # Without nvidia-smi the visible ones are taken in order.
    assert replica_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, 2, None) == ["2", "3"]


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "GPU-8a1f,GPU-77c2"},  # UUIDs: left alone
        {"CUDA_VISIBLE_DEVICES": "0"},  # fewer GPUs than replicas: they share, as before
        {"CUDA_VISIBLE_DEVICES": ""},
    ],
)
def test_what_cannot_be_split_is_left_alone(env: dict[str, str]) -> None:
    assert replica_devices(env, 2, parse_topology(DGX1)) is None


def test_a_machine_without_gpus_changes_nothing() -> None:
    assert replica_devices({}, 2, None) is None


# Between tasks on the local backend (LocalBackend.split_gpus) ------------------------------


def test_tasks_get_disjoint_groups_each_the_best_connected_of_what_is_left() -> None:
    dgx = parse_topology(DGX1)
    # Two 4-replica tasks on a DGX-1: one NVLinked quad per socket, never across.
    assert split(dgx, list(range(8)), [4, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Four 2-replica tasks: each a double-NVLink pair.
    pairs = split(dgx, list(range(8)), [2, 2, 2, 2])
    assert pairs == [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert all(dgx[(a, b)] == "NV2" for a, b in pairs)
    # Two tasks on the PCIe box: each the pair behind one switch.
    assert split(parse_topology(PCIE), [0, 1, 2, 3], [2, 2]) == [[0, 1], [2, 3]]


def test_too_few_gpus_for_every_task_is_an_error() -> None:
    with pytest.raises(ValueError, match="6 GPUs wanted, 4 visible"):
        split(parse_topology(PCIE), [0, 1, 2, 3], [2, 4])


def test_the_local_backend_gives_each_task_its_gpus_in_its_job_env() -> None:
    worker = [TaskId("worker", i) for i in range(2)]
    backend = LocalBackend.split_gpus(
        [(worker[0], 2), (worker[1], 2)], env={}, topology=parse_topology(PCIE)
    )
    assert backend.job_env(worker[0]) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert backend.job_env(worker[1]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert backend.job_env(TaskId("ps", 0)) == {}  # not asked: sees what the manager sees
    # Within a task the supervisor then gives each replica one of them (as on Ray).
    assert replica_devices(backend.job_env(worker[1]), 2, parse_topology(PCIE)) == ["2", "3"]
    # The manager's own CUDA_VISIBLE_DEVICES bounds what is split (ids as the machine's).
    limited = LocalBackend.split_gpus(
        [(worker[0], 2), (worker[1], 2)],
        env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
        topology=parse_topology(DGX1),
    )
    assert limited.gpus == {"worker:0": "4,7", "worker:1": "5,6"}


@pytest.mark.parametrize(
    ("env", "topology"),
    [
        ({}, None),  # no GPUs (no nvidia-smi)
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, PCIE),  # too few for 2 x 2: shared, as before
        ({"CUDA_VISIBLE_DEVICES": "GPU-8a1f,GPU-77c2,GPU-1,GPU-2"}, PCIE),  # UUIDs
    ],
)
def test_what_cannot_be_split_between_tasks_is_shared_as_before(
    env: dict[str, str], topology: str | None
) -> None:
    wants = [(TaskId("worker", 0), 2), (TaskId("worker", 1), 2)]
    links = parse_topology(topology) if topology else None
    backend = LocalBackend.split_gpus(wants, env=env, topology=links)
    assert backend.gpus == {}


def test_only_tasks_with_several_replicas_take_gpus_of_their_own() -> None:
    config = RunConfig(command=("python",), ps=1, workers=2, replicas_per_host=2)
    assert config.gpu_hosts() == [(TaskId("worker", 0), 2), (TaskId("worker", 1), 2)]
    assert RunConfig(command=("python",), workers=2).gpu_hosts() == []
