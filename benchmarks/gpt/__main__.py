"""GPT: tokens/s of every strategy over plain DDP under torchrun, on the same model and batch.

The model is ``examples/gpt`` (2 blocks of width 64, context 64 with ``--quick``), the
global batch the same for every side (32 records), two replicas (or two workers and a
ps, or two pipeline stages), one torch thread each. Each round runs every side once,
in an order reversed every round (``common.alternate``); each ratio is taken within a
round. Keys:

* ``mirrored_vs_torchrun_ddp``: MultiWorkerMirroredStrategy through ``fit`` under
  ``clusterflow start`` / the plain DDP script under ``torchrun``;
* ``fsdp_vs_torchrun_fsdp``: the plain FSDP2 script under ``clusterflow start`` / the
  same script under ``torchrun`` (clusterflow has no FSDP strategy of its own: this is
  what running an FSDP job under clusterflow costs);
* ``ps_async_vs_torchrun_ddp``: async ps (2 workers, 1 ps) / DDP, with worker 1 made 20%
  slower on both sides (``--slow-rank 1``), where async pays;
* ``pipeline_vs_torchrun_ddp``: the 2-stage 1F1B pipeline / DDP;
* ``time_to_loss_s_<side>``: seconds from the first step to the first evaluation at or
  below the target (1.01 x plain DDP's final validation loss in the first round).

    python -m benchmarks.gpt [--quick] [--rounds N] [--verbose] [--sides A,B,...]

``--sides`` runs only the named sides (``torchrun_ddp`` always runs: it sets the loss
target); a ratio whose two sides did not both run is left out of the RESULT line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable

from benchmarks.common import MachineLoad, Spread, one_thread_per_process, parser, result
from benchmarks.gpt.runs import Run, clusterflow, launch, torchrun

SIDES = (
    "torchrun_ddp",
    "torchrun_ddp_slow",
    "torchrun_fsdp",
    "mirrored",
    "clusterflow_fsdp",
    "ps_async",
    "pipeline",
)


def _sides(text: str) -> set[str]:
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(SIDES)
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--sides {text!r}: a comma-separated choice of {', '.join(SIDES)}"
        )
    return names | {"torchrun_ddp"}


def model_args(quick: bool) -> list[str]:
    shape = ["--layers", "2", "--width", "64", "--heads", "2", "--context", "64"]
    if not quick:
        shape = ["--layers", "4", "--width", "128", "--heads", "4", "--context", "128"]
    steps = "60" if quick else "200"
    run = ["--batch-size", "32", "--steps", steps, "--eval-every", "20", "--warmup", "10"]
    run += ["--timing-warmup", "10", "--corpus-bytes", "1000000", "--val-windows", "32"]
    return [*shape, *run, "--device", "cpu", "--threads", "1", "--clip", "1.0"]


def main() -> None:
    p = parser("gpt", __doc__)
    p.add_argument("--sides", type=_sides, help=f"a comma-separated subset of {', '.join(SIDES)}")
    args = p.parse_args()
    one_thread_per_process()
    rounds = args.rounds or 3
    home = tempfile.mkdtemp(prefix="cf-gpt-bench-")
    base = model_args(args.quick)
    slow = ["--slow-rank", "1", "--slow-factor", "0.2"]
    load = MachineLoad()

    def side(command: list[str]) -> Callable[[], Run]:
        def go() -> Run:
            run = launch(command, home=home, timeout=600, threads=1)
            if not run.ok or run.tokens_per_s is None:
                raise RuntimeError(
                    f"{' '.join(command[:8])} ...: {run.why()}\n{run.output[-2000:]}"
                )
            return run

        return go

    sides: dict[str, Callable[[], Run]] = {
        "torchrun_ddp": side(torchrun(2, ["--strategy", "ddp", *base])),
        "torchrun_ddp_slow": side(torchrun(2, ["--strategy", "ddp", *base, *slow])),
        "torchrun_fsdp": side(torchrun(2, ["--strategy", "fsdp", *base])),
        "mirrored": side(clusterflow(["--strategy", "mirrored", *base], workers=2)),
        "clusterflow_fsdp": side(clusterflow(["--strategy", "fsdp", *base], workers=2)),
        "ps_async": side(clusterflow(["--strategy", "ps-async", *base, *slow], workers=2, ps=1)),
        "pipeline": side(clusterflow(["--strategy", "pipeline", *base], workers=2)),
    }
    if args.sides:
        sides = {name: go for name, go in sides.items() if name in args.sides}
    runs: dict[str, list[Run]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(rounds):
        for name in order:
            runs[name].append(sides[name]())
        order.reverse()
        if args.verbose:
            rates = " ".join(f"{n}={r[-1].tokens_per_s:.0f}" for n, r in runs.items())
            print(f"round {i} tokens/s: {rates}", flush=True)

    def ratio(ours: str, peer: str) -> Spread:
        return Spread.of(
            a.tokens_per_s / b.tokens_per_s  # type: ignore[operator]
            for a, b in zip(runs[ours], runs[peer], strict=True)
        )

    pairs = {
        "mirrored_vs_torchrun_ddp": ("mirrored", "torchrun_ddp"),
        "fsdp_vs_torchrun_fsdp": ("clusterflow_fsdp", "torchrun_fsdp"),
        "ps_async_vs_torchrun_ddp": ("ps_async", "torchrun_ddp_slow"),
        "pipeline_vs_torchrun_ddp": ("pipeline", "torchrun_ddp"),
    }
    figures: dict[str, float | Spread] = {
        key: ratio(ours, peer) for key, (ours, peer) in pairs.items() if {ours, peer} <= set(runs)
    }
    reference = runs["torchrun_ddp"][0].val_loss
    target = 1.01 * reference if reference is not None else float("nan")
    print(f"time-to-loss target: validation loss {target:.4f}")
    for name, done in runs.items():
        rates = [r.tokens_per_s for r in done if r.tokens_per_s]
        print(f"{name}: tokens/s {Spread.of(rates)}; final val_loss {done[-1].val_loss}")
        times = [t for t in (r.time_to_loss(target) for r in done) if t is not None]
        if times:
            figures[f"time_to_loss_s_{name}"] = statistics.median(times)
        else:
            print(f"{name}: never reached the target in {len(done)} runs")
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(load.describe(), flush=True)
    result("gpt", **figures)


if __name__ == "__main__":
    main()
