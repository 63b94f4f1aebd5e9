"""A trial's job for tests/integration/test_tune.py: a known objective, reported per step.

``python tune_job.py MODE X STEPS MARKS`` where MODE is
- ``score``: reports ``score = -(X - 0.3)**2`` at steps 0..STEPS-1 (each step a short
  piece of work, so a pruned trial is stopped before its last step);
- ``meet``: scores, and goes on past STEPS until it has seen another trial alive (at
  most MEET_S): trials that run at once then overlap however slowly each starts, and
  trials run one after another never do;
- ``crash``: exits 3 once X > 0.5 (after one report), else scores;
- ``hold``: scores, then reports forever until MARKS/release exists (Ctrl-C tests);
- ``silent``: reports another figure only.
MARKS is a folder where the trial keeps ``alive-<pid>-<gpus>`` while it runs and
records, in its report, the most trials it saw alive at once (``alive``): overlap seen
by the trials themselves, not inferred from timings. ``<gpus>`` is its
``CUDA_VISIBLE_DEVICES``; it reports ``gpu`` (the first, -1 for none) and ``shared``, 1 if
it ever saw a trial alive with a GPU of its own.
"""

import os
import sys
import time
from pathlib import Path

from clusterflow import tune

MEET_S = 20.0

mode, x, steps, marks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
assert tune.params()["x"] == x, (tune.params(), x)
marks.mkdir(exist_ok=True)
gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
me = marks / f"alive-{os.getpid()}-{gpus}"
me.touch()
seen, shared = 1, 0
started = time.monotonic()
try:
    step = 0
    while True:
        if mode == "crash" and x > 0.5 and step == 1:
            sys.exit(3)
        for _ in range(10):  # a piece of work, looking around meanwhile
            alive = [m.name.split("-", 2)[2] for m in marks.glob("alive-*") if m != me]
            seen = max(seen, len(alive) + 1)
            mine = set(filter(None, gpus.split(",")))
            shared |= any(mine & set(other.split(",")) for other in alive)
            time.sleep(0.02)
        score = -((x - 0.3) ** 2)
        if mode == "silent":
            tune.report(step=step, other=score)
        else:
            gpu = float(gpus.split(",")[0]) if gpus else -1.0
            tune.report(step=step, score=score, alive=seen, gpu=gpu, shared=shared)
        step += 1
        if mode == "hold" and not (marks / "release").exists():
            continue
        if mode == "meet" and seen < 2 and time.monotonic() - started < MEET_S:
            continue
        if step >= steps:
            break
finally:
    me.unlink()
