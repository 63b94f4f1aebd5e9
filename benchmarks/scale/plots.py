"""The PNG plots of ``benchmarks.scale --plots DIR`` (matplotlib: the ``bench`` extra).

Two figures from the measured curves: per-worker steps/s against workers for every
side, and the same as efficiency (over one worker of the same side).

    python -m benchmarks.scale.plots OUT_DIR A.json [B.json ...]

plots the curves that runs saved with ``--save`` together (a size in several files:
the last file's), for runs of different sizes that no single quiet slot holds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a benchmark machine
import matplotlib.pyplot as plt

LABELS = {
    "async1": "async ps, 1 shard",
    "async2": "async ps, 2 shards",
    "async4": "async ps, 4 shards",
    "async8": "async ps, 8 shards",
    "async16": "async ps, 16 shards",
    "sync": "sync ps, 4 shards",
    "ring": "MultiWorkerMirroredStrategy (gloo ring)",
    "ddp": "hand-written DDP",
}


def plot(figures: Any, sizes: list[int], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, title, scale in (
        ("scale_steps.png", "per-worker steps/s", False),
        ("scale_efficiency.png", "per-worker efficiency (over 1 worker)", True),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        async_base = max(  # async16 runs only from 32 workers: no 1-worker figure
            c[1].median
            for side, c in figures.per_worker.items()
            if side.startswith("async") and 1 in c
        )
        for side, label in LABELS.items():
            curve = figures.per_worker.get(side)
            if not curve:
                continue
            xs = [n for n in sizes if n in curve]
            one = async_base if side.startswith("async") else curve[1].median
            base = one if scale else 1.0
            ys = [curve[n].median / base for n in xs]
            lo = [curve[n].low / base for n in xs]
            hi = [curve[n].high / base for n in xs]
            ax.plot(xs, ys, marker="o", label=label)
            ax.fill_between(xs, lo, hi, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("workers, each on its own emulated host (10 Gbit/s links)")
        ax.set_ylabel(title)
        if scale:
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(0, 1.15)
        ax.set_title(f"{title}\ncompute emulated (0.3 s a step), communication real", fontsize=10)
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    from benchmarks.scale.hosts import load

    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m benchmarks.scale.plots OUT_DIR A.json [B.json ...]")
    figures = load([Path(a) for a in sys.argv[2:]])
    sizes = sorted({n for curve in figures.per_worker.values() for n in curve})
    for path in plot(figures, sizes, Path(sys.argv[1])):
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
