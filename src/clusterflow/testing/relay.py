"""A userspace link emulator: delay, jitter and reordering of one host's outgoing frames.

Why not ``tc netem``: this project's kernel (6.18) is built without ``sch_netem`` and
without ``sch_fq`` (so no EDT delay from eBPF either), but it has TUN/TAP. A host whose
link needs a delay gets, instead of a veth, two TAP devices held by this relay process:
``eth0`` inside the host's namespace and the bridge-side end (moved to the root
namespace and enslaved to the harness's bridge). A TAP's fd stays valid after its device
moves to another namespace. The relay forwards Ethernet frames both ways:

* host -> bridge (what the host sends): each frame is due ``delay + U(-jitter, jitter)``
  after it was read; a fraction ``reorder`` of frames is held back one more delay (at
  least 1 ms), so frames sent after it pass it; frames wait in a heap keyed by due time.
  This is netem on the host's egress: host-to-host one-way delay is the sender's delay.
* bridge -> host: forwarded at once.

Rate shaping (htb) and random loss (a cBPF filter) stay in ``tc`` on the two TAPs, as on a
veth. The relay runs in the host's namespace, so the harness's ``close`` and the sweep
of a dead harness kill it with everything else there; it also asks the kernel for
SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and its TAPs vanish with it. New
settings arrive on stdin, one line ``delay_s jitter_s reorder``; stdin closed ends it.

What the relay itself adds: a UDP round trip between two relayed hosts (four relay hops)
measured 50-140 us minimum on this loaded 2-core machine (not a quiet slot), against
tens of microseconds on plain veths. Its top frame rate: 64-byte UDP datagrams sent at
99 k/s arrive at 99 k/s over veths and at 48 k/s through two relays (27% dropped), so
about 48 k frames/s, some 580 Mbit/s of 1500-byte frames (loaded machine, not a quiet
slot). Treat delays under about 0.1 ms and rates above a few hundred Mbit/s as the
relay's, not the network's.

Run as ``python -m clusterflow.testing.relay HOST_TAP BRIDGE_TAP SEED``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_PR_SET_PDEATHSIG = 1
_MAX_FRAME = 65536
_BATCH = 64
MIN_HOLD_S = 0.001
"""A reordered frame is held back at least this long, even with no delay set."""


def open_tap(name: str) -> int:
    """Creates TAP ``name`` (no packet-info header) owned by this process; returns its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ifr = struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI)
    fcntl.ioctl(fd, _TUNSETIFF, ifr)
    return fd


class Emulator:
    """The scheduling of delayed frames, apart from the fds (so it can be reasoned about)."""

    def __init__(self, seed: int) -> None:
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.reorder = 0.0
        self._rng = random.Random(seed)
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = 0

    def configure(self, delay_s: float, jitter_s: float, reorder: float) -> None:
        self.delay_s, self.jitter_s, self.reorder = delay_s, jitter_s, reorder

    def due(self, now: float) -> float:
        """When a frame read at ``now`` leaves."""
        d = self.delay_s
        if self.jitter_s > 0:
            d = max(0.0, d + self._rng.uniform(-self.jitter_s, self.jitter_s))
        if self.reorder > 0 and self._rng.random() < self.reorder:
            d += max(self.delay_s, MIN_HOLD_S)
        return now + d

    def push(self, frame: bytes, now: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.due(now), self._seq, frame))

    def pop_due(self, now: float) -> list[bytes]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def timeout(self, now: float) -> float | None:
        return max(0.0, self._heap[0][0] - now) if self._heap else None


def _read_batch(fd: int) -> list[bytes]:
    frames = []
    for _ in range(_BATCH):
        try:
            frames.append(os.read(fd, _MAX_FRAME))
        except BlockingIOError:
            break
    return frames


def _write(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError as exc:  # a full or downed device drops the frame, as a NIC would
        if exc.errno not in (errno.EAGAIN, errno.EIO, errno.EINVAL, errno.ENOBUFS):
            raise


def main(argv: list[str]) -> int:
    host_name, bridge_name, seed = argv[0], argv[1], int(argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl
        return 1
    host_fd = open_tap(host_name)
    bridge_fd = open_tap(bridge_name)
    emu = Emulator(seed)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    pending = b""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    poller = select.epoll()
    poller.register(host_fd, select.EPOLLIN)
    poller.register(bridge_fd, select.EPOLLIN)
    poller.register(ctl, select.EPOLLIN)
    while True:
        now = time.monotonic()
        for frame in emu.pop_due(now):
            _write(bridge_fd, frame)
        wait = emu.timeout(time.monotonic())
        for fd, _ in poller.poll(-1 if wait is None else wait):
            if fd == host_fd:
                now = time.monotonic()
                for frame in _read_batch(host_fd):
                    if emu.delay_s == 0 and emu.jitter_s == 0 and emu.reorder == 0:
                        _write(bridge_fd, frame)
                    else:
                        emu.push(frame, now)
            elif fd == bridge_fd:
                for frame in _read_batch(bridge_fd):
                    _write(host_fd, frame)
            else:
                try:
                    chunk = os.read(ctl, 4096)
                except BlockingIOError:
                    continue
                if not chunk:
                    return 0
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    delay_s, jitter_s, reorder = (float(x) for x in line.split())
                    emu.configure(delay_s, jitter_s, reorder)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
