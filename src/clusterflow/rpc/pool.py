"""Recycled receive buffers for tensors that arrive in several frames.

A tensor cut into frames must be reassembled into one contiguous buffer. Allocating a
fresh 64 MiB buffer per message costs more than the copy itself: measured on this
machine, first-touch page faults make ``torch.empty`` + fill of 64 MiB take ~30 ms
against ~4 ms for warm memory, which capped a 64 MiB call at 0.45x raw TCP. Training
moves the same sizes every step (a pull, a push), so buffers are kept by exact size and
handed out again once every tensor viewing them is gone.

Ownership is tracked on a NumPy view that only the tensor's storage references: when
the last tensor (or view of it) dies, the storage drops that view, the weakref
finalizer fires, and the underlying array returns to the pool.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

DEFAULT_POOL_BYTES = 1 << 30
"""Most idle bytes kept: a few models' worth of pushes; beyond it buffers are freed."""


class ReceivePool:
    """Hands out uint8 tensors of an exact size, recycling released ones."""

    def __init__(self, max_idle_bytes: int = DEFAULT_POOL_BYTES) -> None:
        # Reentrant: an allocation inside _give can start the cyclic garbage collector,
        # which may finalize another pooled tensor and so re-enter _give on this thread.
        self._lock = threading.RLock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle = 0
        self.max_idle_bytes = max_idle_bytes

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` whose memory returns here when it is released."""
        import torch

        array: np.ndarray | None = None
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                array = stack.pop()
                self._idle -= nbytes
        if array is None:
            array = np.empty(nbytes, dtype=np.uint8)
        owner = array.view()
        weakref.finalize(owner, self._give, array)
        tensor = torch.from_numpy(owner)
        del owner
        return tensor

    def _give(self, array: np.ndarray) -> None:
        with self._lock:
            if self._idle + array.nbytes <= self.max_idle_bytes:
                self._free.setdefault(array.nbytes, []).append(array)
                self._idle += array.nbytes


RECEIVE_POOL = ReceivePool()
