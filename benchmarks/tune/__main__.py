"""Tuning: what running trials as clusters costs, what parallel trials gain, what TPE gains.

- ``parallel_speedup``: wall time of a study of 8 one-core trials (each spins a core for
  half a second or so, benchmarks/tune/job.py) at ``--parallel 1`` over the same study at
  ``--parallel 2``. Goal >= 1.7 on 2 cores.
- ``overhead_s``: per trial, the ``--parallel 1`` study's wall time less the same 8
  commands run one after another as plain subprocesses, over 8: starting and stopping a
  cluster, the registry, Optuna's SQLite writes. Goal <= 1.0.
- ``tpe_vs_random``: trials until a study first reaches a target value on a known 2-D
  objective, TPE over random (the samplers ``clusterflow tune`` builds), mean over seeds
  (in-process Optuna, no clusters: it measures the sampler, not the platform). Goal <= 0.7.

The three timed sides (p1, p2, bare) run in alternating rounds; each round's ratios,
and their median with the smallest and largest (benchmarks/common.py).

    python -m benchmarks.tune [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import MachineLoad, Spread, alternate, parser, result

TRIALS = 8
WORK = "8"  # million loop iterations: half a second or so of one core
TARGET = -0.002
MAX_TRIALS = 150
_names = itertools.count()


def _study(parallel: int) -> float:
    from clusterflow import tune

    start = time.perf_counter()
    code = tune.run(
        f"bench-{next(_names)}",
        params={"x": "uniform:0:1"},
        command=[sys.executable, "-m", "benchmarks.tune.job", "{x}", WORK],
        metric="score",
        trials=TRIALS,
        parallel=parallel,
        sampler="random",
        pruner="none",
        seed=1,
        echo=lambda line: None,
    )
    if code != 0:
        raise SystemExit(f"a study at --parallel {parallel} exited with {code}")
    return time.perf_counter() - start


def _bare() -> float:
    start = time.perf_counter()
    for i in range(TRIALS):
        x = str(i / TRIALS)
        subprocess.run([sys.executable, "-m", "benchmarks.tune.job", x, WORK], check=True)
    return time.perf_counter() - start


def trials_to_target(sampler: str, seed: int) -> int:
    """Trials until ``-((x-0.3)^2 + (y-0.7)^2)`` first reaches TARGET (at most MAX_TRIALS)."""
    import optuna

    from clusterflow.tune.space import parse_params
    from clusterflow.tune.study import TuneSettings, _sampler

    settings = TuneSettings(
        study="s",
        metric="score",
        params=parse_params(["x=uniform:0:1", "y=uniform:0:1"]),
        command=("true",),
        trials=MAX_TRIALS,
        sampler=sampler,
        seed=seed,
    )
    study = optuna.create_study(direction="maximize", sampler=_sampler(optuna, settings))
    for n in range(1, MAX_TRIALS + 1):
        trial = study.ask()
        x, y = trial.suggest_float("x", 0, 1), trial.suggest_float("y", 0, 1)
        value = -((x - 0.3) ** 2 + (y - 0.7) ** 2)
        study.tell(trial, value)
        if value >= TARGET:
            return n
    return MAX_TRIALS


def main() -> None:
    args = parser("tune", __doc__).parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    seeds = 8 if args.quick else 20
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as home:
        os.environ["CLUSTERFLOW_HOME"] = home
        load = MachineLoad()
        figures = alternate(
            {"p1": lambda: _study(1), "p2": lambda: _study(2), "bare": _bare},
            rounds,
            verbose=args.verbose,
            warmup=not args.quick,
        )
        print(load.describe())
    speedup = Spread.of(a / b for a, b in zip(figures["p1"], figures["p2"], strict=True))
    overhead = Spread.of(
        (p1 - bare) / TRIALS for p1, bare in zip(figures["p1"], figures["bare"], strict=True)
    )
    tpe = statistics.mean(trials_to_target("tpe", s) for s in range(seeds))
    rnd = statistics.mean(trials_to_target("random", s) for s in range(seeds))
    print(f"parallel_speedup {speedup}; overhead_s {overhead}")
    print(f"trials to reach {TARGET}: tpe {tpe:.1f}, random {rnd:.1f} (mean over {seeds} seeds)")
    result("tune", parallel_speedup=speedup, overhead_s=overhead, tpe_vs_random=tpe / rnd)


if __name__ == "__main__":
    main()
