"""The RPC wire format: headers, tensor frames, and what a malformed message gives."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch
import zmq

from clusterflow.rpc import FRAME_BYTES, PROTOCOL_VERSION, WHOLE_BYTES, ProtocolError, codec

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Distinct values that survive the dtype (small ints, both signs where signed)."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.int64) % 100
    if dtype == torch.bool:
        return (values % 3 == 0).reshape(shape)
    if dtype != torch.uint8:
        values = values - 50
    return values.to(dtype).reshape(shape)


def as_received(frames: list[Any]) -> list[bytes]:
    """The frames as a peer gets them: plain bytes, no memory shared with the sender."""
    return [bytes(f) for f in frames]


def roundtrip(
    tensors: dict[str, torch.Tensor], body: Any = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    frames = as_received(codec.encode(codec.KIND_REQUEST, 7, "svc.m", body, tensors))
    header = codec.decode_header(frames[0])
    return header, codec.decode_tensors(header, frames[1:])


def header_bytes(**fields: Any) -> bytes:
    base: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": "req", "id": 1, "m": "svc.m"}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not None})


# Round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_supported_dtype_round_trips(dtype: torch.dtype) -> None:
    original = sample(dtype)
    _, out = roundtrip({"t": original})
    assert out["t"].dtype == dtype
    assert out["t"].shape == original.shape
    assert torch.equal(out["t"], original)


def test_header_fields_and_body_round_trip() -> None:
    body = {"step": 3, "names": ["a", "b"], "blob": b"\x00\x01", "f": 0.5, "none": None}
    header, out = roundtrip({}, body)
    assert header["v"] == PROTOCOL_VERSION
    assert header["k"] == codec.KIND_REQUEST
    assert header["id"] == 7
    assert header["m"] == "svc.m"
    assert header["b"] == body
    assert out == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_zero_dim_tensor_keeps_its_shape(dtype: torch.dtype) -> None:
    original = sample(dtype, (1,)).reshape(())
    _, out = roundtrip({"s": original})
    assert out["s"].dim() == 0
    assert out["s"].dtype == dtype
    assert torch.equal(out["s"], original)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
def test_empty_tensor_sends_no_frame_and_keeps_its_shape(shape: tuple[int, ...]) -> None:
    frames = codec.encode(codec.KIND_REQUEST, 1, "m", None, {"e": torch.empty(shape)})
    assert len(frames) == 1
    header = codec.decode_header(frames[0])
    out = codec.decode_tensors(header, [])
    assert out["e"].shape == shape
    assert out["e"].dtype == torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(60, dtype=torch.int32).reshape(5, 12)[::2, 1::3],
        lambda: torch.arange(30, dtype=torch.bfloat16).reshape(5, 6)[:, 2],
        lambda: torch.arange(8.0).expand(3, 8),
    ],
    ids=["transposed", "strided", "column", "expanded"],
)
def test_non_contiguous_tensor_round_trips(make: Any) -> None:
    original = make()
    assert not original.is_contiguous()
    _, out = roundtrip({"x": original})
    assert out["x"].shape == original.shape
    assert torch.equal(out["x"], original)


def test_several_tensors_keep_names_order_and_values() -> None:
    tensors = {
        "w": sample(torch.float32, (4, 4)),
        "empty": torch.empty(0, dtype=torch.int8),
        "mask": sample(torch.bool, (7,)),
        "b": sample(torch.float64, (2,)),
    }
    _, out = roundtrip(tensors, {"step": 1})
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor)


CUT = WHOLE_BYTES // FRAME_BYTES
"""Frames of a tensor of WHOLE_BYTES, were it cut."""


@pytest.mark.parametrize(
    ("nbytes", "frames"),
    [
        (FRAME_BYTES + 4, 1),
        (WHOLE_BYTES, 1),
        (WHOLE_BYTES + 4, CUT + 1),
        (2 * WHOLE_BYTES, 2 * CUT),
        (2 * WHOLE_BYTES + 12, 2 * CUT + 1),
    ],
    ids=["mid-size-whole", "whole-at-the-limit", "one-element-over", "exactly-cut", "cut-plus-one"],
)
def test_tensors_up_to_whole_bytes_travel_whole_larger_in_frames_of_frame_bytes(
    nbytes: int, frames: int
) -> None:
    original = torch.arange(nbytes // 4, dtype=torch.int32)
    encoded = codec.encode(codec.KIND_REQUEST, 1, "m", None, {"big": original})
    assert len(encoded) == 1 + frames
    assert frames == 1 or all(len(f) <= FRAME_BYTES for f in encoded[1:])
    assert sum(len(f) for f in encoded[1:]) == nbytes
    header = codec.decode_header(encoded[0])
    out = codec.decode_tensors(header, as_received(encoded[1:]))
    assert torch.equal(out["big"], original)


@pytest.mark.parametrize(
    "cut",
    [[4 * 1024 * 1024], [1000, 24, 3 * 1024 * 1024], [7] * 12 + [64 * 1024]],
    ids=["4-MiB-frames-as-earlier-senders-cut", "uneven-frames", "many-small-frames"],
)
def test_tensors_decode_whatever_frame_size_the_sender_chose(cut: list[int]) -> None:
    """The first sizes, then the last size for the rest: any cut a sender may choose."""
    a = torch.arange(2 * 1024 * 1024 + 5, dtype=torch.float32)  # 8 MiB and 20 bytes
    b = torch.arange(300, dtype=torch.int16)
    header = codec.decode_header(codec.encode(codec.KIND_REQUEST, 1, "m", None, {"a": a})[0])
    header["t"].append(["b", "int16", [300], 600])
    raw = a.numpy().tobytes()
    frames, start = [], 0
    for size in cut[:-1]:
        frames.append(raw[start : start + size])
        start += size
    while start < len(raw):
        frames.append(raw[start : start + cut[-1]])
        start += cut[-1]
    frames.append(b.numpy().tobytes())
    out = codec.decode_tensors(header, as_received(frames))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


def test_a_frame_that_runs_past_its_tensor_is_a_protocol_error() -> None:
    a, b = torch.ones(4), torch.ones(4)
    header, _ = encoded_message({"a": a, "b": b})
    with pytest.raises(ProtocolError, match="frames hold 32 of 16 bytes"):
        codec.decode_tensors(header, [torch.ones(8).numpy().tobytes()])


def test_an_empty_frame_inside_a_tensor_is_a_protocol_error() -> None:
    header, frames = encoded_message({"a": torch.ones(4)})
    with pytest.raises(ProtocolError, match="empty frame"):
        codec.decode_tensors(header, [frames[0][:8], b"", frames[0][8:]])


def test_large_bfloat16_tensor_over_several_frames() -> None:
    original = torch.randn(WHOLE_BYTES // 2 + 1000, dtype=torch.float32).to(torch.bfloat16)
    _, out = roundtrip({"g": original})
    assert torch.equal(out["g"], original)


def test_single_frame_tensor_is_sent_without_a_copy() -> None:
    tensor = torch.zeros(4, dtype=torch.int32)
    frames = codec.encode(codec.KIND_REQUEST, 1, "m", None, {"t": tensor})
    tensor[0] = 7  # the frame views the tensor's memory: the change shows through it
    header = codec.decode_header(frames[0])
    assert codec.decode_tensors(header, as_received(frames[1:]))["t"][0] == 7


def test_tensor_from_a_misaligned_frame_is_aligned_and_correct() -> None:
    original = sample(torch.float64, (5,))
    frames = codec.encode(codec.KIND_REPLY, 1, "m", None, {"t": original})
    # ZeroMQ hands small frames out of one receive buffer, at any address.
    buffer = bytearray(len(frames[1]) + 1)
    buffer[1:] = bytes(frames[1])
    misaligned = memoryview(buffer)[1:]
    out = codec.decode_tensors(codec.decode_header(frames[0]), [misaligned])
    assert out["t"].data_ptr() % out["t"].element_size() == 0
    assert torch.equal(out["t"], original)


def test_frames_received_as_zmq_frames_decode() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://codec-test")
        b.connect("inproc://codec-test")
        tensors = {"small": sample(torch.int16), "big": torch.arange(WHOLE_BYTES // 2 + 5.0)}
        a.send_multipart(codec.encode(codec.KIND_REQUEST, 9, "m", "hi", tensors), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        header = codec.decode_header(frames[0])
        out = codec.decode_tensors(header, frames[1:])
        assert header["b"] == "hi"
        for name, tensor in tensors.items():
            assert torch.equal(out[name], tensor)
        a.close(0)
        b.close(0)
    finally:
        ctx.term()


# What cannot travel ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_unsupported_dtype_is_a_protocol_error_naming_it(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ProtocolError, match=name):
        codec.encode(codec.KIND_REQUEST, 1, "m", None, {"z": torch.zeros(2, dtype=dtype)})


def test_body_msgpack_cannot_encode_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match=r"svc\.m"):
        codec.encode(codec.KIND_REQUEST, 1, "svc.m", {"s": {1, 2}})


# Malformed headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"garbage that is no msgpack at all \xff\xfe",
        msgpack.packb({"v": 1, "k": "req"})[:-2],  # truncated
        msgpack.packb([1, "req", 1, "m"]),  # not a map
        msgpack.packb("just a string"),
    ],
    ids=["empty", "never-used-byte", "garbage", "truncated", "array", "string"],
)
def test_malformed_header_bytes_are_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_header(raw)


@pytest.mark.parametrize("version", [99, 0, None, "1"])
def test_other_protocol_version_is_a_protocol_error_naming_both(version: Any) -> None:
    raw = msgpack.packb({"v": version, "k": "req", "id": 1, "m": "m"})
    with pytest.raises(ProtocolError, match="version") as info:
        codec.decode_header(raw)
    assert repr(version) in str(info.value)
    assert str(PROTOCOL_VERSION) in str(info.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"k": "bogus"},
        {"k": None},
        {"id": "1"},
        {"id": None},
        {"m": 5},
        {"m": None},
    ],
    ids=["unknown-kind", "no-kind", "string-id", "no-id", "int-method", "no-method"],
)
def test_header_with_bad_fields_is_a_protocol_error(fields: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_header(header_bytes(**fields))


# Descriptors that do not match the frames -------------------------------------------------


def encoded_message(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], list[bytes]]:
    frames = as_received(codec.encode(codec.KIND_REQUEST, 1, "m", None, tensors))
    return codec.decode_header(frames[0]), frames[1:]


def test_missing_frame_is_a_protocol_error() -> None:
    header, frames = encoded_message({"a": torch.ones(4), "b": torch.ones(4)})
    with pytest.raises(ProtocolError):
        codec.decode_tensors(header, frames[:1])


def test_extra_frame_is_a_protocol_error() -> None:
    header, frames = encoded_message({"a": torch.ones(4)})
    with pytest.raises(ProtocolError, match="left over"):
        codec.decode_tensors(header, [*frames, b"\x00" * 16])


def test_frames_without_descriptors_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unexpected"):
        codec.decode_tensors({"v": 1}, [b"\x00" * 8])


def test_frame_of_the_wrong_size_is_a_protocol_error() -> None:
    header, frames = encoded_message({"a": torch.ones(4)})
    with pytest.raises(ProtocolError, match="frames hold"):
        codec.decode_tensors(header, [frames[0][:-4]])


def test_multi_frame_tensor_missing_its_last_frame_is_a_protocol_error() -> None:
    header, frames = encoded_message({"big": torch.zeros(WHOLE_BYTES // 4 + 1)})
    assert len(frames) == CUT + 1
    with pytest.raises(ProtocolError):
        codec.decode_tensors(header, frames[:-1])


@pytest.mark.parametrize(
    "descriptor",
    [
        ["a", "float32", [4], 15],  # nbytes does not fit the shape
        ["a", "float32", [5], 16],  # shape does not fit nbytes
        ["a", "complex64", [2], 16],  # a dtype that cannot travel
        ["a", "object", [4], 16],  # not a dtype at all
        ["a", "float32", [-4], 16],  # negative dimension
        ["a", "float32", ["4"], 16],  # dimension not an int
        ["a", "float32", 4, 16],  # shape not a list
        ["a", "float32", [4]],  # too short
        ["a", "float32", [4], 16, "x"],  # too long
        "abc",  # not a list
        7,  # not a list
    ],
)
def test_descriptor_not_matching_the_frames_is_a_protocol_error(descriptor: Any) -> None:
    header = {"v": 1, "k": "req", "id": 1, "m": "m", "t": [descriptor]}
    with pytest.raises(ProtocolError):
        codec.decode_tensors(header, [b"\x00" * 16])


def test_descriptors_not_a_list_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        codec.decode_tensors({"t": 5}, [b"\x00" * 16])


def test_absurd_shape_is_a_protocol_error_not_a_crash() -> None:
    descriptor = ["a", "uint8", [0, 2**70], 0]
    with pytest.raises(ProtocolError):
        codec.decode_tensors({"t": [descriptor]}, [])


# The reused header packer (codec._pack) ----------------------------------------------


def test_a_header_that_failed_to_encode_leaves_nothing_in_the_next_one() -> None:
    """Headers go through one reused ``msgpack.Packer`` per thread: a failed encode must
    leave no bytes behind for the next header of that thread (it would not decode)."""
    with pytest.raises(ProtocolError):
        codec.encode(codec.KIND_REQUEST, 1, "svc.m", {"ok": [1, 2], "bad": {1, 2}})
    header = codec.decode_header(codec.encode(codec.KIND_REPLY, 2, "svc.n", "fine")[0])
    assert header == {"v": PROTOCOL_VERSION, "k": "rep", "id": 2, "m": "svc.n", "b": "fine"}


def test_a_large_header_lets_its_grown_packer_go() -> None:
    """A packer's buffer grows to the largest header it packed and never shrinks: after
    one over ``PACKER_KEEP_BYTES`` the thread starts a fresh packer instead of holding
    that memory for its life (a private attribute: the promise is memory not held)."""
    codec.encode(codec.KIND_REQUEST, 1, "svc.m", "small")
    small_packer = codec._packers.packer
    assert small_packer is not None
    body = b"x" * (codec.PACKER_KEEP_BYTES + 1)
    frames = codec.encode(codec.KIND_REQUEST, 2, "svc.m", body)
    assert codec.decode_header(frames[0])["b"] == body
    assert codec._packers.packer is None
    codec.encode(codec.KIND_REQUEST, 3, "svc.m", "small again")
    assert codec._packers.packer is not small_packer
