"""The job of ``test_ray_agents.py``: says which process hosts its supervisor, then runs
``examples/digits_ddp.py`` (same seeds and data on every backend: the same results).

The supervisor is this process's parent; its parent is what hosts it on the node: a
node's agent, or a Ray worker started for the task's own actor.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits_ddp.py"

supervisor = psutil.Process().parent()
host = supervisor.parent() if supervisor is not None else None
print(f"hosted_by={host.pid if host else 0} rank={os.environ.get('RANK')}", flush=True)
os.execv(sys.executable, [sys.executable, str(DIGITS), *sys.argv[1:]])
