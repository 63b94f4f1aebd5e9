"""TensorFlow device strings (``/job:ps/replica:0/task:1/device:CPU:0``) as values.

Placement (which ps holds a variable, which GPU a replica uses) is written in
TensorFlow's device syntax so that users' existing strings keep working; this module
reads and writes that syntax and translates the device part to PyTorch's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, TypeVar

from clusterflow.cluster.errors import DeviceSpecError
from clusterflow.cluster.spec import JOB_NAME_RE, TaskId

__all__ = ["DeviceSpec"]

# TensorFlow's names, stored lowercase; "cuda" is accepted because PyTorch users write it,
# and stored as "gpu" so one device has one spelling.
_DEVICE_TYPES: Final = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}
_DIGITS_RE: Final = re.compile(r"[0-9]+")
_ANY_INDEX: Final = "*"
_T = TypeVar("_T")


def _check_count(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise DeviceSpecError(f"invalid {name} {value!r}: expected an integer >= 0 or None")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """A possibly partial device name; every field may be unset (``None``).

    Unset fields mean "anywhere", as in TensorFlow: ``/job:ps`` is any device of any ps
    task. Construct with keywords, or with :meth:`parse`.

    Raises:
        DeviceSpecError: on construction, for a bad job name, a negative or non-integer
            number, an unknown device type, or a device index without a device type.
    """

    job: str | None = None
    """The job name, e.g. ``"ps"``."""
    replica: int | None = None
    """TensorFlow's replica number; kept for round-trips, always 0 in TensorFlow 2."""
    task: int | None = None
    """The task index within the job."""
    device_type: str | None = None
    """``"cpu"`` or ``"gpu"`` (lowercase; ``"CPU"`` and ``"cuda"`` are normalised)."""
    device_index: int | None = None
    """The device's index on its task; ``None`` means any (TensorFlow's ``*``)."""

    def __post_init__(self) -> None:
        if self.job is not None and (
            not isinstance(self.job, str) or not JOB_NAME_RE.fullmatch(self.job)
        ):
            raise DeviceSpecError(
                f"invalid job name {self.job!r}: a job name must match {JOB_NAME_RE.pattern}"
            )
        _check_count("replica", self.replica)
        _check_count("task", self.task)
        _check_count("device index", self.device_index)
        if self.device_type is not None:
            normal = (
                _DEVICE_TYPES.get(self.device_type.lower())
                if isinstance(self.device_type, str)
                else None
            )
            if normal is None:
                raise DeviceSpecError(
                    f"unknown device type {self.device_type!r}: expected one of "
                    + ", ".join(sorted(_DEVICE_TYPES))
                )
            # Frozen dataclass: normalising in place is the documented way.
            object.__setattr__(self, "device_type", normal)
        elif self.device_index is not None:
            raise DeviceSpecError(f"device index {self.device_index!r} given without a device type")

    @classmethod
    def parse(cls, spec: str) -> DeviceSpec:
        """Reads a TensorFlow device string.

        Accepts the parts ``/job:J``, ``/replica:N``, ``/task:N``, ``/device:TYPE:N`` and
        the short ``/TYPE:N`` or ``/TYPE`` (``/cpu:0``, ``/GPU:1``), in any order, each at
        most once; ``N`` of a device may be ``*``. The empty string is the empty spec.

        Raises:
            DeviceSpecError: ``spec`` is malformed; the message quotes it.
        """
        if not isinstance(spec, str):
            raise DeviceSpecError(f"device spec {spec!r} is not a string")
        if not spec:
            return cls()
        if not spec.startswith("/"):
            raise DeviceSpecError(f"invalid device spec {spec!r}: it must start with '/'")
        fields: dict[str, str] = {}
        arity: tuple[int, ...]
        for part in spec[1:].split("/"):
            if not part:
                raise DeviceSpecError(
                    f"invalid device spec {spec!r}: empty part ('//' or a final '/')"
                )
            name, *values = part.split(":")
            if name.lower() in _DEVICE_TYPES:  # the short form, "/cpu:0" or "/GPU"
                key, values, arity = "device", [name, *values], (1, 2)
            elif name == "device":
                key, arity = "device", (2,)
            elif name in ("job", "replica", "task"):
                key, arity = name, (1,)
            else:
                raise DeviceSpecError(f"invalid device spec {spec!r}: unknown part {part!r}")
            if len(values) not in arity or not all(values):
                raise DeviceSpecError(f"invalid device spec {spec!r}: malformed part {part!r}")
            if key in fields:
                raise DeviceSpecError(f"invalid device spec {spec!r}: {key} given twice")
            fields[key] = ":".join(values)
        device_type, _, device_index = fields.get("device", "").partition(":")
        try:
            return cls(
                job=fields.get("job"),
                replica=_parse_number("replica", fields.get("replica")),
                task=_parse_number("task", fields.get("task")),
                device_type=device_type or None,
                # TensorFlow writes "any device of this type" as index "*".
                device_index=_parse_number(
                    "device index", None if device_index in ("", _ANY_INDEX) else device_index
                ),
            )
        except DeviceSpecError as err:
            raise DeviceSpecError(f"invalid device spec {spec!r}: {err}") from None

    @classmethod
    def from_string(cls, spec: str) -> DeviceSpec:
        """TensorFlow's name for :meth:`parse`."""
        return cls.parse(spec)

    def to_string(self) -> str:
        """The canonical form, ``/job:ps/replica:0/task:1/device:CPU:0``, minus unset parts.

        A device type without an index is written ``/device:GPU:*``, as TensorFlow does,
        because ``/device:GPU`` is not a string TensorFlow can read.
        """
        parts = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = _ANY_INDEX if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{self.device_type.upper()}:{index}")
        return "".join(parts)

    def __str__(self) -> str:
        return self.to_string()

    def merge(self, other: DeviceSpec) -> DeviceSpec:
        """A spec with ``other``'s set fields taking precedence over this one's.

        Field by field, as TensorFlow's ``DeviceSpec.make_merged_spec``: an unset field
        of ``other`` keeps this spec's value, so an inner ``with device(...)`` refines an
        outer one.
        """
        return DeviceSpec(
            job=_first(other.job, self.job),
            replica=_first(other.replica, self.replica),
            task=_first(other.task, self.task),
            device_type=_first(other.device_type, self.device_type),
            device_index=_first(other.device_index, self.device_index),
        )

    def make_merged_spec(self, other: DeviceSpec) -> DeviceSpec:
        """TensorFlow's name for :meth:`merge`."""
        return self.merge(other)

    @property
    def task_id(self) -> TaskId | None:
        """The task this spec names, or ``None`` unless both job and task are set."""
        if self.job is None or self.task is None:
            return None
        return TaskId(self.job, self.task)

    def torch_device(self) -> str:
        """The PyTorch device string for the device part: ``"cpu"``, ``"cuda:0"``, ``"cuda"``.

        A string, not a ``torch.device``, so this module does not import torch.

        Raises:
            DeviceSpecError: the spec names no device type.
        """
        if self.device_type is None:
            raise DeviceSpecError(
                f"device spec {self.to_string()!r} names no device type, so no torch device"
            )
        if self.device_type == "cpu":
            return "cpu"
        return "cuda" if self.device_index is None else f"cuda:{self.device_index}"


def _first(preferred: _T | None, fallback: _T | None) -> _T | None:
    return fallback if preferred is None else preferred


def _parse_number(name: str, text: str | None) -> int | None:
    if text is None:
        return None
    if not _DIGITS_RE.fullmatch(text):
        raise DeviceSpecError(f"{name} {text!r} is not an integer")
    return int(text)
