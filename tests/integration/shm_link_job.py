"""One rank of ``test_shm_link.py``: two processes on this host form a gloo group and
run one scenario over ``ShmLink``; each writes what it saw to ``OUT/SCENARIO-RANK.pt``.

    python shm_link_job.py SCENARIO OUT      (RANK, WORLD_SIZE, MASTER_* in the environment)
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clusterflow.strategies.pipeline import shm_link
from clusterflow.strategies.pipeline.shm_link import LARGEST, RING_BYTES, ShmLink

TIMEOUT_S = 30
"""The group's timeout, which the link's waits take as theirs."""


def message(sender: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``index``-th message ``sender`` sends: distinct bits for every message."""
    gen = torch.Generator().manual_seed(1000 * sender + index)
    if dtype == torch.bool:
        return torch.rand(numel, generator=gen) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, (numel,), generator=gen)
    return torch.randn(numel, generator=gen).to(dtype)


MIXED: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((32, 512), torch.float32),
    ((1000,), torch.bfloat16),
    ((7,), torch.int64),
    ((3,), torch.bool),
    ((), torch.float32),
    ((LARGEST // 4 + 1,), torch.float32),  # one float over: through gloo
    ((64, 512), torch.float32),
]


PINGS = 20


def _p2p(link: ShmLink, op: Any, tensor: torch.Tensor, peer: int) -> list[Any]:
    return link.batch([dist.P2POp(op, tensor, peer)])


def mixed(link: ShmLink, rank: int) -> dict[str, Any]:
    """Both ranks send every shape of ``MIXED`` three times, then receive the other's:
    the bits arrive as sent, in order, whichever path each took."""
    peer = 1 - rank
    sends = []
    for round_ in range(3):
        for i, (shape, dtype) in enumerate(MIXED):
            tensor = message(rank, round_ * 10 + i, max(1, int(torch.Size(shape).numel())), dtype)
            sends += _p2p(link, dist.isend, tensor.reshape(shape), peer)
    equal = []
    works = []
    buffers = []
    for round_ in range(3):
        for i, (shape, dtype) in enumerate(MIXED):
            buffer = torch.empty(shape, dtype=dtype)
            works += _p2p(link, dist.irecv, buffer, peer)
            buffers.append((buffer, round_ * 10 + i, dtype))
    for work in works + sends:  # a send's work is kept until done, as torch's rule
        work.wait()
    for buffer, index, dtype in buffers:
        expected = message(peer, index, max(1, buffer.numel()), dtype).reshape(buffer.shape)
        equal.append(bool(torch.equal(buffer, expected)) and buffer.dtype == expected.dtype)
    # Ping-pong: each receive is posted and waited for before its message is sent.
    buffer = torch.empty(32, 512)
    sends = []  # a gloo work waited for twice waits for another send
    for i in range(PINGS):
        ping = message(rank, 100 + i, buffer.numel(), torch.float32)
        if rank == 0:
            sends += _p2p(link, dist.isend, ping, 1)
        for work in _p2p(link, dist.irecv, buffer, peer):
            work.wait()
        equal.append(
            bool(
                torch.equal(buffer.flatten(), message(peer, 100 + i, buffer.numel(), torch.float32))
            )
        )
        if rank == 1:
            sends += _p2p(link, dist.isend, ping, 0)
    for work in sends:
        work.wait()
    return {"equal": equal}


def full(link: ShmLink, rank: int) -> dict[str, Any]:
    """Each rank sends eight rings' worth to the other, in chunks of two rings, posting
    a chunk's receives after it without waiting: every send that finds the ring full
    reads the other's frames meanwhile, into copies kept for receives not yet posted
    (the first chunk), then, behind those copies, into the receives posted so far."""
    peer = 1 - rank
    numel = LARGEST // 4 // 4 * 3  # 3/4 of the largest frame, in floats
    chunk = 2 * RING_BYTES // (numel * 4)
    count = 4 * chunk
    works: list[Any] = []
    buffers: list[torch.Tensor] = []
    index = 0
    for _ in range(count // chunk):
        for _ in range(chunk):
            _p2p(link, dist.isend, message(rank, index, numel, torch.float32), peer)
            index += 1
        for _ in range(chunk):
            buffers.append(torch.empty(numel))
            works += _p2p(link, dist.irecv, buffers[-1], peer)
    for work in works:
        work.wait()
    equal = [
        bool(torch.equal(b, message(peer, i, numel, torch.float32))) for i, b in enumerate(buffers)
    ]
    return {"equal": equal, "count": count}


def mismatch(link: ShmLink, rank: int) -> dict[str, Any]:
    """Rank 0 sends 10 floats; rank 1 posts a receive of 12."""
    if rank == 0:
        _p2p(link, dist.isend, torch.ones(10), 1)
        return {}
    try:
        for work in _p2p(link, dist.irecv, torch.empty(12), 0):
            work.wait()
    except dist.DistError as exc:
        return {"error": type(exc).__name__, "text": str(exc)}
    return {"error": None}


def peer_dies(link: ShmLink, rank: int) -> dict[str, Any]:
    """Rank 1 exits without sending; rank 0 waits for its message."""
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        for work in _p2p(link, dist.irecv, torch.empty(10), 1):
            work.wait()
    except dist.DistError as exc:
        return {"error": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    return {"error": None}


STRANGER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(10)
sock.connect(bytes.fromhex(sys.argv[1]))  # an abstract name: it starts with a NUL
sock.send((0).to_bytes(4, "little"))
"""
"""Another process of this host: connects to an address and claims to be rank 0."""


def stranger_connects_first(rank: int) -> None:
    """On rank 0: right after the first gather of ``ShmLink.open`` (the addresses), a
    stranger process (a fresh interpreter, not a fork of this threaded one, which could
    hang on a lock a gloo thread held) connects to rank 1's address, claiming to be
    rank 0, and exits; its connection waits in rank 1's queue ahead of rank 0's own."""
    gather = dist.all_gather_object

    def first(objects: list[Any], obj: Any, group: Any = None) -> None:
        gather(objects, obj, group=group)
        dist.all_gather_object = gather  # type: ignore[assignment]
        address = objects[1]["name"].encode().hex()
        done = subprocess.run(
            [sys.executable, "-c", STRANGER, address], timeout=TIMEOUT_S, check=False
        )
        assert done.returncode == 0, "the stranger could not connect"

    if rank == 0:
        dist.all_gather_object = first  # type: ignore[assignment]


class _Refusals(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "stranger" in record.getMessage()


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = dist.distributed_c10d._get_default_group()
    offer = not (scenario == "refused" and rank == 1)
    refusals = _Refusals()
    shm_link.log.addHandler(refusals)
    if scenario == "stranger":
        stranger_connects_first(rank)
    link = ShmLink.open(group, [1 - rank], offer)
    result: dict[str, Any] = {"peers": link.peers, "usable": shm_link.usable()}
    result["refusals"] = refusals.count
    if scenario in ("mixed", "refused", "stranger"):
        result |= mixed(link, rank)
    elif scenario == "full":
        result |= full(link, rank)
    elif scenario == "mismatch":
        result |= mismatch(link, rank)
    elif scenario == "peer_dies":
        result |= peer_dies(link, rank)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    torch.save(result, out / f"{scenario}-{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # no goodbye over a group whose peer may be gone


if __name__ == "__main__":
    main()
