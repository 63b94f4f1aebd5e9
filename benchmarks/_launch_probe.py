"""The job that ``benchmarks.launch`` starts: imports torch, prints one line, exits 0.

It imports torch first, as a real training script would, so both launchers pay the same
start-up of the job itself and the benchmark sees only what each launcher adds.
"""

from __future__ import annotations

import os

import torch

print(f"ready rank={os.environ.get('RANK', '?')} torch={torch.__version__}", flush=True)
