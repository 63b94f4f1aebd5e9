"""Recursive halving-doubling all-reduce over gloo's point-to-point sends.

gloo's ring all-reduce, which torch's ``ProcessGroupGloo`` runs, takes ``2 (N-1)``
steps for N replicas, each a hop between neighbours; where a hop costs more than the
bytes it moves (small buckets, many replicas, latency between hosts), the step count is
what a bucket waits for. Halving-doubling moves the same bytes per replica
(``2 (N-1)/N`` of the bucket each way) in ``2 log2 N`` steps: in the reduce-scatter half,
each replica swaps half of its current segment with a partner at distance N/2, N/4, ...,
1 and adds what it received; then each holds 1/N of the sum and the all-gather half
swaps segments back in reverse order. Partners differ in one bit of their rank, so
every step pairs all replicas at once, as on a switched network with full bisection.

A world that is not a power of two folds first: each replica above the largest power
of two P hands its bucket to replica ``r - P``, which adds it, and gets the sum back at
the end (two more steps for those pairs).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

__all__ = ["HalvingDoublingSum", "halving_doubling_sum"]


def _swap(send: torch.Tensor, recv: torch.Tensor, peer: int, group: ProcessGroup | None) -> None:
    """Sends ``send`` to and receives ``recv`` from the same peer, both at once."""
    ops = [
        dist.P2POp(dist.isend, send, peer, group),
        dist.P2POp(dist.irecv, recv, peer, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def halving_doubling_sum(
    flat: torch.Tensor, rank: int, world: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Sums the 1-D ``flat`` over the ``world`` ranks of ``group`` in place and returns it.

    ``rank`` is this replica's rank in ``group``; peers are addressed by their rank in
    the default group, so ``group`` must span the whole world in rank order (None: the
    default group itself).
    """
    if world == 1:
        return flat
    if flat.numel() < world:  # segments would be empty: too small to be worth halving
        dist.all_reduce(flat, group=group)
        return flat
    power = 1 << (world.bit_length() - 1)
    extra = world - power
    if rank >= power:  # folded: hand the bucket over, take the sum back
        dist.send(flat, rank - power, group)
        dist.recv(flat, rank - power, group)
        return flat
    if rank < extra:
        scratch = torch.empty_like(flat)
        dist.recv(scratch, rank + power, group)
        flat.add_(scratch)
    lo, hi = 0, flat.numel()
    steps: list[tuple[int, int, int]] = []  # (peer, segment lo, hi) before each halving
    scratch = torch.empty(flat.numel() - flat.numel() // 2, dtype=flat.dtype)
    distance = power >> 1
    while distance:
        peer = rank ^ distance
        mid = (lo + hi) // 2
        if rank & distance:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        got = scratch[: keep[1] - keep[0]]
        _swap(flat[give[0] : give[1]], got, peer, group)
        flat[keep[0] : keep[1]].add_(got)
        steps.append((peer, lo, hi))
        lo, hi = keep
        distance >>= 1
    for peer, whole_lo, whole_hi in reversed(steps):
        mid = (whole_lo + whole_hi) // 2
        mine = (lo, hi)
        theirs = (mid, whole_hi) if mine == (whole_lo, mid) else (whole_lo, mid)
        _swap(flat[mine[0] : mine[1]], flat[theirs[0] : theirs[1]], peer, group)
        lo, hi = whole_lo, whole_hi
    if rank < extra:
        dist.send(flat, rank + power, group)
    return flat


class HalvingDoublingSum:
    """The sum of a bucket over the world by halving-doubling, on a group of its own.

    Form it on every replica at once (``new_group`` is collective), after the default
    group exists. Its own group keeps its sends apart from DDP's collectives.
    """

    def __init__(self, timeout_seconds: float | None) -> None:
        timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(list(range(self.world)), timeout=timeout)

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` in place over every replica (blocking)."""
        halving_doubling_sum(tensor.view(-1), self.rank, self.world, self.group)
