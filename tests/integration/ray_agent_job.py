"""The job of ``test_ray_agents.py``: says which process hosts its supervisor, then runs
``examples/digits_ddp.py`` (same seeds and data on every backend: the same results).

The supervisor is this process's parent; its parent is what hosts it on the node: a
node's agent, or a Ray worker started for the task's own actor; or, when the supervisor
was forked warm, the agent's fork server, whose parent is the agent (``warm=1``: this
job then found torch imported before it imported anything).
"""

from __future__ import annotations

import sys

torch_warm = "torch" in sys.modules

import os  # noqa: E402 (after the look at sys.modules)
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits_ddp.py"

supervisor = psutil.Process().parent()
host = supervisor.parent() if supervisor is not None else None
forked = host is not None and "clusterflow.backends.forkserver" in host.cmdline()
host = host.parent() if forked and host is not None else host
print(
    f"hosted_by={host.pid if host else 0} rank={os.environ.get('RANK')} "
    f"warm={int(forked and torch_warm)}",
    flush=True,
)
os.execv(sys.executable, [sys.executable, str(DIGITS), *sys.argv[1:]])
