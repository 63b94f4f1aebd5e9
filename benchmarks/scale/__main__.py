"""Scale: per-worker throughput on emulated 10 Gbit/s hosts, and a 1,000-task control plane.

Four parts, one RESULT line (docs/scaling.md explains the model and the figures):

* **Data plane** (``hosts.py``, needs root): 1, 2, 4, 8 workers (also 16 and 32
  without ``--quick``), each on its own emulated host (``clusterflow.testing``), for
  async ps with 1/2/4/8 shards (and 16 from 32 workers on), sync ps,
  ``MultiWorkerMirroredStrategy`` (gloo ring) and hand-written DDP. Compute is EMULATED
  (a step sleeps its GPU time); communication is real. Links are 10 Gbit/s with bytes
  and rate scaled down together by ``hosts.SCALE`` (so two cores can move them):
  transfer times are full-size ones. Then TensorFlow's ParameterServerStrategy on the
  same hosts, links and model (``tf_peer.py``), where a Python with TensorFlow is
  named (``--tf-python`` or ``CLUSTERFLOW_TF_PYTHON``) or this one has it; the
  benchmark installs nothing.
* **Control plane** (``control.py``): one manager, 1,000 simulated registrants.
* **The ps on loopback**: the 64 MiB push+pull against raw TCP (``benchmarks.ps``).
* **All-reduce algorithms** (``allreduce.py``, needs root): the largest size's
  replicas on hosts of 2 (4 without ``--quick``) that share one 10 Gbit/s link each, as
  ``--replicas-per-host`` lays them out: gloo's flat ring against
  ``CommunicationOptions(algorithm="hierarchical")``.

Keys: ``efficiency_async_ps`` (per-worker steps/s at the largest size over 1 worker, best
shard count), ``efficiency_allreduce`` (the ring's), ``bf16_vs_fp32_10g`` (ring, a model
of 4x the bytes per compute), ``async_vs_ddp_10g`` (cluster steps/s, one worker 20%
slower), ``async_vs_tf_pss_10g`` (per-worker steps/s, 8 shards against TensorFlow's 8 ps,
where TensorFlow is found), ``manager_heartbeats_per_s``, ``heartbeat_p99_ms``,
``dispatcher_leases_per_s``, ``register_1000_s``, ``ps_bandwidth_ratio``,
``hier_vs_flat_10g`` (per-replica steps/s, hierarchical over the flat ring).

    python -m benchmarks.scale [--quick] [--rounds N] [--verbose] [--plots DIR] [--sizes 1,8,16]
                               [--parts data,control,ps,allreduce] [--tf-python PATH]
                               [--sides async16,ring]

``--parts`` measures only some of the four (all by default): the keys of the others
are left out of the RESULT line.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from benchmarks.common import MachineLoad, Spread, one_thread_per_process, parser, ratio, result
from benchmarks.scale import allreduce, control, hosts, tf_peer

EFFICIENT = 0.9
"""Per-worker efficiency a shard count must reach to count as enough shards."""


def _some_sides(figures: hosts.Figures, sizes: list[int]) -> dict:
    """With ``--sides``: each side's per-worker efficiency at the largest size; the keys
    that compare sides (or need the straggler and bf16 sides) are left out."""
    largest, out = max(sizes), {}
    for side, by_size in figures.per_worker.items():
        eff = by_size[largest].median / by_size[1].median
        print(f"{side} efficiency at {largest} workers: {eff:.2f}")
    asyncs = [s for s in figures.per_worker if s.startswith("async")]
    if asyncs:
        out["efficiency_async_ps"] = max(
            figures.per_worker[s][largest].median / figures.per_worker[s][1].median for s in asyncs
        )
    if "ring" in figures.per_worker:
        ring = figures.per_worker["ring"]
        out["efficiency_allreduce"] = ring[largest].median / ring[1].median
    return out


def _data_plane(
    sizes: list[int],
    steps: int,
    rounds: int,
    verbose: bool,
    tf_python: str | None,
    only: frozenset[str] | None = None,
) -> tuple[dict, object]:
    from clusterflow.testing import available

    if not available():
        print("data plane skipped: emulated hosts need root and iproute2")
        return {}, None
    figures = hosts.run(sizes, steps, rounds, verbose, only)
    if only is not None:
        return _some_sides(figures, sizes), None
    largest, out = max(sizes), {}
    shards_needed = {}
    best = {}
    # One worker's steps/s does not depend on the shard count (its own link carries the
    # same bytes): the best of them is the base, so a noisy low base never lifts a ratio.
    base = max(figures.per_worker[f"async{s}"][1].median for s in hosts.SHARDS)
    for n in sizes:
        counts = hosts.shard_counts(n)
        effs = {s: figures.per_worker[f"async{s}"][n].median / base for s in counts}
        best[n] = max(effs.values())
        enough = [s for s, e in effs.items() if e >= EFFICIENT]
        shards_needed[n] = min(enough) if enough else None
        mib = 0.5 * hosts.SCALE
        print(
            f"async ps at {n} workers: efficiency by shards "
            + ", ".join(f"{s}: {e:.2f}" for s, e in effs.items())
            + f"; shards needed for {EFFICIENT}: {shards_needed[n] or f'more than {max(counts)}'}"
            + f" (each shard carries {n} x {mib:.0f}/S MiB each way per step at full size)"
        )
    out["efficiency_async_ps"] = best[largest]
    ring = figures.per_worker["ring"]
    out["efficiency_allreduce"] = ring[largest].median / ring[1].median
    ddp = figures.per_worker["ddp"]
    print(f"DDP efficiency at {largest}: {ddp[largest].median / ddp[1].median:.2f}")
    sync = figures.per_worker["sync"]
    print(f"sync ps efficiency at {largest}: {sync[largest].median / sync[1].median:.2f}")
    c = figures.cluster
    for n in sorted(c.get("ddp_slow", {})):
        bf16 = ratio(c["ring_heavy_bf16"][n], c["ring_heavy"][n])
        straggler = ratio(c["async_slow"][n], c["ddp_slow"][n])
        print(f"at {n} workers: bf16_vs_fp32_10g {bf16}, async_vs_ddp_10g {straggler}")
    out["bf16_vs_fp32_10g"] = ratio(c["ring_heavy_bf16"][largest], c["ring_heavy"][largest])
    out["async_vs_ddp_10g"] = ratio(c["async_slow"][largest], c["ddp_slow"][largest])
    # None measured enough: twice the most measured, the rule's next step.
    most = max(hosts.shard_counts(largest))
    out["shards_needed_largest"] = float(shards_needed[largest] or 2 * most)
    try:
        python = tf_peer.find_python(tf_python)
    except tf_peer.TensorFlowMissing as exc:
        print(f"TensorFlow ParameterServerStrategy: skipped ({exc})")
        return out, figures
    tf_rates = tf_peer.measure(sizes, steps, rounds, python, verbose)
    shards = max(hosts.SHARDS)
    ours = figures.per_worker[f"async{shards}"]
    for n in sizes:
        vs = ours[n].median / tf_rates[n].median
        print(
            f"at {n} workers: async ps ({shards} shards) / TensorFlow PSS "
            f"({tf_peer.PS_TASKS} ps), per-worker steps/s: {vs:.2f}"
        )
    out["async_vs_tf_pss_10g"] = ours[largest].median / tf_rates[largest].median
    return out, figures


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] != 1 or sizes[-1] > 64:
        raise argparse.ArgumentTypeError(
            f"--sizes {text!r}: comma-separated worker counts from 1 (the base) up to 64"
        )
    return sizes


PARTS = ("data", "control", "ps", "allreduce")
SIDES = ("async1", "async2", "async4", "async8", "async16", "sync", "ring", "ddp")


def _side_names(text: str) -> frozenset[str]:
    sides = frozenset(s.strip() for s in text.split(",") if s.strip())
    if not sides or sides - set(SIDES):
        raise argparse.ArgumentTypeError(
            f"--sides {text!r}: a comma-separated choice of {', '.join(SIDES)}"
        )
    return sides


def _parts(text: str) -> set[str]:
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        raise argparse.ArgumentTypeError(
            f"--parts {text!r}: a comma-separated choice of {', '.join(PARTS)}"
        )
    return parts


def main() -> None:
    p = parser("scale", __doc__)
    p.add_argument("--plots", type=Path, help="write the PNG plots here (needs matplotlib)")
    p.add_argument(
        "--save",
        type=Path,
        help="write the data plane's curves to this JSON file (python -m "
        "benchmarks.scale.plots OUT_DIR A.json B.json plots runs together)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        help="worker counts to measure, 1 first (default 1,2,4,8; 16,32 without --quick)",
    )
    p.add_argument(
        "--tf-python",
        help="a Python that has TensorFlow, for its ParameterServerStrategy rows "
        f"(default ${tf_peer.ENV_PYTHON}, else this Python if it has TensorFlow)",
    )
    p.add_argument(
        "--parts",
        type=_parts,
        default=set(PARTS),
        help="which parts to measure: data, control, ps, allreduce (default all)",
    )
    p.add_argument(
        "--sides",
        type=_side_names,
        help="the data plane's sides to measure, e.g. async16 (default all, with the "
        "straggler and bf16 sides; async16 runs from 32 workers on); keys that compare "
        "sides are then left out",
    )
    args = p.parse_args()
    one_thread_per_process()
    load = MachineLoad()
    rounds = args.rounds or 3
    sizes = args.sizes or ([1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32])
    figures: dict[str, float | Spread] = {}
    if "control" in args.parts:
        plane = control.run()
        for key, value in plane.items():
            print(f"control plane, 1,000 simulated tasks: {key} = {value:,.1f}")
    curves = None
    if "data" in args.parts:
        data, curves = _data_plane(
            sizes,
            steps=4 if args.quick else 6,
            rounds=rounds,
            verbose=args.verbose,
            tf_python=args.tf_python,
            only=args.sides,
        )
        figures.update(data)
    if "control" in args.parts:
        figures.update({k: plane[k] for k in ("manager_heartbeats_per_s", "heartbeat_p99_ms")})
        figures["dispatcher_leases_per_s"] = plane["dispatcher_leases_per_s"]
        figures["register_1000_s"] = plane["register_1000_s"]
    if "ps" in args.parts:
        from benchmarks.ps import bandwidth

        figures["ps_bandwidth_ratio"] = bandwidth(rounds + 4, args.verbose)
    if "allreduce" in args.parts:
        n = max(sizes)
        fits = [k for k in ((2,) if args.quick else (4, 2)) if n % k == 0 and n // k >= 2]
        if fits:
            shared = allreduce.run(n, fits[0], 4 if args.quick else 6, rounds, verbose=args.verbose)
            figures["hier_vs_flat_10g"] = shared["hier_vs_flat_10g"]
        else:
            print(f"all-reduce algorithms: skipped ({n} replicas make no two hosts of 2 or 4)")
    if args.save is not None and curves is not None:
        hosts.save(curves, args.save)
    if args.plots is not None and curves is not None:
        if importlib.util.find_spec("matplotlib") is None:
            print("plots skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            from benchmarks.scale.plots import plot

            for path in plot(curves, sizes, args.plots):
                print(f"plot: {path}")
    print(load.describe(), flush=True)
    result("scale", **figures)


if __name__ == "__main__":
    main()
