"""A one-core trial for benchmarks/tune/: fixed CPU work, then its score reported.

``python -m benchmarks.tune.job X WORK`` spins WORK million loop iterations (no
sleep: the trial must hold a core, so two at once need two cores), then reports
``score = -(X - 0.3)**2``. Run alone (no trial environment) it just does the work.
"""

import sys

from clusterflow import tune

x, work = float(sys.argv[1]), float(sys.argv[2])
total = 0
for i in range(int(work * 1_000_000)):
    total += i & 7
tune.report(step=0, score=-((x - 0.3) ** 2))
