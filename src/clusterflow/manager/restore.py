"""Which checkpoint a relaunched task restores, and the data cursor that goes with it.

Every task of an attempt restores the same checkpoint: the newest intact committed one.
A whole restart also resets the data service's cursor to that checkpoint's, so the
data position and the parameters come from one cut (docs/architecture.md section 6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from clusterflow.checkpoint import CheckpointStorage, Manifest
from clusterflow.checkpoint.names import DATA_PART
from clusterflow.errors import ClusterflowError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestorePoint:
    step: str | None
    """The checkpoint's step as tasks are told it (``CLUSTERFLOW_RESTORE``); None: none."""
    cursor: dict[str, Any] | None
    """The data service's cursor in it, when asked for and present."""
    problem: str | None = None
    """Why the checkpoints could not be read (the run then starts over), in one line."""


class RestorePoints:
    """Finds the newest intact checkpoint under one storage URL.

    Verifying a checkpoint reads every byte. A whole (re)start verifies again every
    time: the bytes may have changed since the last look (a damaged disk, a copy cut
    short, a flipped byte keeps the size), and every task would restore them. A respawn
    of one task trusts the checkpoint verified before, so respawns stay cheap: the
    others train on already, and the respawned task checks each part's sha256 as it
    reads it.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._verified_step: int | None = None

    def newest(self, *, with_cursor: bool) -> RestorePoint:
        """The newest intact checkpoint; never raises.

        ``with_cursor`` marks a whole (re)start: every task and the data cursor restore
        from it, so every byte is verified again (see the class).

        Restarting without a checkpoint beats not restarting: an unreadable storage
        gives no checkpoint (the run starts over, which is also what the tasks would
        find) and says why.
        """
        try:
            storage = CheckpointStorage(self.url)
            manifest = storage.latest(verify=False)
            if manifest is not None and (with_cursor or manifest.step != self._verified_step):
                manifest = storage.latest(verify=True)
                self._verified_step = None if manifest is None else manifest.step
            cursor = None
            if with_cursor and manifest is not None and DATA_PART in manifest.parts:
                cursor = storage.read_json(manifest, DATA_PART)
        except (ClusterflowError, OSError) as exc:
            log.warning("cannot read checkpoints at %s: %s", self.url, exc)
            return RestorePoint(None, None, f"cannot read checkpoints: {exc}")
        if manifest is None:
            return RestorePoint(None, None)
        log.info("tasks restore checkpoint %s (step %d)", manifest.directory, manifest.step)
        return RestorePoint(str(manifest.step), cursor)


def newest_committed(url: str) -> Manifest | None:
    """The newest committed checkpoint under ``url`` (a valid manifest), or None.

    What ``start --resume`` needs before it starts anything, and the one rule by which
    ``describe``, ``tune describe`` and the dashboard name a checkpoint folder: a
    folder with no manifest holds nothing a run could restore. Manifests only (a
    listing and one small read each); the parts are checked by the restore.

    Raises:
        CheckpointError, OSError: the storage cannot be read.
    """
    committed = CheckpointStorage(url).committed()
    return committed[-1] if committed else None


def committed_or_none(url: str | None) -> Manifest | None:
    """``newest_committed``, with an unreadable storage (or none) as no checkpoint."""
    if not url:
        return None
    try:
        return newest_committed(url)
    except (ClusterflowError, OSError, ValueError) as exc:
        log.debug("cannot read checkpoints at %s: %s", url, exc)
        return None
