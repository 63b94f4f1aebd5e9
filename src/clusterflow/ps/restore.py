"""A ps task loads its shard of the checkpoint its cluster restarts from."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from clusterflow.checkpoint import CheckpointError, CheckpointStorage
from clusterflow.checkpoint.names import ENV_CHECKPOINT_DIR, ENV_RESTORE, ps_part
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore

log = logging.getLogger(__name__)


def restore_shard(
    store: VariableStore,
    num_ps: int,
    environ: Mapping[str, str] | None = None,
    tables: RowStore | None = None,
) -> int | None:
    """Loads ``store``'s shard (and ``tables``' rows) from the checkpoint named in the
    environment, if any.

    Returns the checkpoint's step, or None when there is nothing to restore (a first
    start, or a checkpoint of an all-reduce job, which has no ps shards).

    Raises:
        CheckpointError: the named checkpoint is missing or damaged, or it was written
            by a cluster with another number of ps tasks (the shards would not match).
    """
    env = os.environ if environ is None else environ
    step, url = env.get(ENV_RESTORE), env.get(ENV_CHECKPOINT_DIR)
    if not step or not url:
        return None
    storage = CheckpointStorage(url)
    manifest = storage.at(int(step)) if step.isdigit() else None
    if manifest is None:
        raise CheckpointError(f"{ENV_RESTORE}={step}: no committed checkpoint there in {url}")
    saved = int(manifest.meta.get("num_ps", 0))
    if saved == 0:
        return None
    if saved != num_ps:
        raise CheckpointError(
            f"checkpoint at step {manifest.step} holds {saved} ps shard(s); "
            f"this cluster has {num_ps} ps task(s)"
        )
    meta, tensors = storage.read_tensors(manifest, ps_part(store.ps_index))
    store.load_state(meta, tensors)
    if tables is not None:
        tables.load_state(meta, tensors)
    log.info("ps:%d restored version %s from %s", store.ps_index, meta.get("version"), url)
    return manifest.step
