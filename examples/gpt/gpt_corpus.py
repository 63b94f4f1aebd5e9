"""The corpus every machine has: the Python standard library's own source files.

Bytes are tokens (vocabulary 256), so nothing is downloaded and nothing is trained
before the model. Files are split into training and validation by file (every 20th file
in sorted order is validation), so validation text is never seen in training, not even
as the other half of a file.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

__all__ = ["GlobalBatches", "load_corpus", "stdlib_files", "val_windows", "windows"]

VALIDATION_EVERY = 20
"""Every 20th file (5%) is validation: enough text for a stable loss, little lost."""


def stdlib_files(root: str | None = None) -> Iterator[Path]:
    """The standard library's ``.py`` files in one fixed order (the same on every task).

    Walked lazily, directories and files sorted, installed packages left out: a run that
    wants a few megabytes reads a few hundred files, not the whole tree.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for folder, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(names):
            if name.endswith(".py"):
                yield Path(folder) / name


def load_corpus(max_bytes: int, root: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` byte arrays: whole files, in order, up to ``max_bytes`` of
    training text and a twentieth of that of validation text (``max_bytes`` 0: all)."""
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    sizes = [0, 0]
    caps = (max_bytes, max(max_bytes // VALIDATION_EVERY, 1))
    for i, path in enumerate(stdlib_files(root)):
        is_val = int(i % VALIDATION_EVERY == 0)
        if max_bytes and sizes[is_val] >= caps[is_val]:
            if sizes[0] >= caps[0] and sizes[1] >= caps[1]:
                break
            continue
        text = path.read_bytes()
        parts[is_val].append(text)
        sizes[is_val] += len(text)
    if not sizes[0] or not sizes[1]:
        raise FileNotFoundError(
            f"too few .py files under {root or sysconfig.get_paths()['stdlib']}"
        )
    train, val = (np.frombuffer(b"".join(p), dtype=np.uint8) for p in parts)
    if max_bytes:
        train, val = train[: caps[0]], val[: caps[1]]
    return train, val


def windows(tokens: np.ndarray, context: int) -> np.ndarray:
    """Consecutive, non-overlapping records of ``context + 1`` tokens: ``(n, context + 1)``.

    A record is what the data service lends: inputs are its first ``context`` tokens,
    targets the last ``context`` (the next byte of each position).
    """
    n = len(tokens) // (context + 1)
    return np.ascontiguousarray(tokens[: n * (context + 1)].reshape(n, context + 1))


def val_windows(tokens: np.ndarray, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` validation records spread evenly over the validation text."""
    if len(tokens) < context + 2:
        raise ValueError(f"validation text of {len(tokens)} bytes is shorter than a record")
    starts = np.linspace(0, len(tokens) - context - 1, num=count).astype(np.int64)
    rec = torch.from_numpy(np.stack([tokens[s : s + context + 1] for s in starts]))
    return rec[:, :-1].contiguous(), rec[:, 1:].contiguous()


class GlobalBatches:
    """Step ``s``'s global batch: ``batch`` records at random offsets drawn from seed and
    step alone.

    Every task and every run draws the same batch for the same step, so a run on ``n``
    replicas (each taking its contiguous slice) and a run in one process are fed the
    same global batches, and a resumed run continues on the batch it would have seen.
    """

    def __init__(self, tokens: np.ndarray, *, context: int, batch: int, seed: int) -> None:
        if len(tokens) < context + 2:
            raise ValueError(f"training text of {len(tokens)} bytes is shorter than a record")
        self.tokens = torch.from_numpy(np.array(tokens, dtype=np.uint8))  # writable copy
        self.context = context
        self.batch = batch
        self.seed = seed
        self._span = torch.arange(context + 1)

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step`` (counted from 0): ``(inputs, targets)``, uint8."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - self.context - 1, (self.batch,), generator=gen)
        rec = self.tokens[starts[:, None] + self._span]
        return rec[:, :-1], rec[:, 1:]

    def stream(self, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Steps 0 .. ``steps - 1``, once (a one-pass stream: ``fit`` skips those a
        resumed run already took)."""
        for step in range(steps):
            yield self.at(step)
