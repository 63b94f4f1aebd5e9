"""What one worker's data client is told: ``DataConfig``, checked once, in one place.

Apart from the client (``client.py``) because it is a value: the dataset's identity,
which every worker of a dataset must agree on, and the knobs of one worker's reading,
which ``distributed_dataset`` and the strategies pass through without the client's
threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow._checks import whole
from clusterflow.data.messages import MAX_LEASES_PER_CALL
from clusterflow.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How one worker consumes one dataset. Every worker of a dataset must agree on the
    fields that define it (``name``, ``split_size``, ``seed``, ``epochs``)."""

    name: str = "default"
    """The dataset's name on the dispatcher."""
    batch_size: int = 32
    """Records per batch; the last batch a worker gets of an epoch may be smaller."""
    split_size: int = 1024
    """Records per lease; for Parquet, the row-group size (a split then reads one)."""
    seed: int = 0
    """Seeds the split order of each epoch and the shuffle buffers."""
    epochs: int | None = 1
    """Epochs to go through; None for ever."""
    shuffle_buffer: int = 0
    """Records shuffled together inside a split (0: split order only); at least the
    split size gives a full permutation of each split."""
    prefetch: int = 4
    """Batches' worth of records read ahead of the training loop, rounded up to whole
    splits (at least one split is always read ahead, besides the one being cut)."""
    leases_ahead: int = 4
    """Splits kept leased ahead of the reading thread, besides those read ahead: once
    half of them are taken, one dispatcher call asks for the rest (``data.lease`` with a
    count). Four keeps a split ready to read through a round trip slowed by a busy
    core and halves the calls; each such split is this worker's until acked, so more
    ahead holds more of the last splits of the data away from idle peers (a dead worker's
    go back to the queue all the same). At most ``MAX_LEASES_PER_CALL``."""
    auto_ack: bool = True
    """Ack a batch's completed leases when the next batch is asked for. Turn off when a
    parameter server acks them with the update it applies."""
    wait_for_all_acks: bool | None = None
    """At the end of the data, wait until every worker's leases are acked, so that a
    dead worker's splits still come back to the survivors: what parameter-server
    training needs (a dead worker is replaced; the others go on). False stops as soon
    as nothing is left to lend: what synchronous all-reduce training needs, whose ranks
    must leave the loop for the others to finish their last steps (DDP's ``join()``),
    and where a dead rank restarts the whole cluster from a checkpoint anyway. None:
    False in the simple mode (``auto_ack``), True when a parameter server acks."""

    @property
    def waits_for_all_acks(self) -> bool:
        return not self.auto_ack if self.wait_for_all_acks is None else self.wait_for_all_acks

    def __post_init__(self) -> None:
        # Checked here too, not only by the DatasetSpec the client builds from it: a
        # DataConfig is also given to the strategies and distributed_dataset, and a
        # negative epochs or a string seed should be refused where it was written.
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "seed", whole("seed", self.seed))
        if self.epochs is not None:
            object.__setattr__(self, "epochs", whole("epochs", self.epochs, least=1))
        for key in ("batch_size", "split_size", "prefetch", "leases_ahead"):
            # Kept as a Python int: a numpy one would not cross msgpack to the dispatcher.
            object.__setattr__(self, key, whole(key, getattr(self, key), least=1))
        if self.leases_ahead > MAX_LEASES_PER_CALL:
            raise ConfigError(
                f"leases_ahead must be at most {MAX_LEASES_PER_CALL} (one call's most), "
                f"got {self.leases_ahead!r}"
            )
        object.__setattr__(self, "shuffle_buffer", whole("shuffle_buffer", self.shuffle_buffer))
