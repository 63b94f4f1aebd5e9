"""The shared-memory link's ring and its matching, in one process
(``strategies/pipeline/shm_link.py``): the peer's end is played here by writing frames
into the link's incoming ring directly, so each order is exact, not raced.

* frames of every size wrap around the ring's end and read back as written;
* a frame read while no receive was posted for it (a send waiting for room reads the
  peer's frames meanwhile) keeps its place ahead of frames read later, after receives
  were posted: each receive gets the frame of its own position;
* every frame written or read rings the bell the peer sleeps on.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from clusterflow.strategies.pipeline.shm_link import (
    _COUNTERS,
    RING_BYTES,
    ShmLink,
    _as_bytes,
    _Channel,
    _Ring,
)

pytestmark = pytest.mark.timeout(60)


def _memfd() -> int:
    fd = os.memfd_create("test-ring", os.MFD_CLOEXEC)
    os.ftruncate(fd, _COUNTERS + RING_BYTES)
    return fd


@pytest.fixture
def link() -> Iterator[tuple[ShmLink, _Channel, _Ring, _Ring]]:
    """A link to "rank 1", and rank 1's ends of the two rings: the one it writes this
    link's frames into, the one it reads this link's frames from."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outgoing, incoming = _memfd(), _memfd()
    channel = _Channel(1, mine, _Ring(outgoing), _Ring(incoming))
    peer_writes, peer_reads = _Ring(incoming), _Ring(outgoing)
    os.close(outgoing)
    os.close(incoming)
    mine.setblocking(False)
    link = ShmLink({1: channel}, timeout_s=5.0, rank=0)
    try:
        yield link, channel, peer_writes, peer_reads
    finally:
        link.close()
        peer_writes.close()
        peer_reads.close()
        theirs.close()


def _receive(buffer: torch.Tensor) -> Any:
    """A receive from rank 1, as torch's ``P2POp`` carries it (one needs a group)."""
    return SimpleNamespace(op=dist.irecv, tensor=buffer, group_peer=1, tag=0)


def _frame(index: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000 * index


def test_frames_of_every_size_wrap_around_the_ring_and_read_back_as_written() -> None:
    fd = _memfd()
    writer, reader = _Ring(fd), _Ring(fd)
    os.close(fd)
    try:
        sizes = [1, 17, 4093, 65536, 100003, 3, 250000]  # bytes; none divides the ring
        wrapped = 0
        for i in range(200):
            payload = _as_bytes(_frame(i, sizes[i % len(sizes)] // 4 + 1))
            assert writer.free() >= writer.room(payload.numel())
            before = writer.written
            writer.put(7, payload)
            wrapped += (writer.written - 1) // RING_BYTES != before // RING_BYTES
            assert reader.ready()
            tag, got, after = reader.take()
            assert tag == 7 and torch.equal(got, payload)
            reader.release(after)
            assert not reader.ready() and writer.free() == RING_BYTES
        assert wrapped >= 10  # the ring's end was crossed, many times
    finally:
        writer.close()
        reader.close()


def test_a_frame_read_before_its_receive_keeps_its_place(
    link: tuple[ShmLink, _Channel, _Ring, _Ring],
) -> None:
    shm, channel, peer, _ = link
    frames = [_frame(i, 64) for i in range(4)]
    for frame in frames[:2]:
        peer.put(0, _as_bytes(frame))
    for _ in range(2):  # read while no receive is posted: kept aside, in order
        shm._read_one(channel)
    buffers = [torch.empty(64) for _ in frames]
    works = shm.batch([_receive(buffers[0])])
    peer.put(0, _as_bytes(frames[2]))
    shm._read_one(channel)  # a later frame, read with a receive posted: not that one's
    works += shm.batch([_receive(b) for b in buffers[1:]])
    peer.put(0, _as_bytes(frames[3]))
    for work in works:
        work.wait()
    for i, (got, sent) in enumerate(zip(buffers, frames, strict=True)):
        assert torch.equal(got, sent), f"receive {i} got another frame"


def test_every_frame_sent_or_read_rings_the_peers_bell(
    link: tuple[ShmLink, _Channel, _Ring, _Ring],
) -> None:
    """The peer sleeps on the bell of the ring this link writes: it must move after
    each frame written (the peer may wait for it) and each frame read (the peer may
    wait for room), after the state it announces. Without it the peer would sleep out
    its whole slice before looking again."""
    shm, _, peer_writes, peer_reads = link
    bell = peer_reads.bell
    shm.batch([SimpleNamespace(op=dist.isend, tensor=_frame(0, 16), group_peer=1, tag=0)])
    assert peer_reads.bell == bell + 1 and peer_reads.ready()
    peer_writes.put(0, _as_bytes(_frame(1, 16)))
    buffer = torch.empty(16)
    shm.batch([_receive(buffer)])[0].wait()
    assert torch.equal(buffer, _frame(1, 16))
    assert peer_reads.bell == bell + 2 and peer_writes.free() == RING_BYTES
