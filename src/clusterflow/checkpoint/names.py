"""Names every task agrees on: the parts of a checkpoint and the variables that find it.

The cut is written by several processes (the chief, every ps shard, every worker) and
read by others (a restarted ps reads its shard, the manager reads the data cursor), so
the part names are a contract; they live here, with nothing else, for all to import.
"""

from __future__ import annotations

from clusterflow.cluster.contract import ENV_CHECKPOINT_DIR, ENV_RESTORE

__all__ = ["DATA_PART", "ENV_CHECKPOINT_DIR", "ENV_RESTORE", "MODEL_PART", "ps_part", "worker_part"]

DATA_PART = "data"
"""The data service's cursor (JSON): which splits of each epoch are acked."""
MODEL_PART = "model"
"""All-reduce strategies and single processes: the (replicated) model and optimizer."""


def ps_part(index: int) -> str:
    """Parameter-server shard ``index``: its variables, optimizer slots, version, leases."""
    return f"ps-{index}"


def worker_part(rank: int) -> str:
    """A training task's own state: RNG states, local step, what its strategy holds."""
    return f"worker-{rank}"
