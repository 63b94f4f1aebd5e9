"""The data service's contracts: the ``Source`` protocol, the values on the wire, the errors.

The dispatcher deals in record *ranges*, never in records: a dataset is ``num_records``
records cut into splits of ``split_size`` and handed out as leases. Workers read the
records of a lease from a ``Source`` themselves, so the dispatcher's cost does not grow
with record size and a corrupt record can only fail the worker that reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from clusterflow._checks import whole
from clusterflow.errors import ClusterflowError, ConfigError

Columns = Mapping[str, Any]
"""A run of records as named columns of equal length: NumPy arrays, or sequences of
Python values (strings, nested lists) where a column has no fixed-width type."""


# Errors -----------------------------------------------------------------------------


class DataError(ClusterflowError):
    """Base of every error the data service raises on purpose."""


class SourceError(DataError):
    """A source cannot be opened or read (missing file, not the format it claims)."""


class UnknownFormatError(DataError, ConfigError):
    """The files' format cannot be told from their names, and none was given.

    The remedy depends on where the path was given (``ArrowSource(format=...)``, a
    source passed to ``distributed_dataset``, ``clusterflow cache create --from``), so
    whoever took the path raises it again with its own (``with_remedy``).
    """

    def __init__(self, files: list[str], extensions: str, remedy: str) -> None:
        super().__init__(
            f"cannot tell the format of {files}: no name ends in {extensions}; {remedy}"
        )
        self.files, self.extensions, self.remedy = files, extensions, remedy

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.files, self.extensions, self.remedy))

    def with_remedy(self, remedy: str) -> UnknownFormatError:
        """The same error, its remedy that of the caller's context."""
        return UnknownFormatError(self.files, self.extensions, remedy)


class CollateError(DataError):
    """A record could not be turned into a batch; the message names its split and index."""


class DatasetConflictError(DataError, ConfigError):
    """A worker registered a dataset name with another definition than the first one."""


class UnknownDatasetError(DataError):
    """A call named a dataset that nobody registered with this dispatcher."""


class UnknownLeaseError(DataError):
    """An ack named a lease that this dispatcher never issued, or no longer holds."""


# Sources ----------------------------------------------------------------------------


@runtime_checkable
class Source(Protocol):
    """Where records live. Implement it to plug in a database or another store.

    A source must give the same records in the same order in every process that opens
    it: the dispatcher only hands out index ranges, and each worker resolves its range
    against its own instance of the source.
    """

    def num_records(self) -> int:
        """How many records the source holds (constant for its lifetime)."""
        ...

    def read(self, start: int, stop: int) -> Columns:
        """Records ``[start, stop)`` as named columns of ``stop - start`` entries each.

        Raises:
            SourceError: the records cannot be read; the message names the location.
        """
        ...


@runtime_checkable
class LocatedSource(Source, Protocol):
    """A source that knows which host stores a range, so splits go to nearby workers.

    Workers ask it once per split when they register. A source whose ``location`` may
    know nothing can say so with a ``has_locations`` attribute that is False.
    """

    def location(self, start: int, stop: int) -> str | None:
        """The host that stores records ``[start, stop)``, or None if none is closer."""
        ...


def describe_source(source: Source) -> str:
    """A stable text naming what a source reads, compared when workers register.

    Sources may define a ``uri`` attribute (the built-in ones do); otherwise the class
    name stands in, so two workers with different sources of the same class and size
    are not told apart (the record count still is).
    """
    uri = getattr(source, "uri", None)
    return str(uri) if uri else f"{type(source).__module__}.{type(source).__qualname__}"


# Values on the wire -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSpec:
    """One dataset's definition as every worker registers it.

    The first worker to register a name defines the dataset; later workers must send an
    equal spec to join it, so a worker with another file or seed fails loudly instead of
    silently training on something else.
    """

    name: str
    """The dataset's name on the dispatcher (one dispatcher serves many datasets)."""
    source: str
    """What the records are read from (``describe_source``), compared on registration."""
    num_records: int
    """Records per epoch."""
    split_size: int = 1024
    """Records per lease. Smaller balances better and loses less on a worker's death;
    larger costs fewer dispatcher round trips. For Parquet, match the row-group size."""
    seed: int = 0
    """Seeds the per-epoch order of splits (and shuffle buffers): same seed, same run."""
    epochs: int | None = 1
    """Epochs to hand out; None hands out epochs for ever."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"dataset name must be a non-empty string, got {self.name!r}")
        # Kept as Python ints: the spec crosses msgpack, which carries no numpy integer.
        for key, least in (("num_records", 1), ("split_size", 1), ("seed", 0)):
            object.__setattr__(self, key, whole(key, getattr(self, key), least=least))
        if self.epochs is not None:
            object.__setattr__(self, "epochs", whole("epochs", self.epochs, least=1))

    @property
    def num_splits(self) -> int:
        return -(-self.num_records // self.split_size)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: Any) -> DatasetSpec:
        """Parses a spec from a message body.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        if not isinstance(body, Mapping):
            raise ConfigError(f"dataset spec must be a mapping, got {body!r}")
        try:
            return cls(
                name=body["name"],
                source=str(body["source"]),
                num_records=body["num_records"],
                split_size=body["split_size"],
                seed=body["seed"],
                epochs=body["epochs"],
            )
        except KeyError as exc:
            raise ConfigError(f"dataset spec lacks field {exc.args[0]!r}") from None

    def differences(self, other: DatasetSpec) -> list[str]:
        """``field: ours != theirs`` for each field that differs."""
        return [
            f"{key}: {mine!r} != {theirs!r}"
            for (key, mine), theirs in zip(
                self.to_wire().items(), other.to_wire().values(), strict=True
            )
            if mine != theirs
        ]


@dataclass(frozen=True, slots=True)
class Lease:
    """Records ``[start, stop)`` of ``epoch`` of a dataset, lent to one worker.

    Ack it once the update computed from its records has been applied; until then it
    can go back to the queue (its worker died or fell silent past the deadline).
    """

    lease_id: int
    epoch: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def to_wire(self) -> list[int]:
        return [self.lease_id, self.epoch, self.start, self.stop]

    @classmethod
    def from_wire(cls, item: Any) -> Lease:
        lease_id, epoch, start, stop = item
        return cls(int(lease_id), int(epoch), int(start), int(stop))


class SplitKey(NamedTuple):
    """The stable name of one split of one epoch: ``(dataset, epoch, split)``.

    A lease id names one lending; a split lent again (its worker died) gets a new lease
    id but keeps its key. A parameter server applies an update at most once per key,
    which is what makes a re-lent split's second delivery harmless (failure-semantics.md).
    """

    dataset: str
    epoch: int
    split: int

    def to_wire(self) -> list[Any]:
        """As the ps reads it (``ps/wire.split_keys``, the one decoder of split keys)."""
        return [self.dataset, self.epoch, self.split]
