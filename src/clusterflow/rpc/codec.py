"""The wire format: a msgpack header frame followed by raw tensor frames.

Only the small header is encoded. A tensor's bytes leave straight from its buffer (the
frames are memoryviews over the tensor, sent by ZeroMQ without a copy) and, when a
tensor fits in one frame, arrive as a ``torch.frombuffer`` view over the received frame
(copied only when that frame is misaligned for the dtype: ZeroMQ packs small frames
back to back in one receive buffer, at any address).
A tensor of up to ``WHOLE_BYTES`` travels as one frame and arrives without a copy;
a larger one is cut into frames of ``FRAME_BYTES`` and joined on arrival, unless the
receiver asks for it ``framed``: then it arrives as a ``Framed``, one zero-copy view per
frame, and the receiver consumes it frame by frame (the ps applies a push per frame,
the worker writes a pulled frame straight into its parameter). Both sizes
were measured (2026-11-26). A ZeroMQ echo of 64 MiB over loopback takes about 36 ms in
512 KiB frames, 29 ms in 1 MiB ones, 55 ms in 4 MiB ones and 80 ms in one frame, and the
ps's 64 MiB push+pull against raw TCP (``benchmarks.ps --bandwidth-only``) reads
0.81-0.83 with 512 KiB frames, 0.76-0.84 with 1 MiB and 0.66 with 4 MiB: small frames are
received into reused heap blocks (``rpc/runtime.py``'s malloc settings) that are likely
still in a core's cache when they are joined, where a large one is written and read
again from main memory. But cutting a 1.6 MB tensor (the ps training benchmark's largest)
costs the join it would not need whole: async training read 0.75 of DDP with every tensor
over 512 KiB cut, 0.82 with 4 MiB frames, and 0.89-0.93 with tensors up to 4 MiB whole
and larger ones cut.

torch is imported lazily, so processes that never move tensors (the manager, the CLI,
task supervisors) start without paying the ~2.5 s import.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import msgpack

from clusterflow.rpc.errors import CodedError, ProtocolError
from clusterflow.rpc.pool import RECEIVE_POOL

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the header keys or frame layout."""

FRAME_BYTES = 512 * 1024
"""The frames a tensor over ``WHOLE_BYTES`` is cut into: big enough to amortise per-frame
cost, small enough to stay in cache until joined."""

WHOLE_BYTES = 4 * 1024 * 1024
"""Tensors up to this travel as one frame, received without a copy; larger ones are cut."""

KIND_REQUEST = "req"
KIND_ONEWAY = "one"
KIND_REPLY = "rep"
KIND_ERROR = "err"
KIND_MORE = "mor"
"""A later message of a request sent in parts (``encode_parts``): its header names the
request (``id``) and its place (``s``, 1 for the second message) and carries no body."""
KIND_PART = "prt"
"""A part of a reply sent while its handler still runs (``RpcServer``'s ``ReplyStream``):
the first (``s`` 0) describes the streamed tensors (``t``), every part carries their next
frames; the reply (``rep``) that ends it holds the body and any other tensors."""
_KINDS = frozenset({KIND_REQUEST, KIND_ONEWAY, KIND_REPLY, KIND_ERROR, KIND_MORE, KIND_PART})

PART_BYTES = 8 * 1024 * 1024
"""The tensor bytes of one message of a request sent in parts (``encode_parts``): the
receiver works on each message as it arrives (the ps checks a push's gradients) while
the next is on the wire. ZeroMQ hands a message over only whole, so a 64 MiB push in
one message leaves all of that work until its last byte came."""

DTYPES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "float32": 4,
        "float64": 8,
        "float16": 2,
        "bfloat16": 2,
        "int64": 8,
        "int32": 4,
        "int16": 2,
        "int8": 1,
        "uint8": 1,
        "bool": 1,
    }
)
"""The one table of tensor dtypes clusterflow moves and stores (the wire, a ps's
variables), each with its item size in bytes: torch's names, without ``torch.``."""


PACKER_KEEP_BYTES = 64 * 1024
"""A thread's header packer is dropped after a header larger than this: its buffer grows
to the largest header it packed and never shrinks, and a large body would stay held."""

_packers = threading.local()


def _pack(header: Mapping[str, Any]) -> bytes:
    """``msgpack.packb(header)`` through this thread's reused ``Packer``.

    ``packb`` builds a ``Packer`` (and its 256 KiB buffer) per call: more than half of a
    small header's encoding (0.6 against 0.2 us here). A ``Packer`` is not thread-safe,
    hence one per thread; it empties its buffer after each ``pack``, a failed one too.
    """
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, buf_size=4096)
    out: bytes = packer.pack(header)
    if len(out) > PACKER_KEEP_BYTES:
        _packers.packer = None
    return out


# torch warns once that a read-only buffer (a received ZeroMQ frame) backs a tensor.
# Receivers own those frames, so the warning says nothing useful here.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _torch() -> Any:
    module = sys.modules.get("torch")
    if module is None:
        import torch as module
    return module


def descriptor(name: str, tensor: torch.Tensor) -> list[Any]:
    """``[name, dtype, shape, nbytes]`` of ``tensor``, as a header's ``t`` lists it."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor dtype {dtype!r} cannot travel; supported: {', '.join(DTYPES)}")
    return [name, dtype, list(tensor.shape), tensor.numel() * tensor.element_size()]


def raw_frame(piece: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, as a zero-copy frame (a memoryview)."""
    return memoryview(piece.detach().reshape(-1).view(_torch().uint8).numpy())  # type: ignore[arg-type]


def _tensor_frames(tensor: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """Returns (descriptor tail, frames) for one tensor, viewing its memory in place."""
    torch = _torch()
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor dtype {dtype!r} cannot travel; supported: {', '.join(DTYPES)}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return [dtype, list(t.shape), 0], []
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if nbytes <= WHOLE_BYTES:
        return [dtype, list(t.shape), nbytes], [raw]
    frames = [raw[i : i + FRAME_BYTES] for i in range(0, nbytes, FRAME_BYTES)]
    return [dtype, list(t.shape), nbytes], frames


def encode(
    kind: str,
    request_id: int,
    method: str,
    body: Any = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    **extra: Any,
) -> list[Any]:
    """Builds the frames of one message.

    Args:
        kind: one of ``req``, ``one`` (one-way), ``rep``, ``err``.
        request_id: matches a reply to its request.
        method: the service method, such as ``health.ping``.
        body: any msgpack-able value.
        tensors: named tensors sent as raw frames after the header.
        extra: further header keys (error code and type, for error replies).

    Raises:
        ProtocolError: a tensor of a dtype that cannot travel, or a body msgpack rejects.
    """
    if not tensors and not extra:
        return [encode_small(kind, request_id, method, body)]
    header, frames = _message(kind, request_id, method, body, tensors, extra)
    frames[0] = _packed(header, method)
    return frames


def encode_small(kind: str, request_id: int, method: str, body: Any = None) -> bytes:
    """``encode(kind, request_id, method, body)``'s one frame, for a message without
    tensors or extra keys (``encode`` takes this way for one): the common call and its
    reply, built with fewer steps (a no-op round trip notices each; docs/benchmarks.md,
    "RPC round trip").

    Raises:
        ProtocolError: a body msgpack rejects.
    """
    header = {"v": PROTOCOL_VERSION, "k": kind, "id": request_id, "m": method}
    if body is not None:
        header["b"] = body
    return _packed(header, method)


def encode_parts(
    kind: str,
    request_id: int,
    method: str,
    body: Any = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    part_bytes: int = PART_BYTES,
    **extra: Any,
) -> list[list[Any]]:
    """The frames of one request as several messages, each of about ``part_bytes`` of
    tensor frames (at least one frame each); one message where it fits in one.

    The first message is ``encode``'s with ``n``, the number of messages, in its
    header; the later ones are ``KIND_MORE`` messages (header: ``id``, ``m``, ``s``, the
    message's place) with the next tensor frames. The first header describes every
    tensor, so a receiver knows from it what every later frame belongs to
    (``Pieces``). A tensor's frames may straddle two messages.

    Raises:
        ProtocolError: as ``encode``.
    """
    header, frames = _message(kind, request_id, method, body, tensors, extra)
    groups: list[list[Any]] = [[]]
    size = 0
    for frame in frames[1:]:
        if groups[-1] and size + len(frame) > part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(frame)
        size += len(frame)
    if len(groups) > 1:
        header["n"] = len(groups)
    messages = [[_packed(header, method), *groups[0]]]
    for seq, group in enumerate(groups[1:], 1):
        more = {"v": PROTOCOL_VERSION, "k": KIND_MORE, "id": request_id, "m": method, "s": seq}
        messages.append([_pack(more), *group])
    return messages


def encode_error(request_id: int, method: str, code: str, error: object) -> list[Any]:
    """An error reply: ``c`` the reason, ``e`` the class name (for messages), and for a
    ``CodedError`` ``w`` its wire code, by which the client raises the typed error."""
    error_type = type(error).__name__ if isinstance(error, BaseException) else ""
    extra = {"c": code, "e": error_type}
    if isinstance(error, CodedError) and error.wire_code:
        extra["w"] = error.wire_code
    return encode(KIND_ERROR, request_id, method, str(error), None, **extra)


def _message(
    kind: str,
    request_id: int,
    method: str,
    body: Any,
    tensors: Mapping[str, torch.Tensor] | None,
    extra: Mapping[str, Any],
) -> tuple[dict[str, Any], list[Any]]:
    """The header (unpacked) and ``[placeholder, *tensor frames]`` of one message."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": kind, "id": request_id, "m": method}
    if body is not None:
        header["b"] = body
    frames: list[Any] = [b""]
    if tensors:
        descriptors = []
        for name, tensor in tensors.items():
            descriptor, tensor_frames = _tensor_frames(tensor)
            descriptors.append([name, *descriptor])
            frames.extend(tensor_frames)
        header["t"] = descriptors
    header.update(extra)
    return header, frames


def _packed(header: Mapping[str, Any], method: str) -> bytes:
    try:
        return _pack(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"message body of {method!r} cannot be encoded: {exc}") from exc


class Pieces:
    """Which tensor each frame of a request sent in parts belongs to, as the frames come.

    A receiver that works on a message before the next has arrived (the ps's finite
    check of a push, ``RpcServer.register``'s ``check``) feeds each message's frames in
    order; ``feed`` names, per frame, its tensor and where in it the frame starts.

    Raises (``__init__``, ``feed``):
        ProtocolError: descriptors that are not ``[name, dtype, shape, nbytes]`` of a
            known dtype, or frames beyond the bytes they describe.
    """

    __slots__ = ("_at", "_descriptors", "_got", "total")

    def __init__(self, descriptors: Any) -> None:
        if descriptors is None:
            descriptors = []
        if not isinstance(descriptors, list):
            raise ProtocolError(f"malformed tensor descriptors {descriptors!r:.200}")
        for d in descriptors:
            if (
                not isinstance(d, list)
                or len(d) != 4
                or not isinstance(d[0], str)
                or d[1] not in DTYPES
                or not isinstance(d[3], int)
                or d[3] < 0
            ):
                raise ProtocolError(f"malformed tensor descriptor {d!r:.200}")
        self._descriptors: list[list[Any]] = descriptors
        self.total = sum(d[3] for d in descriptors)
        """The bytes every frame of the request holds together."""
        self._at = 0  # the descriptor the next frame belongs to
        self._got = 0  # bytes of it received

    def feed(self, frames: Sequence[Any]) -> list[tuple[str, str, int, Any]]:
        """``(name, dtype, byte offset in the tensor, frame)`` for each of ``frames``."""
        out = []
        descriptors = self._descriptors
        for frame in frames:
            size = len(frame.buffer) if hasattr(frame, "buffer") else len(frame)
            while self._at < len(descriptors) and descriptors[self._at][3] == 0:
                self._at += 1
            if self._at == len(descriptors):
                raise ProtocolError(f"a frame of {size} bytes after every tensor's bytes came")
            name, dtype, _, nbytes = descriptors[self._at]
            if size == 0 or self._got + size > nbytes:
                raise ProtocolError(
                    f"tensor {name!r}: a frame of {size} bytes at byte {self._got} of {nbytes}"
                )
            out.append((name, dtype, self._got, frame))
            self._got += size
            if self._got == nbytes:
                self._at, self._got = self._at + 1, 0
        return out


def piece(dtype: str, frame: Any) -> Any:
    """A received frame as a flat zero-copy tensor of ``dtype``; None where it holds no
    whole number of elements or sits misaligned for them (a sender that cut elsewhere)."""
    torch = _torch()
    flat = torch.frombuffer(_buffer(frame), dtype=torch.uint8)
    itemsize = DTYPES[dtype]
    if flat.numel() % itemsize or flat.data_ptr() % itemsize:
        return None
    return flat.view(getattr(torch, dtype))


def decode_header(frame: Any) -> dict[str, Any]:
    """Reads and checks the header frame.

    Raises:
        ProtocolError: not msgpack, not a map, missing keys, or another protocol version.
    """
    raw = (
        frame if type(frame) is bytes else frame.bytes if hasattr(frame, "bytes") else bytes(frame)
    )
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"malformed header frame ({len(raw)} bytes): {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"malformed header: expected a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks protocol version {version!r}; this side speaks {PROTOCOL_VERSION}"
        )
    if header.get("k") not in _KINDS:
        raise ProtocolError(f"malformed header: unknown message kind {header.get('k')!r}")
    if not isinstance(header.get("id"), int) or not isinstance(header.get("m"), str):
        raise ProtocolError("malformed header: 'id' must be an int and 'm' a string")
    return header


class Framed:
    """A tensor that arrived in several frames, kept as one flat view per frame.

    Joining the frames into one buffer was a full copy of the message on each end of a
    ps round trip (3.5 ms of a 64 MiB push+pull's ~43 ms on the ps, as much on the
    worker, ``benchmarks._ps_phases``), in series with everything else. A receiver that
    can work on the pieces (the ps's per-chunk optimizer step, a worker writing into its
    parameters) reads them where ZeroMQ received them; one that cannot calls ``join``.

    ``pieces`` cover the tensor in order (row-major), each a 1-D tensor of ``dtype`` of
    whole elements; ``starts[i]`` is the element at which piece ``i`` begins.
    """

    __slots__ = ("dtype", "pieces", "shape", "starts")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, pieces: Sequence[Any]) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.pieces: tuple[torch.Tensor, ...] = tuple(pieces)
        starts, at = [], 0
        for piece in self.pieces:
            starts.append(at)
            at += int(piece.numel())
        if at != math.prod(self.shape):
            raise ProtocolError(f"pieces hold {at} elements; shape {self.shape} needs more")
        self.starts: tuple[int, ...] = tuple(starts)

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return bool(self.dtype.is_floating_point)

    def join(self) -> torch.Tensor:
        """The whole tensor, in one buffer (a copy, from the receive pool)."""
        torch = _torch()
        itemsize = self.pieces[0].element_size() if self.pieces else 1
        flat = RECEIVE_POOL.take(self.numel() * itemsize)
        # A plain memcpy on this thread, through NumPy: torch's copy_ splits the work
        # over its OpenMP threads, and on a busy 2-core host the parallel region waits
        # for them: measured here, 124 ms for 64 MiB against 7 ms.
        dest = flat.numpy()
        offset = 0
        for piece in self.pieces:
            raw = piece.view(torch.uint8).numpy()
            dest[offset : offset + raw.size] = raw
            offset += raw.size
        del dest
        return flat.view(self.dtype).reshape(self.shape)

    def copy_into(self, target: torch.Tensor) -> None:
        """Writes the pieces into ``target`` (contiguous, of this shape), one copy each.

        Raises:
            ValueError: ``target`` is not contiguous or not of this many elements.
        """
        if not target.is_contiguous() or target.numel() != self.numel():
            raise ValueError(
                f"cannot write a framed {list(self.shape)} tensor into "
                f"{list(target.shape)} (contiguous: {target.is_contiguous()})"
            )
        torch = _torch()
        flat = target.detach().view(-1)
        if flat.device.type != "cpu" or flat.dtype != self.dtype:
            for start, piece in zip(self.starts, self.pieces, strict=True):
                flat[start : start + piece.numel()].copy_(piece)  # a cast, or to a device
            return
        # A plain memcpy per frame on this thread, through NumPy, as ``join``'s (torch's
        # copy_ of a 512 KiB frame would enter an OpenMP parallel region).
        dest = flat.view(torch.uint8).numpy()
        itemsize = flat.element_size()
        for start, piece in zip(self.starts, self.pieces, strict=True):
            raw = piece.view(torch.uint8).numpy()
            dest[start * itemsize : start * itemsize + raw.size] = raw


def decode_tensors(
    header: Mapping[str, Any], frames: Sequence[Any], *, framed: bool = False
) -> dict[str, Any]:
    """Rebuilds the tensors that follow the header, zero-copy where a tensor is one frame.

    ``framed``: a tensor in several frames arrives as a ``Framed`` of zero-copy views
    (where every frame holds whole, aligned elements; else it is joined, as without).

    Raises:
        ProtocolError: descriptors that do not match the frames that came.
    """
    descriptors = header.get("t")
    if not descriptors:
        if frames:
            raise ProtocolError(f"{len(frames)} unexpected frames after a header without tensors")
        return {}
    torch = _torch()
    out: dict[str, Any] = {}
    position = 0
    try:
        for name, dtype_name, shape, nbytes in descriptors:
            if dtype_name not in DTYPES:
                raise ProtocolError(f"tensor {name!r} has unsupported dtype {dtype_name!r}")
            dtype = getattr(torch, dtype_name)
            itemsize = DTYPES[dtype_name]
            if any(not isinstance(d, int) or d < 0 for d in shape) or (
                math.prod(shape) * itemsize != nbytes
            ):
                raise ProtocolError(
                    f"tensor {name!r}: shape {shape} of {dtype_name} does not fill {nbytes} bytes"
                )
            # A tensor's frames are the next ones whose sizes add up to its bytes: the
            # sender picks the cut (WHOLE_BYTES and FRAME_BYTES here), so peers that cut
            # differently still understand each other.
            parts, sizes, got = [], [], 0
            while got < nbytes and position < len(frames):
                part = frames[position]
                position += 1
                size = len(part.buffer) if hasattr(part, "buffer") else len(part)
                if size == 0:
                    raise ProtocolError(f"tensor {name!r}: an empty frame among its bytes")
                parts.append(part)
                sizes.append(size)
                got += size
            if got != nbytes:
                raise ProtocolError(f"tensor {name!r}: frames hold {got} of {nbytes} bytes")
            count = len(parts)
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            elif count == 1:
                flat = torch.frombuffer(_buffer(parts[0]), dtype=torch.uint8)
                if flat.data_ptr() % itemsize:
                    flat = flat.clone()  # small (<= 8 KiB): misaligned loads are UB in C++
                out[name] = flat.view(dtype).reshape(shape)
            else:
                views = [torch.frombuffer(_buffer(p), dtype=torch.uint8) for p in parts]
                whole = all(s % itemsize == 0 for s in sizes) and all(
                    v.data_ptr() % itemsize == 0 for v in views
                )
                pieces = [v.view(dtype) for v in views] if whole else views
                joined = (
                    Framed(shape, dtype, pieces) if whole else Framed([nbytes], torch.uint8, pieces)
                )
                if framed and whole:
                    out[name] = joined
                else:
                    out[name] = joined.join().view(dtype).reshape(shape)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        # RuntimeError: torch refusing a shape (too many dims, sizes it cannot index).
        raise ProtocolError(f"malformed tensor descriptors {descriptors!r:.200}: {exc}") from exc
    if position != len(frames):
        raise ProtocolError(f"{len(frames) - position} frames left over after the tensors")
    return out


def _buffer(part: Any) -> Any:
    return part.buffer if hasattr(part, "buffer") else part
