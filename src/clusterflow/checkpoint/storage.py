"""Where checkpoints live: parts, sidecars and manifests on any fsspec filesystem.

Layout under the storage URL (docs/architecture.md section 6)::

    ckpt-000000000100/
        MANIFEST.json                    the commit record, written last and atomically
        ps-0.1f2e3d4c5b6a.safetensors    one data file per part, a fresh name per write
        ps-0.partinfo                    its sidecar: name, file, sha256, size, kind
        data.9a8b7c6d5e4f.json

Several processes write parts of one checkpoint at once, each its own; the committer
``collect``s the sidecars of the others (small JSON files, so nothing is read twice)
and writes the manifest. A data file is never overwritten: each write takes a new
name, so rewriting a step (a retry, or a ps version saved twice) cannot change the
bytes under a manifest that is already committed. A checkpoint is committed exactly
when its manifest is valid; a reader trusts a part only after its size and sha256 match
the manifest, so a torn write, a lost file or a flipped byte is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from clusterflow.checkpoint.files import open_files
from clusterflow.checkpoint.manifest import (
    EXTENSIONS,
    MANIFEST_FILE,
    CheckpointError,
    CheckpointWriteError,
    Manifest,
    PartInfo,
    PartKind,
    checkpoint_dirname,
    parse_dirname,
    validate_part_name,
    validate_step,
)

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointStorage", "CheckpointWriter"]

log = logging.getLogger(__name__)

SIDECAR_SUFFIX: Final = ".partinfo"
"""``<part>.partinfo``: never ends like a data file (.json, .safetensors), so no part's
data file can take a sidecar's name."""


class CheckpointStorage:
    """The checkpoints under one URL: write them, find the newest intact one, read parts.

    Every process of a cluster makes its own instance on the same URL; nothing is held
    open between calls, so instances never need closing.

    Args:
        url: a local path or any fsspec URL (``memory://x``, ``file:///x``, ``s3://b/x``).
        keep: committed checkpoints kept by each commit; older ones are deleted.

    Raises:
        CheckpointError: ``keep`` is not an integer of at least 1, ``url`` is empty, or
            a local ``url`` is a file (a restore would find no checkpoint there and start
            from scratch without a word).
    """

    def __init__(self, url: str | os.PathLike[str], *, keep: int = 3) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be an integer of at least 1, got {keep!r}")
        if not isinstance(url, str | os.PathLike):
            raise CheckpointError(f"checkpoint url must be a non-empty string, got {url!r}")
        url = os.fspath(url)
        if not isinstance(url, str) or not url:
            raise CheckpointError(f"checkpoint url must be a non-empty string, got {url!r}")
        self._url = url
        self._keep = keep
        self._files, self._root, self._local = open_files(url)
        if self._local and os.path.exists(self._root) and not os.path.isdir(self._root):
            raise CheckpointError(f"checkpoint folder {url!r} is a file, not a folder")
        # What manifests report as their folder: a plain path when local, else the URL.
        self._base = self._root if self._local else url.rstrip("/")

    @property
    def url(self) -> str:
        """The URL (or path) this storage was made with."""
        return self._url

    @property
    def keep(self) -> int:
        """How many committed checkpoints a commit keeps."""
        return self._keep

    def __repr__(self) -> str:
        return f"CheckpointStorage({self._url!r}, keep={self._keep})"

    def directory(self, step: int) -> str:
        """The folder (path or URL) of the checkpoint at ``step``, whether it exists or not."""
        name = checkpoint_dirname(step)
        return os.path.join(self._base, name) if self._local else f"{self._base}/{name}"

    def _dir(self, step: int) -> str:
        return self._files.join(self._root, checkpoint_dirname(step))

    def _file(self, step: int, name: str) -> str:
        return self._files.join(self._dir(step), name)

    # Writing ----------------------------------------------------------------------------

    def writer(self, step: int) -> CheckpointWriter:
        """A writer for the checkpoint at ``step``, one per process that writes parts.

        Raises:
            CheckpointError: ``step`` is not a non-negative integer.
        """
        return CheckpointWriter(self, validate_step(step))

    # Reading ----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of every checkpoint folder, committed or not, oldest first."""
        found = (parse_dirname(name) for name in self._files.list_dirs(self._root))
        return sorted(step for step in found if step is not None)

    def _load(self, step: int) -> Manifest | None:
        """The manifest of ``step``; None if there is none (not committed).

        Raises:
            CheckpointError: there is one, but it is torn or invalid.
        """
        try:
            text = self._files.read(self._file(step, MANIFEST_FILE))
        except FileNotFoundError:
            return None
        manifest = Manifest.from_json(text, directory=self.directory(step))
        if manifest.step != step:
            raise CheckpointError(f"its manifest is for step {manifest.step}")
        return manifest

    def at(self, step: int) -> Manifest | None:
        """The committed checkpoint of ``step`` (one read, no listing), or None.

        None also for a torn or invalid manifest, with a warning, as :meth:`committed`.
        Its parts are checked when they are read.
        """
        try:
            return self._load(validate_step(step))
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", self.directory(step), exc)
            return None

    def committed(self) -> list[Manifest]:
        """Every committed checkpoint whose manifest is valid, oldest first.

        Parts are not checked here (see :meth:`latest`). A folder whose manifest is torn
        or invalid is skipped with a warning; one without a manifest is still being
        written (or was abandoned) and is skipped silently.
        """
        out = []
        for step in self.steps():
            try:
                manifest = self._load(step)
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", self.directory(step), exc)
                continue
            if manifest is not None:
                out.append(manifest)
        return out

    def latest(self, *, verify: bool = True) -> Manifest | None:
        """The newest committed checkpoint whose parts are all there and intact.

        A checkpoint with a missing part, a part of the wrong size or (``verify``) a part
        whose sha256 differs from its manifest's is skipped with a warning naming its
        folder and the reason, and the one before it is tried. ``verify`` reads every
        byte of the checkpoint; without it, only sizes are checked (one listing).

        Returns:
            its manifest, or None if no checkpoint is intact.
        """
        for manifest in reversed(self.committed()):
            problem = self._problem(manifest, verify=verify)
            if problem is None:
                return manifest
            log.warning(
                "skipping checkpoint %s: %s; falling back to the one before",
                manifest.directory,
                problem,
            )
        return None

    def _problem(
        self, manifest: Manifest, *, verify: bool, files: Mapping[str, int] | None = None
    ) -> str | None:
        """Why ``manifest``'s parts cannot be trusted, or None if they can."""
        if files is None:
            files = self._files.list_files(self._dir(manifest.step))
        for part in manifest.parts.values():
            size = files.get(part.file)
            if size is None:
                return f"part {part.name!r} ({part.file}) is missing"
            if size != part.size:
                return f"part {part.name!r} has {size} bytes, its manifest says {part.size}"
        if verify:
            for part in manifest.parts.values():
                try:
                    digest = self._files.sha256(self._file(manifest.step, part.file))
                except FileNotFoundError:
                    return f"part {part.name!r} ({part.file}) is missing"
                if digest != part.sha256:
                    return f"part {part.name!r} fails its sha256 check"
        return None

    def _read_part(self, manifest: Manifest, name: str, kind: PartKind) -> bytes:
        """The bytes of a part, after their size and sha256 match the manifest."""
        expected = self.directory(manifest.step)
        if manifest.directory != expected:
            raise CheckpointError(
                f"manifest of step {manifest.step} is from {manifest.directory!r}, "
                f"not {expected!r} of this storage"
            )
        part = manifest.parts.get(name)
        if part is None:
            raise CheckpointError(
                f"checkpoint {expected} has no part {name!r}; it has {sorted(manifest.parts)}"
            )
        if part.kind != kind:
            raise CheckpointError(f"part {name!r} of {expected} holds {part.kind}, not {kind}")
        try:
            data = self._files.read(self._file(manifest.step, part.file))
        except FileNotFoundError:
            raise CheckpointError(f"part {name!r} of {expected} is missing ({part.file})") from None
        if len(data) != part.size:
            raise CheckpointError(
                f"part {name!r} of {expected} has {len(data)} bytes, its manifest says {part.size}"
            )
        if hashlib.sha256(data).hexdigest() != part.sha256:
            raise CheckpointError(f"part {name!r} of {expected} fails its sha256 check")
        return data

    def read_tensors(
        self, manifest: Manifest, name: str
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(meta, tensors)`` of a tensor part; CPU tensors that own their memory.

        The bytes are checked against the manifest before anything is decoded, and
        decoding is safetensors' (no pickle).

        Raises:
            CheckpointError: no such part, or it is missing, torn, altered or not a
                valid safetensors file.
        """
        from clusterflow.checkpoint.tensors import decode

        return decode(name, self._read_part(manifest, name, "tensors"))

    def read_json(self, manifest: Manifest, name: str) -> Any:
        """The value of a JSON part, checked against the manifest first; needs no torch.

        Raises:
            CheckpointError: no such part, or it is missing, torn, altered or not JSON.
        """
        data = self._read_part(manifest, name, "json")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CheckpointError(f"part {name!r} is not valid JSON: {exc}") from None

    # Retention ----------------------------------------------------------------------------

    def _prune(self, current: Manifest) -> None:
        """Keeps the newest ``keep`` intact checkpoints up to ``current``, deletes the rest.

        * committed checkpoints of a *later* step than ``current`` come from a timeline
          abandoned by a restart (or a deliberate restore of an older step): their
          manifests are removed, so a newest-first search cannot find them, and their
          folders are left for in-progress writers of that step;
        * uncommitted or broken folders older than ``current`` are deleted; newer
          uncommitted ones are not (another process may be writing them);
        * the kept checkpoints lose the data files their manifest does not list (parts
          of an earlier write of the same step), except ``current`` itself, whose old
          files a reader of the manifest it replaced may still be reading.
        """
        self._files.remove_trash(self._root)
        intact: list[tuple[Manifest, dict[str, int]]] = []
        for step in self.steps():
            folder = self._dir(step)
            if step == current.step:
                intact.append((current, {}))
                continue
            try:
                manifest = self._load(step)
            except CheckpointError as exc:
                manifest, reason = None, f"torn manifest ({exc})"
            else:
                reason = "uncommitted"
            if step > current.step:
                if manifest is not None:
                    log.warning(
                        "retiring checkpoint %s: step %d was committed after it",
                        self.directory(step),
                        current.step,
                    )
                    self._files.remove(self._files.join(folder, MANIFEST_FILE))
                continue
            files = self._files.list_files(folder)
            if manifest is not None:
                problem = self._problem(manifest, verify=False, files=files)
                if problem is None:
                    intact.append((manifest, files))
                    continue
                reason = problem
            log.info("removing checkpoint folder %s (%s)", self.directory(step), reason)
            self._remove(step)
        for manifest, _ in intact[: -self._keep]:
            log.info("removing checkpoint %s (keeping %d)", manifest.directory, self._keep)
            self._remove(manifest.step)
        for manifest, files in intact[-self._keep :]:
            if manifest is current:
                continue
            listed = {MANIFEST_FILE} | {p.file for p in manifest.parts.values()}
            for name in files:
                if name not in listed and not name.endswith(SIDECAR_SUFFIX):
                    self._files.remove(self._file(manifest.step, name))

    def _remove(self, step: int) -> None:
        """Deletes a checkpoint folder, its manifest first (uncommitted before torn)."""
        folder = self._dir(step)
        try:
            self._files.remove(self._files.join(folder, MANIFEST_FILE))
            self._files.remove_tree(folder)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", self.directory(step), exc)


class CheckpointWriter:
    """Writes parts of the checkpoint at one step; the committer also commits it.

    Use: every process that holds state makes a writer for the step and writes its
    parts; when all are written (the cut protocol's barrier), one process
    :meth:`collect`\\ s the others' parts and :meth:`commit`\\ s. Until the commit the
    checkpoint does not exist for readers.
    """

    def __init__(self, storage: CheckpointStorage, step: int) -> None:
        self._storage = storage
        self._files = storage._files
        self.step = step
        self._dir = storage._dir(step)
        self._made_dir = False
        self._written: list[str] = []
        """The files this writer made (data files and sidecars), for ``abort``."""

    @property
    def directory(self) -> str:
        """The checkpoint's folder (path or URL)."""
        return self._storage.directory(self.step)

    def __repr__(self) -> str:
        return f"CheckpointWriter({self.directory!r})"

    def _start_part(self, name: str, kind: PartKind) -> str:
        """Readies the folder for part ``name``; returns the new data file's name."""
        validate_part_name(name)
        if not self._made_dir:
            self._files.makedirs(self._dir)
            self._made_dir = True
        # A sidecar left by an earlier write of this step must not be collected while
        # this one is under way.
        self._files.remove(self._files.join(self._dir, name + SIDECAR_SUFFIX))
        file = f"{name}.{secrets.token_hex(6)}{EXTENSIONS[kind]}"
        self._written += [file, name + SIDECAR_SUFFIX]
        return file

    def abort(self) -> None:
        """Removes every file this writer wrote: a save that failed (a full disk) gives
        all its space back, and a retry does not pile its parts beside the old ones.

        Does nothing once the folder holds a manifest: the step may be committed (by
        this writer or an earlier one), and its parts must stay.
        """
        try:
            if MANIFEST_FILE in self._files.list_files(self._dir):
                return
        except OSError:
            return
        for name in self._written:
            with contextlib.suppress(OSError):
                self._files.remove(self._files.join(self._dir, name))
        self._written.clear()

    def _finish_part(self, info: PartInfo, started: float) -> PartInfo:
        sidecar = json.dumps(info.to_dict()).encode()
        # Not fsynced: the manifest copies this info, and only the manifest must last.
        try:
            self._files.write_atomic(
                self._files.join(self._dir, info.name + SIDECAR_SUFFIX), sidecar, durable=False
            )
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._files.remove(self._files.join(self._dir, info.file))
            raise self._write_error(f"the sidecar of part {info.name!r}", exc) from exc
        log.debug(
            "wrote part %s of step %d: %d bytes in %.3fs",
            info.name,
            self.step,
            info.size,
            time.perf_counter() - started,
        )
        return info

    def write_tensors(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
    ) -> PartInfo:
        """Writes a tensor part (safetensors, ``meta`` as JSON in its header) and its sidecar.

        Tensors may live on any device, be non-contiguous or share memory. Do not modify
        them until this returns: the checksum is taken from memory as the bytes are
        written.

        Raises:
            CheckpointError: a bad part name, tensor, dtype or meta (the message names it).
            OSError: the filesystem failed.
        """
        from clusterflow.checkpoint.tensors import encode

        started = time.perf_counter()
        file = self._start_part(name, "tensors")
        buffers = encode(name, tensors, meta)
        digest, size = self._write_data(name, file, buffers)
        return self._finish_part(PartInfo(name, file, digest, size, "tensors"), started)

    def write_json(self, name: str, obj: Any) -> PartInfo:
        """Writes a JSON part (a data cursor, small state) and its sidecar.

        Raises:
            CheckpointError: a bad part name, or ``obj`` is not JSON-serializable.
            OSError: the filesystem failed.
        """
        started = time.perf_counter()
        validate_part_name(name)
        try:
            data = json.dumps(obj, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"part {name!r} is not JSON-serializable: {exc}") from None
        file = self._start_part(name, "json")
        digest, size = self._write_data(name, file, [memoryview(data)])
        return self._finish_part(PartInfo(name, file, digest, size, "json"), started)

    def _write_data(self, name: str, file: str, buffers: list[memoryview]) -> tuple[str, int]:
        """Writes a part's data file; on a filesystem error removes what it wrote.

        A full disk must not stay full of a part that can never be committed: the next
        attempt, or another job on the disk, gets the space back.

        Raises:
            CheckpointWriteError: naming the part and the checkpoint's folder.
        """
        path = self._files.join(self._dir, file)
        try:
            return self._files.write_stream(path, buffers)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._files.remove(path)
            raise self._write_error(f"part {name!r}", exc) from exc

    def _write_error(self, what: str, exc: OSError) -> CheckpointWriteError:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return CheckpointWriteError(
            exc.errno, f"cannot write {what} of checkpoint {self.directory}: {reason}"
        )

    def collect(self, names: Iterable[str]) -> list[PartInfo]:
        """The info of parts that other processes wrote into this checkpoint.

        Call after every writer has finished (this reads their sidecars, it does not wait
        for them).

        Raises:
            CheckpointError: a name is bad, or a part has no valid sidecar (it was not
                written, or not completely); the message lists every missing one.
        """
        infos: list[PartInfo] = []
        missing: list[str] = []
        for name in names:
            validate_part_name(name)
            path = self._files.join(self._dir, name + SIDECAR_SUFFIX)
            try:
                info = PartInfo.from_dict(json.loads(self._files.read(path)))
            except FileNotFoundError:
                missing.append(name)
                continue
            except (ValueError, CheckpointError) as exc:
                raise CheckpointError(f"sidecar of part {name!r} is invalid: {exc}") from None
            if info.name != name:
                raise CheckpointError(f"sidecar of part {name!r} describes {info.name!r}")
            infos.append(info)
        if missing:
            raise CheckpointError(
                f"checkpoint {self.directory} lacks parts {missing}: not written (yet)"
            )
        return infos

    def commit(self, parts: Iterable[PartInfo], meta: Mapping[str, Any] | None = None) -> Manifest:
        """Commits the checkpoint: writes its manifest atomically, then applies retention.

        Call once, after every part is written. The data files must be there with the
        sizes given (one listing checks them). Retention failures are logged, not
        raised: the checkpoint is committed by then.

        Returns:
            the manifest, as :meth:`CheckpointStorage.latest` would return it.

        Raises:
            CheckpointError: two different parts of one name, a part's file is missing
                or of another size, or ``meta`` is not JSON-serializable.
            OSError: the filesystem failed (the checkpoint is then not committed).
        """
        by_name: dict[str, PartInfo] = {}
        for part in parts:
            if not isinstance(part, PartInfo):
                raise CheckpointError(f"commit takes PartInfo values, got {type(part).__name__}")
            if by_name.setdefault(part.name, part) != part:
                raise CheckpointError(f"two different parts are named {part.name!r}")
        try:
            # Round-trip now, so the manifest returned equals the one read back later.
            meta_json = json.loads(json.dumps(dict(meta or {})))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"commit meta is not JSON-serializable: {exc}") from None
        manifest = Manifest(
            step=self.step,
            created=time.time(),
            parts=dict(sorted(by_name.items())),
            meta=meta_json,
            directory=self.directory,
        )
        self._files.makedirs(self._dir)
        problem = self._storage._problem(manifest, verify=False)
        if problem is not None:
            raise CheckpointError(f"cannot commit {self.directory}: {problem}")
        # Parts' folder entries first (their bytes were synced by each writer), then the
        # manifest: a crash leaves either no manifest or one whose parts are all on disk.
        try:
            self._files.sync_dir(self._storage._root)
            self._files.sync_dir(self._dir)
            # All or nothing: a temporary file renamed over the name once it is synced, so
            # a full disk leaves no manifest (write_atomic removes the torn temporary).
            self._files.write_atomic(
                self._files.join(self._dir, MANIFEST_FILE),
                manifest.to_json().encode(),
                durable=True,
            )
        except OSError as exc:
            raise self._write_error("the manifest", exc) from exc
        log.info(
            "committed checkpoint %s (%d parts, %d bytes)",
            self.directory,
            len(by_name),
            sum(p.size for p in by_name.values()),
        )
        try:
            self._storage._prune(manifest)
        except (OSError, CheckpointError) as exc:
            log.warning("retention after committing %s failed: %s", self.directory, exc)
        return manifest
