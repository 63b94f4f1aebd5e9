"""Hierarchical all-reduce over the hosts of ``--replicas-per-host`` (its hook: hooks.py).

A flat ring over N replicas takes ``2 (N-1)`` steps, each paying a link's latency, and
each step waits for the slowest replica on the ring. Where a host runs k replicas, the
bytes of a gradient bucket need not make those steps: each host first reduces its
replicas' buckets onto one replica (its leader, the host's lowest rank), the H leaders
all-reduce among themselves over the links between hosts (``2 (H-1)`` steps, H = N / k),
and each leader broadcasts the sum back inside its host. Per host, the link carries what
a flat ring over contiguous ranks puts on it (``2 (H-1)/H`` of the bucket each way), in
k times fewer steps. It is what NCCL does inside a GPU host; over gloo, clusterflow
does it here.

The hosts are the launcher's: ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as ``clusterflow
start --replicas-per-host`` and torchrun set them, each host's replicas on contiguous
ranks. Every replica checks that with the others when the groups form, and a world that
is not so laid out is refused, naming the rank that disagrees.

A bucket's three collectives run on the model's ``BucketWorker`` thread
(``collective/bucket_worker.py``), in DDP's bucket order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from clusterflow.collective.api import MembershipError

__all__ = ["HierarchicalSum", "Hosts", "hosts_of"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hosts:
    """The world's ranks by host: ``ranks[h]`` are host h's, its leader first."""

    ranks: tuple[tuple[int, ...], ...]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(host[0] for host in self.ranks)

    def host_of(self, rank: int) -> tuple[int, ...]:
        for host in self.ranks:
            if rank in host:
                return host
        raise MembershipError(f"rank {rank} is on none of the hosts {self.ranks}")


def hosts_of(places: list[tuple[int, int]]) -> Hosts:
    """Groups ranks by host from each rank's ``(LOCAL_RANK, LOCAL_WORLD_SIZE)``.

    ``places[r]`` is rank r's. A host of k replicas is k contiguous ranks whose local
    ranks are 0..k-1, as launchers number them.

    Raises:
        MembershipError: a rank whose local rank or host size does not fit that layout.
    """
    hosts: list[tuple[int, ...]] = []
    rank = 0
    while rank < len(places):
        local, size = places[rank]
        host = tuple(range(rank, rank + size))
        if local != 0 or host[-1] >= len(places):
            raise MembershipError(
                f"rank {rank} has LOCAL_RANK={local} of LOCAL_WORLD_SIZE={size}; a "
                "hierarchical all-reduce needs each host's replicas on contiguous ranks, "
                "local rank 0 first"
            )
        for r in host:
            if places[r] != (r - rank, size):
                raise MembershipError(
                    f"rank {r} has LOCAL_RANK={places[r][0]} of LOCAL_WORLD_SIZE="
                    f"{places[r][1]}, but it follows rank {rank}'s host of {size} as local "
                    f"rank {r - rank}: a hierarchical all-reduce needs each host's replicas "
                    "on contiguous ranks"
                )
        hosts.append(host)
        rank += size
    return Hosts(tuple(hosts))


class HierarchicalSum:
    """The groups of one world, and the sum of a bucket over them, host by host.

    Form it on every replica at once (it creates process groups, which every rank of the
    world must do together), after the default group exists.

    Args:
        local_rank, local_world_size: this replica's place on its host.
        timeout_seconds: the groups' collective timeout (None: torch's default).
    """

    def __init__(
        self, local_rank: int, local_world_size: int, timeout_seconds: float | None
    ) -> None:
        timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        places: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(places, (local_rank, local_world_size))
        self.hosts = hosts_of([tuple(p) for p in places])  # type: ignore[arg-type, misc]
        self.rank = dist.get_rank()
        host = self.hosts.host_of(self.rank)
        self.leader = host[0]
        self.local: ProcessGroup | None = None
        for ranks in self.hosts.ranks:  # every rank creates every group, in one order
            group = dist.new_group(list(ranks), timeout=timeout)
            if ranks == host and len(ranks) > 1:
                self.local = group
        cross = dist.new_group(list(self.hosts.leaders), timeout=timeout)
        self.cross: ProcessGroup | None = None
        if self.rank == self.leader and len(self.hosts.leaders) > 1:
            self.cross = cross
        self.crossed = 0
        """Buckets this replica all-reduced across hosts (a leader's count, else 0)."""
        _log.info(
            "hierarchical all-reduce: %d hosts of %s replicas; this is rank %d, leader %d",
            len(self.hosts.ranks),
            "/".join(str(len(h)) for h in self.hosts.ranks),
            self.rank,
            self.leader,
        )

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` in place over every replica (blocking)."""
        if self.local is not None:
            dist.reduce(tensor, dst=self.leader, group=self.local)
        if self.cross is not None:
            dist.all_reduce(tensor, group=self.cross)
            self.crossed += 1
        if self.local is not None:
            dist.broadcast(tensor, src=self.leader, group=self.local)
