"""Storage and format of globally consistent checkpoints (docs/architecture.md section 6).

The low layer only: parts (safetensors tensors or JSON) written by any number of
processes into one folder, a manifest with their checksums committed atomically, the
newest intact checkpoint found again after a crash, and retention. Which parts make up
a consistent cut, and when to take one, is ``clusterflow.train.cut``'s.

Importing this package does not import torch (the manager reads manifests and the data
cursor without it); tensor parts import it when they are written or read.
"""

from __future__ import annotations

from clusterflow.checkpoint.manifest import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointWriteError,
    Manifest,
    PartInfo,
    PartKind,
    checkpoint_dirname,
    parse_dirname,
    validate_part_name,
)
from clusterflow.checkpoint.storage import CheckpointStorage, CheckpointWriter

__all__ = [
    "MANIFEST_FILE",
    "CheckpointError",
    "CheckpointStorage",
    "CheckpointWriteError",
    "CheckpointWriter",
    "Manifest",
    "PartInfo",
    "PartKind",
    "checkpoint_dirname",
    "parse_dirname",
    "validate_part_name",
]
