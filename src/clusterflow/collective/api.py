"""The collective engine's value types and errors; no torch import, so it is cheap to load.

``CommunicationOptions`` keeps TensorFlow's names (``implementation``, ``bytes_per_pack``,
``timeout_seconds``; ``RING``/``NCCL``/``AUTO``) so a ``tf.distribute`` user can read a
clusterflow script at sight, and adds what TensorFlow has no field for (gradient
compression, the rendezvous deadline).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from clusterflow.cluster import TaskId
from clusterflow.errors import ClusterflowError, ConfigError

__all__ = [
    "AllReduceAlgorithm",
    "CollectiveError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Compression",
    "MembershipError",
    "PeerLost",
]


class CommunicationImplementation(StrEnum):
    """Which library moves the tensors, named as ``tf.distribute.experimental``."""

    AUTO = "auto"
    """NCCL when this replica's device is a GPU, else gloo."""
    RING = "ring"
    """gloo's ring all-reduce over TCP: the CPU backend (TensorFlow's RING is gRPC rings)."""
    NCCL = "nccl"
    """NCCL; needs every replica on a CUDA device."""


class AllReduceAlgorithm(StrEnum):
    """How a gradient bucket is summed across the replicas (not in TensorFlow's options)."""

    BACKEND = "backend"
    """The library's own: gloo's ring, NCCL's ring or tree."""
    HIERARCHICAL = "hierarchical"
    """Inside each host of ``--replicas-per-host`` first, then across hosts among one
    replica each, then back inside (``collective/hierarchy.py``)."""


class Compression(StrEnum):
    """How gradients travel during the all-reduce (a DDP communication hook)."""

    NONE = "none"
    """As computed (fp32 for fp32 models)."""
    BF16 = "bf16"
    """Cast to bfloat16 (fp32's range, 8 bits of mantissa) and back: half the bytes."""
    FP16 = "fp16"
    """Cast to float16: half the bytes, more mantissa, but overflows past 65504."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommunicationOptions:
    """How replicas talk; ``tf.distribute.experimental.CommunicationOptions`` plus two fields.

    Raises:
        ConfigError: on construction, for a non-positive size or timeout or an unknown
            implementation or compression name.
    """

    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    """The backend: AUTO (by device), RING (gloo) or NCCL."""
    bytes_per_pack: int = 0
    """Gradient bucket size in bytes (DDP's ``bucket_cap_mb``); 0 keeps DDP's 25 MiB."""
    timeout_seconds: float | None = 300.0
    """How long a collective may wait for a peer before it fails naming the peer.

    TensorFlow's default is no timeout; ours is five minutes, because a hung peer must
    end in an error (docs/architecture.md section 6), and the slowest legitimate wait, a peer
    loading its first batch, is far shorter. ``None`` means torch's own default.
    """
    rendezvous_timeout_seconds: float = 300.0
    """How long forming the group may wait for every replica to start (import torch,
    load data); longer than a step's wait, since tasks start minutes apart on busy hosts."""
    compression: Compression = Compression.NONE
    """Gradient compression for the all-reduce (not in TensorFlow's options)."""
    algorithm: AllReduceAlgorithm = AllReduceAlgorithm.BACKEND
    """How a bucket is summed: the backend's own (gloo's ring), or ``hierarchical`` over
    the hosts of ``--replicas-per-host``, clusterflow's, uncompressed only (not in
    TensorFlow's options)."""

    def __post_init__(self) -> None:
        for name, enum in (
            ("implementation", CommunicationImplementation),
            ("compression", Compression),
            ("algorithm", AllReduceAlgorithm),
        ):
            value = getattr(self, name)
            try:
                # Frozen dataclass: normalising a string to the enum in place is the way.
                object.__setattr__(self, name, enum(str(value).lower()))
            except ValueError:
                choices = ", ".join(m.name for m in enum)
                raise ConfigError(f"unknown {name} {value!r}; expected one of {choices}") from None
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int):
            raise ConfigError(f"bytes_per_pack must be an integer, got {self.bytes_per_pack!r}")
        if self.bytes_per_pack < 0:
            raise ConfigError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}")
        if (
            self.algorithm is not AllReduceAlgorithm.BACKEND
            and self.compression is not Compression.NONE
        ):
            raise ConfigError(
                f"algorithm {self.algorithm.name} with compression {self.compression.name}: "
                "clusterflow's own all-reduce algorithms move gradients uncompressed; "
                "choose one"
            )
        _check_seconds("timeout_seconds", self.timeout_seconds, optional=True)
        _check_seconds("rendezvous_timeout_seconds", self.rendezvous_timeout_seconds)


def _check_seconds(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


class CollectiveError(ClusterflowError):
    """A collective (all-reduce, broadcast, barrier) failed or could not be formed."""


class MembershipError(CollectiveError, ConfigError):
    """The environment and the cluster spec disagree on who the replicas are.

    Raised before any connection is made, naming both values (``WORLD_SIZE=3`` against a
    spec with two computing tasks), because a mismatch otherwise shows up as a
    rendezvous that never completes.
    """


class PeerLost(CollectiveError):
    """A collective failed because one or more replicas died or stopped answering.

    Attributes:
        ranks: the ranks that stopped heartbeating (or the store host that vanished).
        tasks: their tasks (``worker:1``), where the cluster spec names them.
    """

    def __init__(
        self, message: str, *, ranks: Sequence[int] = (), tasks: Sequence[TaskId | None] = ()
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.tasks = tuple(tasks)
