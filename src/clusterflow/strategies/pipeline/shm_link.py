"""Stage-to-stage transfers through shared memory, between ranks on one host.

Why: gloo carries a pipeline's activations and gradients over loopback TCP through its
own threads. On the 2-core machine a round trip of two 64 KiB messages took 363-693 us,
with 55-135 us of the caller's CPU and 134-453 us of gloo's threads on each side
(docs/benchmarks.md, "Pipeline: stages on one host share memory"); in a step of
``benchmarks.pipeline`` sixteen such messages leave or reach each stage, and gloo's
threads run on the cores the stages compute on.

Here each direction between two neighbouring ranks is a ring of shared memory that
both map (a ``memfd`` the reader creates and hands over its socket, so no name is left
behind in ``/dev/shm`` by a crash). A send copies the tensor into the ring and wakes
the reader; a receive's ``wait`` copies it out into the posted buffer. No thread of
ours, no copy through the kernel: one copy on each side and a futex wake-up each way.

The rules that make it equal to gloo's path, bit for bit:

* **Order.** Frames in a ring are read in the order they were written, and matched to
  the receives in the order they were posted, as gloo matches one tag between two
  ranks; the pipeline posts and sends in that order on both ends (torch's lowering).
  A frame names its tag and byte count; a receive whose buffer differs raises.
* **Who takes which path.** A message over ``LARGEST`` bytes goes over the group's
  backend instead; both ends decide alike from the byte count (a send's tensor and the
  matching receive's buffer are the same size), so each path keeps its own order. A
  hand-over that fails on either end (within ``_HANDSHAKE_S``) leaves that pair on the
  backend: ``open``'s last gather tells both ends, so neither waits in it for the other.
* **Visibility.** The writer stores the payload, then the ring's write position; the
  reader loads the position, then the payload, and stores its read position after
  copying out. x86-64 keeps stores in order and never moves a store ahead of an earlier
  load, so neither side sees the other's counter before the bytes it covers. Other
  architectures do reorder, so the link is only offered on x86-64 (``usable``).
* **No lost wake-up.** Each ring's header holds a bell, a word only the ring's writer
  changes: it bumps it after every frame it writes into that ring and every frame it
  reads from its own incoming ring (room for the peer), then wakes it
  (``futex.wake``). A waiter reads the bell, checks its condition, and sleeps only
  while the bell still holds what it read (``futex.wait``): a bump in between moves
  the word, and the kernel then does not sleep. A packet on the pair's socket did the
  same at about 17 us a frame (docs/benchmarks.md).
* **Only the peer.** Anyone on the host can read the socket's address
  (``/proc/net/unix``); the accepting end takes a connection only from the process its
  peer named in the gather (``SO_PEERCRED``), and refuses any other with a warning.
* **Dead or hung peers.** The pair's socket (connected ``SOCK_SEQPACKET``, nothing sent
  on it after the hand-over) is closed by the kernel when the peer exits. A waiter
  sleeps at most ``_SLICE_S`` (0.1 s) at a time, and after a sleep that nothing ended
  it looks: end of file raises ``DistNetworkError`` naming the peer, as gloo raises
  "Connection reset by peer" (``CollectiveGroup.translate`` names the lost task either
  way). Every wait ends by the group's own timeout.
* **No deadlock on a full ring.** A writer waiting for room reads its own incoming
  frames meanwhile, into their posted receives or into copies kept until they are
  posted, so two writers waiting on each other both make room.

Where it is used: the plain loop of ``OverlappedSingle`` (GPipe and 1F1B, one stage per
rank, overlap on), between neighbouring ranks that could connect: same kernel, same
network namespace (the socket's address is in the abstract namespace). Everything else
(interleaved, FSDP stages, PipeDream, the outputs' share, ranks on other hosts, other
architectures) keeps the group's backend. ``CLUSTERFLOW_PIPELINE_SHM=0`` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import logging
import mmap
import os
import platform
import socket
import struct
import sys
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _batch_p2p

from clusterflow.cluster.contract import ENV_PIPELINE_SHM
from clusterflow.strategies.pipeline import futex

__all__ = ["LARGEST", "RING_BYTES", "ShmLink", "usable"]

log = logging.getLogger(__name__)

RING_BYTES = 1 << 20
"""Bytes of payload per direction and pair. Small, so that its lines stay in the cores'
caches: a 64 KiB frame took 0.20-0.22 ms a step of ``benchmarks.pipeline``'s sends to
write into a ring of 1 MiB, 0.25-0.35 into one of 8 MiB."""
LARGEST = RING_BYTES // 4
"""The largest message the ring carries; bigger ones are bandwidth-bound, where the
backend's per-message cost matters little."""
_COUNTERS = 4096
"""The page before the payload: the write position at byte 0, the read position at
byte 64 (apart, so the two ends never write one cache line)."""
_ALIGN = 64
_HEAD = 16
"""A frame's header: its tag and its payload's byte count, two int64."""
_WRAP = -1
"""The tag of a header that sends the reader back to the ring's start."""
_HANDSHAKE_S = 10.0
_SLICE_S = 0.1
"""The longest sleep on a bell before looking at the peer's socket."""


def usable() -> bool:
    """Whether this process may offer the link: not turned off, on Linux (``memfd``,
    abstract sockets, futexes), on x86-64 (module docstring, "Visibility")."""
    return (
        os.environ.get(ENV_PIPELINE_SHM, "1") != "0"
        and sys.platform == "linux"
        and platform.machine() == "x86_64"
    )


def _padded(nbytes: int) -> int:
    return _HEAD + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Ring:
    """One direction's ring over a shared mapping (module docstring)."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, _COUNTERS + RING_BYTES)
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=_COUNTERS // 8)
        self._heads = np.frombuffer(self._map, dtype=np.int64, offset=_COUNTERS)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_COUNTERS)
        self._bell_address = self._counters.ctypes.data + 128

    @property
    def written(self) -> int:
        return int(self._counters[0])

    @property
    def read(self) -> int:
        return int(self._counters[8])

    @property
    def bell(self) -> int:
        """The reader's wake-up word: the writer bumps it after every frame it writes
        and every frame it reads from its own incoming ring (module docstring)."""
        return int(self._counters[16])

    def ring_bell(self) -> None:
        self._counters[16] = self.bell + 1  # after the state it announces
        futex.wake(self._bell_address)

    def sleep(self, seen: int, timeout_s: float) -> None:
        """Until the bell moves from ``seen`` (or ``timeout_s``)."""
        futex.wait(self._bell_address, seen, timeout_s)

    def room(self, nbytes: int) -> int:
        """Bytes a frame of ``nbytes`` takes at the current write position, with the
        marker and the skipped tail when it does not fit before the ring's end."""
        offset = self.written % RING_BYTES
        need = _padded(nbytes)
        return need if need <= RING_BYTES - offset else RING_BYTES - offset + need

    def free(self) -> int:
        return RING_BYTES - (self.written - self.read)

    def put(self, tag: int, payload: torch.Tensor) -> None:
        """Writes one frame; the caller has checked ``free() >= room(n)``."""
        position = self.written
        offset = position % RING_BYTES
        need = _padded(payload.numel())
        if need > RING_BYTES - offset:
            self._heads[offset // 8] = _WRAP
            position += RING_BYTES - offset
            offset = 0
        self._heads[offset // 8] = tag
        self._heads[offset // 8 + 1] = payload.numel()
        start = offset + _HEAD
        self._data[start : start + payload.numel()].copy_(payload)
        self._counters[0] = position + need  # after the payload: see "Visibility"

    def ready(self) -> bool:
        return self.written > self.read

    def take(self) -> tuple[int, torch.Tensor, int]:
        """The next frame: its tag, a view of its payload in the ring (valid until
        ``release``), and the position after it. The caller has checked ``ready()``."""
        position = self.read
        offset = position % RING_BYTES
        if int(self._heads[offset // 8]) == _WRAP:
            position += RING_BYTES - offset
            offset = 0
        tag = int(self._heads[offset // 8])
        nbytes = int(self._heads[offset // 8 + 1])
        start = offset + _HEAD
        return tag, self._data[start : start + nbytes], position + _padded(nbytes)

    def release(self, position: int) -> None:
        self._counters[8] = position  # after the copy out: see "Visibility"

    def close(self) -> None:
        del self._counters, self._heads, self._data
        self._map.close()


@dataclass
class _Posted:
    """A receive posted on a channel, filled by its own or a later receive's wait."""

    buffer: torch.Tensor
    tag: int
    done: bool = False


@dataclass
class _Channel:
    """This rank's link to one peer: the ring it writes, the ring it reads, the socket."""

    peer: int
    sock: socket.socket
    outgoing: _Ring
    incoming: _Ring
    posted: collections.deque[_Posted] = field(default_factory=collections.deque)
    early: collections.deque[tuple[int, torch.Tensor]] = field(default_factory=collections.deque)
    """Frames read before their receive was posted (only while waiting for room)."""


class _Done:
    """A send: written to the ring when posted."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    def __init__(self, link: ShmLink, channel: _Channel, posted: _Posted) -> None:
        self._link, self._channel, self._posted = link, channel, posted

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._link._complete(self._channel, self._posted)
        return True

    def is_completed(self) -> bool:
        return self._posted.done


class ShmLink:
    """One rank's shared-memory channels to the peers of its pipeline on this host.

    Open with :meth:`open`, on every rank of ``group`` at once; then :meth:`batch` takes
    the place of torch's ``_batch_p2p``.
    """

    def __init__(self, channels: dict[int, _Channel], timeout_s: float, rank: int) -> None:
        self._channels = channels
        self._timeout_s = timeout_s
        self._rank = rank
        self._finalizer = weakref.finalize(self, _close, list(channels.values()))

    @property
    def peers(self) -> list[int]:
        """The group ranks reached through shared memory."""
        return sorted(self._channels)

    @classmethod
    def open(cls, group: dist.ProcessGroup, peers: Iterable[int], offer: bool) -> ShmLink:
        """Connects this rank to each of ``peers`` (ranks of ``group``) that can be
        reached through shared memory; both ends must offer (``offer`` and
        :func:`usable`). A collective over ``group``: every rank calls it together, with
        the peers that name it in turn. Peers not reached keep the backend."""
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        timeout_s = _timeout_s(group)
        offer = offer and usable()
        name = f"\0clusterflow-pipeline-{uuid.uuid4().hex}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        wanted = sorted(set(peers) - {rank})
        socks: dict[int, socket.socket] = {}
        try:
            listener.bind(name)
            listener.listen(max(1, len(wanted)))
            offers: list[Any] = [None] * size
            me = {"name": name, "offer": offer, "pid": os.getpid()}
            dist.all_gather_object(offers, me, group=group)
            both = [p for p in wanted if offer and offers[p]["offer"]]
            for peer in (p for p in both if p > rank):  # the lower rank connects
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.settimeout(_HANDSHAKE_S)
                try:
                    sock.connect(offers[peer]["name"])
                    sock.send(rank.to_bytes(4, "little"))
                except OSError as exc:  # another network namespace: another host to us
                    log.info("pipeline rank %d: no shared memory to rank %d: %s", rank, peer, exc)
                    sock.close()
                    continue
                socks[peer] = sock
            connected: list[Any] = [None] * size
            dist.all_gather_object(connected, sorted(socks), group=group)
            expected = {p for p in both if p < rank and rank in connected[p]}
            socks |= _accept(listener, expected, {p: offers[p]["pid"] for p in expected}, rank)
            channels = _rings(socks)
            ready: list[Any] = [None] * size
            dist.all_gather_object(ready, sorted(channels), group=group)
        except BaseException:
            for sock in socks.values():
                sock.close()
            raise
        finally:
            listener.close()
        for peer in [p for p in channels if rank not in ready[p]]:
            _close([channels.pop(peer)])
        for channel in channels.values():
            channel.sock.setblocking(False)
        if channels:
            log.info("pipeline rank %d: shared memory to ranks %s", rank, sorted(channels))
        return cls(channels, timeout_s, rank)

    def batch(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        """torch's ``_batch_p2p``: the ops to linked peers through the rings (a send is
        complete on return), the rest through the backend."""
        works: list[Any] = []
        rest = []
        for op in ops:
            channel = self._channels.get(op.group_peer)
            nbytes = op.tensor.numel() * op.tensor.element_size()
            if channel is None or nbytes > LARGEST or op.tensor.device.type != "cpu":
                rest.append(op)
            elif op.op is dist.isend:
                self._send(channel, op.tag, op.tensor)
                works.append(_Done())
            elif op.op is dist.irecv:
                posted = _Posted(op.tensor, op.tag)
                channel.posted.append(posted)
                works.append(_Receive(self, channel, posted))
            else:
                raise ValueError(f"{op.op} is neither isend nor irecv")
        return works + _batch_p2p(rest) if rest else works

    def close(self) -> None:
        """Closes the channels; a peer waiting on this rank then fails at once."""
        self._finalizer()

    def _send(self, channel: _Channel, tag: int, tensor: torch.Tensor) -> None:
        payload = _as_bytes(tensor.contiguous())
        ring = channel.outgoing
        self._until(channel, lambda: ring.free() >= ring.room(payload.numel()), drain=True)
        ring.put(tag, payload)
        ring.ring_bell()

    def _complete(self, channel: _Channel, posted: _Posted) -> None:
        """Fills the channel's receives, oldest first, through ``posted``."""
        while not posted.done:
            head = channel.posted[0]
            if channel.early:
                tag, payload = channel.early.popleft()
                self._fill(channel, head, tag, payload)
            else:
                self._until(channel, channel.incoming.ready, drain=False)
                self._read_one(channel)

    def _read_one(self, channel: _Channel) -> None:
        """Moves the next incoming frame into the oldest posted receive, or, with none
        posted, into a copy kept for it."""
        tag, payload, after = channel.incoming.take()
        if channel.posted and not channel.early:
            self._fill(channel, channel.posted[0], tag, payload)
        else:
            channel.early.append((tag, payload.clone()))
        channel.incoming.release(after)
        channel.outgoing.ring_bell()  # the peer may wait for room in its outgoing ring

    def _fill(self, channel: _Channel, posted: _Posted, tag: int, payload: torch.Tensor) -> None:
        buffer = posted.buffer
        want = buffer.numel() * buffer.element_size()
        if tag != posted.tag or payload.numel() != want:
            raise dist.DistError(
                f"pipeline rank {self._rank}: rank {channel.peer} sent {payload.numel()} bytes "
                f"with tag {tag} where a receive of {want} bytes with tag {posted.tag} was "
                "posted; both ends must post their transfers in the same order"
            )
        with torch.no_grad():  # any strides: the frame holds the sender's elements in order
            buffer.copy_(payload.view(buffer.dtype).view(buffer.shape))
        posted.done = True
        channel.posted.popleft()

    def _until(self, channel: _Channel, ready: Any, *, drain: bool) -> None:
        """Returns once ``ready()``; meanwhile, with ``drain``, reads incoming frames of
        every channel (module docstring, "No deadlock"). Sleeps on the channel's bell,
        waking at least every ``_SLICE_S`` to see whether the peer closed its socket
        (``DistNetworkError``) and, with ``drain``, to read the other channels' frames
        (their bells do not wake it); ``DistError`` after the group's timeout."""
        if ready():  # the common case: nothing to wait for, nothing else done
            return
        deadline = time.monotonic() + self._timeout_s
        bell = channel.incoming
        while True:
            if drain:
                for other in self._channels.values():
                    while other.incoming.ready():
                        self._read_one(other)
            seen = bell.bell
            if ready():  # after reading the bell: a later change moves it
                return
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistError(
                    f"pipeline rank {self._rank}: Timed out waiting {self._timeout_s:g} s for "
                    f"rank {channel.peer} over shared memory"
                )
            bell.sleep(seen, min(_SLICE_S, deadline - now))
            if ready():
                return
            if bell.bell == seen and _closed(channel.sock):
                raise dist.DistNetworkError(
                    f"pipeline rank {self._rank}: rank {channel.peer} closed its shared-memory "
                    "link (Connection reset by peer)"
                )


def _accept(
    listener: socket.socket, expected: set[int], pids: dict[int, int], rank: int
) -> dict[int, socket.socket]:
    """The connections of the ``expected`` peers, each from the process the peer named
    (``pids``). They were queued before the gather that named them, so each accept
    returns at once; whatever fails within ``_HANDSHAKE_S`` leaves that peer on the
    backend (the last gather of ``open`` tells it so) rather than raising here while
    the peer waits in that gather. One deadline for all of it: strangers that keep
    connecting (or connect and send nothing) cannot hold the peers past it."""
    socks: dict[int, socket.socket] = {}
    deadline = time.monotonic() + _HANDSHAKE_S
    while expected:
        try:
            listener.settimeout(max(1e-3, deadline - time.monotonic()))
            sock, _ = listener.accept()
        except OSError as exc:
            log.info("pipeline rank %d: no shared memory to ranks %s: %s", rank, expected, exc)
            break
        try:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            peer = int.from_bytes(sock.recv(4), "little")
            trusted = peer in expected and _peer_pid(sock) == pids[peer]
        except OSError:
            trusted = False
        if trusted:
            socks[peer] = sock
            expected.discard(peer)
        else:  # anyone on this host can see the address: only the peer's process
            log.warning("pipeline rank %d: refused a stranger's connection", rank)
            sock.close()
    return socks


def _peer_pid(sock: socket.socket) -> int:
    """The process at the other end of a Unix socket, as the kernel saw it connect."""
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed its end (it exited or closed the link); nothing else is
    ever sent on the socket after the hand-over."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            return True
        raise


def _rings(socks: dict[int, socket.socket]) -> dict[int, _Channel]:
    """Each end creates the ring it reads and hands it over its socket (module
    docstring); a peer whose hand-over fails keeps the backend."""
    mine: dict[int, int] = {}
    channels: dict[int, _Channel] = {}
    try:
        for peer, sock in socks.items():
            fd = os.memfd_create(f"clusterflow-pipeline-{peer}", os.MFD_CLOEXEC)
            mine[peer] = fd
            os.ftruncate(fd, _COUNTERS + RING_BYTES)
            with contextlib.suppress(OSError):  # the peer gone: its receive below fails
                socket.send_fds(sock, [b"r"], [fd])
        for peer, sock in socks.items():
            try:
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            except OSError as exc:
                log.info("no shared memory to rank %d: %s", peer, exc)
                fds = []
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                sock.close()
                continue
            try:
                channels[peer] = _Channel(peer, sock, _Ring(fds[0]), _Ring(mine[peer]))
            finally:
                os.close(fds[0])
    finally:
        for fd in mine.values():
            os.close(fd)  # the mappings keep the memory
    return channels


def _close(channels: list[_Channel]) -> None:
    for channel in channels:
        channel.sock.close()
        for ring in (channel.outgoing, channel.incoming):
            with contextlib.suppress(BufferError):  # a caller still holds a frame's view
                ring.close()


def _timeout_s(group: dist.ProcessGroup) -> float:
    """The group's own timeout, as gloo would wait (30 min if it tells none)."""
    try:
        options = group._get_backend(torch.device("cpu")).options
        return float(options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return 1800.0
