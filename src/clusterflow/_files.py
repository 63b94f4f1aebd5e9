"""The one atomic JSON write of the package (no layer of its own, like ``_lazy``).

The manager's registry, the tune studies and the caches each keep small JSON files that
other processes read while they are rewritten (``state.json``, ``config.json``, a cache's
``cache.json`` and ``map.json``, a cache daemon's node records). One function writes
them all, so every such file gets the same guarantee.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash.

    The temporary file sits in ``path``'s folder (``os.replace`` is atomic only within one
    filesystem) and is unique to this call, so writers in several threads or processes
    (the manager, ``clusterflow stop``) never write into each other's. It is fsynced
    before the rename, so a machine that loses power after the rename finds the new
    bytes, not an empty file under the new name. On any failure the temporary file is
    removed and the old file is left as it was.
    """
    text = json.dumps(data, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
