"""A trial's job for tests/integration/test_tune.py: a known objective, reported per step.

``python tune_job.py MODE X STEPS MARKS`` where MODE is
- ``score``: reports ``score = -(X - 0.3)**2`` at steps 0..STEPS-1 (each step a short
  piece of work, so a pruned trial is stopped before its last step);
- ``crash``: exits 3 once X > 0.5 (after one report), else scores;
- ``hold``: scores, then reports forever until MARKS/release exists (Ctrl-C tests);
- ``silent``: reports another figure only.
MARKS is a folder where the trial keeps ``alive-<pid>`` while it runs and records, in
its report, the most trials it saw alive at once (``alive``): overlap seen by the
trials themselves, not inferred from timings.
"""

import os
import sys
import time
from pathlib import Path

from clusterflow import tune

mode, x, steps, marks = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
assert tune.params()["x"] == x, (tune.params(), x)
marks.mkdir(exist_ok=True)
me = marks / f"alive-{os.getpid()}"
me.touch()
seen = 1
try:
    step = 0
    while True:
        if mode == "crash" and x > 0.5 and step == 1:
            sys.exit(3)
        for _ in range(10):  # a piece of work, looking around meanwhile
            seen = max(seen, len(list(marks.glob("alive-*"))))
            time.sleep(0.02)
        score = -((x - 0.3) ** 2)
        if mode == "silent":
            tune.report(step=step, other=score)
        else:
            tune.report(step=step, score=score, alive=seen)
        step += 1
        if step >= steps and (mode != "hold" or (marks / "release").exists()):
            break
finally:
    me.unlink()
