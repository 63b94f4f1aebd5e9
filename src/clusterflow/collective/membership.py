"""Who the replicas are: this process's rank, the world, the rendezvous address, as a value.

Read from the environment that ``clusterflow start`` (or torchrun) injects and from the
cluster spec, and checked against each other before any socket opens: a launcher and a
spec that disagree would otherwise meet as a rendezvous that waits forever. Pure logic,
no torch, so every rule is unit-tested on plain values.

Ranks follow the order the manager assigns them (docs/architecture.md section 3): the chief
first when there is one, then the workers by index; ``ps`` and ``evaluator`` tasks are not
replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from clusterflow.cluster import ClusterSpec, TaskId, parse_address
from clusterflow.cluster.contract import ENV_SPEC_VERSION, Torchrun
from clusterflow.collective.api import MembershipError

__all__ = ["REPLICA_JOBS", "Membership"]

REPLICA_JOBS = ("chief", "worker")
"""The jobs whose tasks compute gradients, so take part in the all-reduce."""

_TRUE = ("1", "true", "yes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Membership:
    """This replica's place in the group of replicas.

    Raises:
        MembershipError: on construction, for a rank or local rank out of range.
    """

    rank: int
    """This replica's rank, 0 .. world_size - 1; rank 0 broadcasts the initial weights."""
    world_size: int
    """How many replicas take part."""
    local_rank: int = 0
    """This replica's index among the replicas of its host (picks its GPU)."""
    local_world_size: int = 1
    """How many replicas its host runs."""
    master_addr: str | None = None
    """Host of the rendezvous store (torch's ``MASTER_ADDR``); None for a single replica."""
    master_port: int | None = None
    """Port of the rendezvous store (torch's ``MASTER_PORT``)."""
    store_host: int | None = None
    """The rank that hosts the store (0), or None when a launcher's agent hosts it."""
    tasks: tuple[TaskId, ...] | None = None
    """The task of each rank, where a cluster spec says; None under a bare torchrun."""
    generation: str = "0"
    """Tells this incarnation of the cluster from earlier ones sharing the same store."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise MembershipError(
                f"rank {self.rank} is outside a world of {self.world_size} replicas"
            )
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise MembershipError(
                f"local rank {self.local_rank} is outside a host of "
                f"{self.local_world_size} replicas"
            )
        if self.local_world_size > self.world_size:
            raise MembershipError(
                f"LOCAL_WORLD_SIZE={self.local_world_size} exceeds WORLD_SIZE={self.world_size}"
            )
        if self.tasks is not None and len(self.tasks) != self.world_size:
            raise MembershipError(
                f"{len(self.tasks)} replica tasks for a world of {self.world_size} replicas"
            )
        if self.store_host is not None and not 0 <= self.store_host < self.world_size:
            raise MembershipError(f"store host rank {self.store_host} is not a replica")

    @property
    def hosts_store(self) -> bool:
        """Whether this process must host the rendezvous store."""
        return self.store_host == self.rank

    @property
    def task(self) -> TaskId | None:
        """This replica's task, where known."""
        return self.task_of(self.rank)

    def task_of(self, rank: int) -> TaskId | None:
        """The task of ``rank``, or None when no spec names it."""
        if self.tasks is None or not 0 <= rank < len(self.tasks):
            return None
        return self.tasks[rank]

    def describe(self, rank: int) -> str:
        """``"rank 1 (worker:1)"``, or ``"rank 1"`` when the task is unknown."""
        task = self.task_of(rank)
        return f"rank {rank}" if task is None else f"rank {rank} ({task})"

    @classmethod
    def single(cls) -> Membership:
        """A lone replica: no group, no store."""
        return cls(rank=0, world_size=1)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        spec: ClusterSpec | None = None,
        task: TaskId | None = None,
    ) -> Membership:
        """The membership that ``environ`` and the cluster spec describe together.

        With a spec, the ranks come from it (chief, then workers) and torchrun's variables,
        where set, must agree; without ``MASTER_ADDR``/``MASTER_PORT`` (TensorFlow's manual
        mode) the chief's address hosts the store. Without a spec, torchrun's variables
        alone; with neither, a single replica.

        Raises:
            MembershipError: the variables are malformed, or disagree with the spec, or
                this task is not a replica (a ``ps`` or ``evaluator`` task).
        """
        env_rank = _int_var(environ, Torchrun.RANK)
        env_world = _int_var(environ, Torchrun.WORLD_SIZE)
        if (env_rank is None) != (env_world is None):
            raise MembershipError(
                "RANK and WORLD_SIZE must be set together; got "
                f"RANK={environ.get(Torchrun.RANK)!r}, "
                f"WORLD_SIZE={environ.get(Torchrun.WORLD_SIZE)!r}"
            )
        generation = (
            f"{environ.get(ENV_SPEC_VERSION, '0')}.{environ.get(Torchrun.RESTART_COUNT, '0')}"
        )
        agent_store = environ.get(Torchrun.USE_AGENT_STORE, "").lower() in _TRUE
        master = _master(environ)
        if spec is None:
            if env_rank is None or env_world is None:
                return cls.single()
            local_rank, local_world = _local(environ, env_rank, env_world)
            return cls(
                rank=env_rank,
                world_size=env_world,
                local_rank=local_rank,
                local_world_size=local_world,
                master_addr=master[0] if master else None,
                master_port=master[1] if master else None,
                store_host=None if agent_store else 0,
                generation=generation,
            )
        replicas = tuple(t for t in spec.tasks() if t.job in REPLICA_JOBS)
        if not replicas:
            raise MembershipError(
                f"the cluster spec has no chief or worker task to replicate on: {spec!r}"
            )
        if task is None:
            if len(replicas) > 1:
                raise MembershipError(
                    f"the cluster has {len(replicas)} replica tasks but TF_CONFIG names no "
                    "task for this process: set TF_CONFIG's 'task'"
                )
            task = replicas[0]
        if task not in replicas:
            raise MembershipError(
                f"task {task} is not a replica: all-reduce strategies run on chief and worker "
                "tasks only (ps and evaluator tasks do not take part)"
            )
        rank, world, per_task = _rank_in_spec(replicas, task, env_rank, env_world)
        if master is None:
            # TensorFlow's manual mode: every task knows only TF_CONFIG, and the chief's
            # address is where the group meets.
            master = parse_address(spec.task_address(replicas[0].job, replicas[0].index))
            agent_store = False
        if Torchrun.LOCAL_RANK in environ or Torchrun.LOCAL_WORLD_SIZE in environ:
            local_rank, local_world = _local(environ, rank, world)
        else:
            local_rank, local_world = _local_from_spec(spec, replicas, task)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            master_addr=master[0],
            master_port=master[1],
            store_host=None if agent_store else 0,
            tasks=tuple(t for t in replicas for _ in range(per_task)),
            generation=generation,
        )


def _rank_in_spec(
    replicas: tuple[TaskId, ...], task: TaskId, env_rank: int | None, env_world: int | None
) -> tuple[int, int, int]:
    """This task's rank, the world size, and how many replicas (processes) each task runs.

    One replica per task, unless the launcher's ``WORLD_SIZE`` is a multiple ``k`` of the
    replica tasks: then each task runs ``k`` processes (one per device, as
    ``--replicas-per-host`` will launch them) with contiguous ranks, task ``i`` holding
    ranks ``i*k .. i*k+k-1``, as torchrun numbers ``nproc_per_node`` processes per node.
    """
    position, tasks = replicas.index(task), len(replicas)
    world = tasks if env_world is None else env_world
    if world % tasks:
        raise MembershipError(
            f"WORLD_SIZE={world} but the cluster spec has {tasks} replica tasks "
            f"({', '.join(map(str, replicas))}), and {world} is not a multiple of {tasks}; "
            "the launcher and TF_CONFIG disagree"
        )
    per_task = world // tasks
    if env_rank is None:  # then WORLD_SIZE is unset too (they come together): one per task
        return position, world, per_task
    if env_rank // per_task != position:
        first = position * per_task
        ranks = f"rank {first}" if per_task == 1 else f"ranks {first}..{first + per_task - 1}"
        raise MembershipError(
            f"RANK={env_rank} but task {task} is {ranks} in the cluster spec (chief first, "
            "then workers by index); the launcher and TF_CONFIG disagree"
        )
    return env_rank, world, per_task


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise MembershipError(f"{name}={text!r} is not an integer") from None
    if value < 0:
        raise MembershipError(f"{name}={text!r} is negative")
    return value


def _master(environ: Mapping[str, str]) -> tuple[str, int] | None:
    addr, port = environ.get(Torchrun.MASTER_ADDR), _int_var(environ, Torchrun.MASTER_PORT)
    if not addr and port is None:
        return None
    if not addr or port is None or not 0 < port < 65536:
        raise MembershipError(
            "MASTER_ADDR and MASTER_PORT must be set together, the port in 1..65535; got "
            f"MASTER_ADDR={environ.get(Torchrun.MASTER_ADDR)!r}, "
            f"MASTER_PORT={environ.get(Torchrun.MASTER_PORT)!r}"
        )
    return addr, port


def _local(environ: Mapping[str, str], rank: int, world: int) -> tuple[int, int]:
    local_rank = _int_var(environ, Torchrun.LOCAL_RANK)
    local_world = _int_var(environ, Torchrun.LOCAL_WORLD_SIZE)
    if local_rank is None and local_world is None:
        # torchrun always sets both; a launcher that sets neither runs one replica a host.
        return 0, 1
    if local_rank is None or local_world is None:
        raise MembershipError(
            "LOCAL_RANK and LOCAL_WORLD_SIZE must be set together; got "
            f"LOCAL_RANK={environ.get(Torchrun.LOCAL_RANK)!r}, "
            f"LOCAL_WORLD_SIZE={environ.get(Torchrun.LOCAL_WORLD_SIZE)!r}"
        )
    if local_world > world:
        raise MembershipError(f"LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world}")
    return local_rank, local_world


def _local_from_spec(
    spec: ClusterSpec, replicas: tuple[TaskId, ...], task: TaskId
) -> tuple[int, int]:
    """Replicas sharing this task's host, by their spec addresses (manual mode)."""
    host = parse_address(spec.task_address(task.job, task.index))[0].lower()
    same_host = [
        t for t in replicas if parse_address(spec.task_address(t.job, t.index))[0].lower() == host
    ]
    return same_host.index(task), len(same_host)
