"""Host buffers for device tensors on their way to and from the parameter servers.

The wire (``rpc/codec.py``) sends host memory. A GPU worker's gradients must reach host
memory first and the pulled values must go back to the device. ``tensor.cpu()`` would
allocate a fresh pageable tensor per variable per step and copy synchronously;
``HostStaging`` instead keeps one pinned buffer per variable (and per push slot),
allocated on first use and reused by every later step, so a step allocates nothing:

- **push**: each gradient (already cast to the wire dtype on the device, so bf16
  compression halves the copy too) is copied into its pinned buffer with
  ``non_blocking=True``; the copies of all variables are queued back to back and the
  stream is waited on once (``wait``), before the buffers are encoded. Two slots
  alternate, because with ``overlap_push`` the previous step's push may still be
  encoding its buffers while this step fills the others.
- **pull**: each received value is copied into its pinned buffer (a host copy) and from
  there to the device with ``non_blocking=True``: the DMA of one variable runs while
  the host copies the next, and the stream is waited on once at the end, before the
  step reads the values.

On a CPU worker nothing is staged: the wire already views the tensors' memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from clusterflow.rpc.codec import Framed

__all__ = ["HostStaging", "on_device"]


def on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives outside host memory (so it must be staged)."""
    return tensor.device.type != "cpu"


class HostStaging:
    """Reusable (pinned) host buffers for one worker's variables; see the module doc.

    Not thread-safe: the training thread fills and drains it (the background push only
    reads a slot's buffers, which ``begin_push`` does not hand out again until the push
    after next).

    Args:
        stage: which tensors to stage (default: those on a device). Tests pass
            ``lambda t: True`` to stage CPU tensors standing in for CUDA ones.
        pin: pin the buffers (default: when CUDA is available; pinning needs a driver).
    """

    def __init__(
        self, *, stage: Callable[[torch.Tensor], bool] = on_device, pin: bool | None = None
    ) -> None:
        self._stage = stage
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._slot = 0
        self._pending: set[torch.device] = set()
        self.allocations = 0
        """Buffers allocated so far: after the first two steps it stops growing."""

    def begin_push(self) -> None:
        """Starts a step's push: the other slot's buffers are handed out from now on."""
        self._slot ^= 1

    def to_host(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in host memory: itself when it is not staged, else its buffer of this
        push slot, filled asynchronously (call ``wait`` before reading it)."""
        if not self._stage(tensor):
            return tensor
        buffer = self._buffer(f"push{self._slot}", name, tensor)
        buffer.copy_(tensor, non_blocking=True)
        self._pending.add(tensor.device)
        return buffer

    def to_device(self, name: str, target: torch.Tensor, value: torch.Tensor | Framed) -> None:
        """Copies the host ``value`` into ``target`` (through ``name``'s pinned buffer when
        ``target`` is staged; call ``wait`` before ``target`` is read)."""
        if not self._stage(target):
            if isinstance(value, Framed) and target.is_contiguous():
                value.copy_into(target)  # frame by frame, from the received memory
            else:
                target.copy_(value.join() if isinstance(value, Framed) else value)
            return
        buffer = self._buffer("pull", name, value)
        # host to pinned host, frame by frame; a DMA is in flight meanwhile
        if isinstance(value, Framed):
            value.copy_into(buffer)
        else:
            buffer.copy_(value)
        target.copy_(buffer, non_blocking=True)
        self._pending.add(target.device)

    def wait(self) -> None:
        """Waits until every copy queued since the last ``wait`` is done."""
        for device in self._pending:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        self._pending.clear()

    def _buffer(self, kind: str, name: str, like: torch.Tensor | Framed) -> torch.Tensor:
        key = (kind, name)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=self._pin)
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer
