"""What both sides' jobs share: the model, the batches, the step log.

The same MLP and the same global batch on both sides, so a restart under torchrun and a
re-formed group under clusterflow move the same state. Each batch is a function of its
records' ids (no file to read on the peer's side; the data service lends the same ids
on ours).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES = 784, 256, 10
GLOBAL_BATCH = 64
"""Rows per step over all replicas (32 each at 2 replicas, 16 at 4)."""
STEPS = 1_000_000  # the benchmark stops every run long before


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


_FREQS = torch.linspace(0.01, 3.0, FEATURES)


def batch(ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``ids``: features and labels computed from each id."""
    x = torch.as_tensor(ids, dtype=torch.float32)
    return torch.sin(x[:, None] * _FREQS[None, :]), torch.as_tensor(ids) % CLASSES


def log_step(out: Path, who: str, step: int, world: int) -> None:
    """Appends ``WHO STEP WORLD WALL_TIME`` to ``OUT/steps.log``."""
    _append(out / "steps.log", f"{who} {step} {world} {time.time():.6f}\n")


def mark(out: Path, who: str, what: str, at: float | None = None) -> None:
    """Appends ``WHO WHAT WALL_TIME`` to ``OUT/marks.log``: where a job's start went."""
    _append(out / "marks.log", f"{who} {what} {time.time() if at is None else at:.6f}\n")


def _append(path: Path, line: str) -> None:
    # O_APPEND: whole lines from any number of processes.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
