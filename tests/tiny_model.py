"""The small classifier that several test modules train, and its parameters as one vector.

Shared so that a test comparing two runs (one process against a cluster, a resumed run
against an unbroken one) builds the same model from the same seed everywhere. Test
modules import it as ``tiny_model``: pytest puts tests/ on the path when it loads
tests/conftest.py.
"""

from __future__ import annotations

import torch
from torch import nn


def make_model() -> nn.Module:
    """6 features in, 3 classes out, seeded: every call gives the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, detached, in one 1-D tensor (to compare two models)."""
    return torch.cat([p.detach().flatten() for p in model.parameters()])
