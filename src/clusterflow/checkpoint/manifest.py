"""Values and errors of a checkpoint: its parts, its manifest, the names on disk.

A checkpoint is a folder ``ckpt-<step>`` holding one file per part and, written last and
atomically, ``MANIFEST.json``: the list of parts with their sizes and sha256 checksums.
The manifest is the commit record, so it is validated strictly when read (a torn or
hand-edited one must never pass for a checkpoint) and carries a checksum of its own
body, which catches a truncation or an edit that still parses as JSON.

Nothing here imports torch: the manager reads manifests and JSON parts without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from clusterflow.errors import ClusterflowError

__all__ = [
    "MANIFEST_FILE",
    "CheckpointError",
    "Manifest",
    "PartInfo",
    "PartKind",
    "checkpoint_dirname",
    "parse_dirname",
    "validate_part_name",
    "validate_step",
]

PartKind = Literal["tensors", "json"]
PART_KINDS: Final = ("tensors", "json")
EXTENSIONS: Final[dict[str, str]] = {"tensors": ".safetensors", "json": ".json"}
"""The data file's extension for each kind of part."""

MANIFEST_FILE: Final = "MANIFEST.json"
FORMAT: Final = "clusterflow.checkpoint"
VERSION: Final = 1
"""Bumped when the manifest's layout changes; a reader refuses versions it does not know."""

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
# Part files are "<name>.<token>.<ext>": flat (no "/"), so a manifest cannot point
# outside its own folder.
_FILE = re.compile(r"[A-Za-z0-9_.-]{1,255}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIRNAME = re.compile(r"ckpt-([0-9]{12,})")


class CheckpointError(ClusterflowError):
    """A checkpoint cannot be written or read; the message names the part, file or value."""


class CheckpointWriteError(CheckpointError, OSError):
    """The filesystem refused a checkpoint's bytes (a full disk, a lost mount).

    An ``OSError`` too, with the errno of the failure, so code that handled the
    filesystem's error still does; its one-line message names the checkpoint's folder.
    Nothing was committed: the previous checkpoint stays the newest intact one.
    """

    def __init__(self, errno: int | None, message: str) -> None:
        OSError.__init__(self, errno, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def validate_part_name(name: object) -> str:
    """Returns ``name`` if it can name a part (it becomes part of file names), else raises.

    Raises:
        CheckpointError: ``name`` is not 1 to 200 of ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CheckpointError(
            f"bad part name {name!r}: use 1 to 200 letters, digits, '_', '.' or '-'"
        )
    return name


def validate_step(step: object) -> int:
    """Returns ``step`` if it is a non-negative int (not a bool), else raises CheckpointError."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
    return step


def checkpoint_dirname(step: int) -> str:
    """The folder of the checkpoint at ``step``; zero-padded so names sort like steps."""
    return f"ckpt-{validate_step(step):012d}"


def parse_dirname(name: str) -> int | None:
    """The step of a checkpoint folder's name, or None if ``name`` is not one."""
    match = _DIRNAME.fullmatch(name)
    return int(match.group(1)) if match else None


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise CheckpointError(what)


@dataclass(frozen=True, slots=True)
class PartInfo:
    """One part of a checkpoint as the manifest records it; validated when built."""

    name: str
    """The part's name (``ps-0``, ``worker-1``, ``data``), unique in its checkpoint."""
    file: str
    """Its data file, relative to the checkpoint folder."""
    sha256: str
    """Hex sha256 of the data file's bytes, taken while it was written."""
    size: int
    """The data file's length in bytes."""
    kind: PartKind
    """``tensors`` (a safetensors file) or ``json``."""

    def __post_init__(self) -> None:
        validate_part_name(self.name)
        _require(
            self.kind in PART_KINDS,
            f"part {self.name!r}: kind must be 'tensors' or 'json', got {self.kind!r}",
        )
        _require(
            isinstance(self.file, str)
            and bool(_FILE.fullmatch(self.file))
            and self.file != MANIFEST_FILE
            and self.file.endswith(EXTENSIONS[self.kind]),
            f"part {self.name!r}: bad file name {self.file!r} for a {self.kind} part",
        )
        _require(
            isinstance(self.sha256, str) and bool(_SHA256.fullmatch(self.sha256)),
            f"part {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}",
        )
        _require(
            not isinstance(self.size, bool) and isinstance(self.size, int) and self.size >= 0,
            f"part {self.name!r}: size must be a non-negative integer, got {self.size!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "sha256": self.sha256,
            "size": self.size,
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, data: object) -> PartInfo:
        """Builds one from ``to_dict``'s form; exactly those keys, else CheckpointError."""
        keys = {"name", "file", "sha256", "size", "kind"}
        if not isinstance(data, dict) or set(data) != keys:
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"a part's info must have the keys {sorted(keys)}, got {found}")
        return cls(data["name"], data["file"], data["sha256"], data["size"], data["kind"])


@dataclass(frozen=True, slots=True)
class Manifest:
    """A committed checkpoint: its step, its parts with their checksums, and free meta."""

    step: int
    """The training step (or ps version) the checkpoint holds."""
    created: float
    """When it was committed (seconds since the epoch, the committer's clock)."""
    parts: dict[str, PartInfo]
    """Every part of the cut, by name."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the committer adds (strategy kind, versions, ...); JSON values."""
    directory: str = ""
    """The checkpoint's folder (path or URL); where it was read from, not serialized."""

    def __post_init__(self) -> None:
        validate_step(self.step)
        _require(
            not isinstance(self.created, bool)
            and isinstance(self.created, int | float)
            and math.isfinite(self.created),
            f"manifest of step {self.step}: created must be a finite number, got {self.created!r}",
        )
        _require(
            isinstance(self.parts, dict),
            f"manifest of step {self.step}: parts must be a dict, got {type(self.parts).__name__}",
        )
        files: set[str] = set()
        for name, part in self.parts.items():
            _require(
                isinstance(part, PartInfo) and part.name == name,
                f"manifest of step {self.step}: entry {name!r} is not the PartInfo of {name!r}",
            )
            _require(
                part.file not in files,
                f"manifest of step {self.step}: file {part.file!r} is listed twice",
            )
            files.add(part.file)
        _require(
            isinstance(self.meta, dict) and all(isinstance(k, str) for k in self.meta),
            f"manifest of step {self.step}: meta must be a dict with string keys",
        )
        _require(isinstance(self.directory, str), "manifest directory must be a string")

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "created": self.created,
            "parts": {
                name: {k: v for k, v in part.to_dict().items() if k != "name"}
                for name, part in sorted(self.parts.items())
            },
            "meta": self.meta,
        }

    def to_json(self) -> str:
        """The manifest file's text: the body plus ``body_sha256``, a checksum of the body.

        Raises:
            CheckpointError: ``meta`` holds something JSON cannot represent.
        """
        body = self._body()
        try:
            digest = _body_digest(body)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"manifest of step {self.step}: meta is not JSON-serializable: {exc}"
            ) from None
        return json.dumps({**body, "body_sha256": digest}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, directory: str = "") -> Manifest:
        """Parses and validates a manifest file; ``directory`` is where it was read from.

        Raises:
            CheckpointError: the text is not a complete, valid manifest of a known
                version, or its body does not match its checksum (torn or edited).
        """
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"manifest is not valid JSON: {exc}") from None
        keys = {"format", "version", "step", "created", "parts", "meta", "body_sha256"}
        if not isinstance(data, dict) or set(data) != keys:
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"manifest must have the keys {sorted(keys)}, got {found}")
        if data["format"] != FORMAT or data["version"] != VERSION:
            raise CheckpointError(
                f"manifest format {data['format']!r} version {data['version']!r} is not "
                f"{FORMAT!r} version {VERSION}"
            )
        claimed = data.pop("body_sha256")
        if claimed != _body_digest(data):
            raise CheckpointError("manifest body does not match its body_sha256 (torn or edited)")
        parts = data["parts"]
        if not isinstance(parts, dict):
            raise CheckpointError(f"manifest parts must be an object, got {type(parts).__name__}")
        infos = {}
        for name, entry in parts.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"manifest part {name!r} must be an object")
            infos[name] = PartInfo.from_dict({"name": name, **entry})
        return cls(
            step=data["step"],
            created=data["created"],
            parts=infos,
            meta=data["meta"],
            directory=directory,
        )


def _body_digest(body: dict[str, Any]) -> str:
    # One canonical encoding on both sides; float repr round-trips exactly, so a parsed
    # body re-encodes to the bytes that were hashed when it was written.
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out
