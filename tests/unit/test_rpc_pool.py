"""ReceivePool: reassembly buffers come back only when nothing views them any more.

No ``gc.collect()`` here: a buffer must come back by reference counting alone, the
moment its last tensor dies, as it does in a serving loop.
"""

from __future__ import annotations

import torch

from clusterflow.rpc import WHOLE_BYTES, codec
from clusterflow.rpc.pool import RECEIVE_POOL, ReceivePool

N = 4096


def test_take_gives_a_uint8_tensor_of_the_exact_size() -> None:
    pool = ReceivePool()
    t = pool.take(N)
    assert t.dtype == torch.uint8
    assert t.shape == (N,)
    assert pool.idle_bytes == 0


def test_memory_returns_when_the_tensor_dies_and_is_handed_out_again() -> None:
    pool = ReceivePool()
    t = pool.take(N)
    address = t.data_ptr()
    del t
    assert pool.idle_bytes == N
    again = pool.take(N)
    assert again.data_ptr() == address
    assert pool.idle_bytes == 0


def test_memory_is_not_recycled_while_a_view_lives() -> None:
    pool = ReceivePool()
    t = pool.take(N)
    address = t.data_ptr()
    views = [
        t[100:200],
        t.view(torch.float32).reshape(32, -1),
        t.view(torch.int64)[3],
        t.as_strided((10,), (2,)),
    ]
    del t
    while views:
        # Another taker of the same size never gets the memory the views still see.
        other = pool.take(N)
        assert other.data_ptr() != address
        del other
        views.pop()
    assert pool.idle_bytes == 2 * N  # the last view's death gave the buffer back
    assert address in {pool.take(N).data_ptr(), pool.take(N).data_ptr()}


def test_memory_is_not_recycled_while_a_numpy_view_lives() -> None:
    pool = ReceivePool()
    t = pool.take(N)
    array = t[8:].numpy()
    del t
    assert pool.idle_bytes == 0
    array[:] = 1  # still ours to write
    del array
    assert pool.idle_bytes == N


def test_writes_through_a_live_view_never_reach_a_new_taker() -> None:
    pool = ReceivePool()
    t = pool.take(N)
    view = t[:16]
    del t
    fresh = pool.take(N)
    fresh.fill_(0)
    view.fill_(9)
    assert int(fresh.sum()) == 0


def test_max_idle_bytes_is_respected() -> None:
    pool = ReceivePool(max_idle_bytes=2 * N)
    taken = [pool.take(N) for _ in range(3)]
    del taken
    assert pool.idle_bytes == 2 * N


def test_zero_max_idle_bytes_keeps_nothing() -> None:
    pool = ReceivePool(max_idle_bytes=0)
    t = pool.take(N)
    del t
    assert pool.idle_bytes == 0


def test_buffers_are_kept_by_exact_size() -> None:
    pool = ReceivePool()
    small, large = pool.take(N), pool.take(2 * N)
    large_address = large.data_ptr()
    del small, large
    assert pool.idle_bytes == 3 * N
    again = pool.take(2 * N)
    assert again.data_ptr() == large_address
    assert pool.idle_bytes == N


def test_decoded_multi_frame_tensor_keeps_its_buffer_until_released() -> None:
    original = torch.arange(WHOLE_BYTES // 4 + 3, dtype=torch.float32)
    frames = [bytes(f) for f in codec.encode(codec.KIND_REQUEST, 1, "m", None, {"x": original})]
    nbytes = original.numel() * 4
    header = codec.decode_header(frames[0])
    first = codec.decode_tensors(header, frames[1:])["x"]
    half = first[: original.numel() // 2]
    del first
    second = codec.decode_tensors(header, frames[1:])["x"]
    assert second.data_ptr() != half.data_ptr()
    assert torch.equal(half, original[: original.numel() // 2])
    del half, second
    assert RECEIVE_POOL.idle_bytes >= nbytes
