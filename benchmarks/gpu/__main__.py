"""GPU: the GPT on CUDA under torchrun and clusterflow, and the ps's bandwidth from GPU memory.

One prepared script for a machine with a GPU (docs/gpu.md). Each part has its own time
limit, so one slow part cannot eat the others' time, and the whole run fits in about six
minutes (``--budget-s``). They run in the order bandwidth, gpt, ps, shared, scale:

* **gpt**: ``examples/gpt/train.py`` (4 blocks of 256, context 256, global batch 64,
  bf16 autocast) as plain DDP under ``torchrun`` (NCCL) against MultiWorkerMirrored
  through ``fit`` under ``clusterflow start``, one process on the one GPU each (world
  size 1), in alternating rounds: ``mirrored_vs_torchrun_ddp`` (tokens/s).
* **ps**: async ps with CUDA workers (``clusterflow start --ps 1``): one worker, then two
  workers sharing the GPU: ``ps_async_vs_torchrun_ddp`` and ``ps_async2_vs_torchrun_ddp``.
* **shared**: plain DDP with 2 processes on the one GPU under torchrun: whether NCCL
  accepts two ranks on one device (``shared_gpu_nccl=ok|refused|timed_out``).
* **bandwidth**: a ps worker whose one 64 MiB variable is on the GPU, sync steps of no
  compute (``ps_probe.py``): ``ps_gpu_push_pull_GBps`` (2 x 64 MiB per step) against
  the raw copy of the tensor to host memory and back (``copy_pinned_GBps``,
  ``copy_pageable_GBps``); ``ps_vs_pinned_copy`` is their ratio; ``staged_vs_unstaged``
  is the speed-up of the pinned staging over the ``.cpu()`` path it replaced.
* **scale** (``--scale``, needs root for the emulated hosts): ``benchmarks.scale --quick``
  at 1, 16 and 32 workers, data plane only, on a machine with the cores for it.

Run from the repository root (the GPU machine has no ``clusterflow`` entry point: the
script launches ``python -m clusterflow.cli.main``)::

    PYTHONPATH=src python -m benchmarks.gpu [--scale] [--budget-s 360]
    PYTHONPATH=src python -m benchmarks.gpu --cpu-smoke   # on CPU, tiny: the script runs

Ends with one line ``RESULT gpu card=... key=value ...``; a part that failed or was
skipped says so as ``<part>=failed`` / ``skipped`` and prints its output's tail above.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.gpt.runs import REPO, Run, clusterflow, launch, torchrun

PROBE = str(REPO / "benchmarks" / "gpu" / "ps_probe.py")


def gpt_args(smoke: bool, device: str) -> list[str]:
    """The model and run every strategy trains here; tiny for ``--cpu-smoke``."""
    if smoke:
        shape = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16"]
        run = ["--batch-size", "4", "--steps", "8", "--eval-every", "8", "--warmup", "2"]
        run += ["--timing-warmup", "2", "--corpus-bytes", "100000", "--val-windows", "8"]
        run += ["--threads", "1"]
    else:
        shape = ["--layers", "4", "--width", "256", "--heads", "4", "--context", "256"]
        # 300 steps of ~10 ms: long enough that the first 50 (compilation of kernels,
        # allocator warm-up) are left out of tokens/s and still leave a steady window.
        run = ["--batch-size", "64", "--steps", "300", "--eval-every", "300", "--warmup", "30"]
        run += ["--timing-warmup", "50", "--corpus-bytes", "4000000", "--val-windows", "64"]
    return [*shape, *run, "--device", device]


class Parts:
    """Runs the parts in order within one overall budget; collects the RESULT figures."""

    def __init__(self, budget_s: float, home: str) -> None:
        self.deadline = time.monotonic() + budget_s
        self.home = home
        self.figures: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def launch(self, command: list[str], limit: float, threads: int | None = None) -> Run:
        """One launch, cut at ``limit`` seconds or the overall deadline, whichever is first."""
        run = launch(command, home=self.home, timeout=min(limit, self.left()), threads=threads)
        if not run.ok:
            print(f"--- {' '.join(command[:6])} ... failed: {run.why()}", flush=True)
            print("\n".join(run.output.splitlines()[-25:]), flush=True)
        return run

    def part(self, name: str, least_s: float, fn: Callable[[], None]) -> None:
        if self.left() < least_s:
            print(f"part {name}: skipped ({self.left():.0f}s left, needs {least_s:.0f}s)")
            self.figures[name] = "skipped"
            return
        start = time.monotonic()
        try:
            fn()
        except Exception as exc:  # one part's failure must not lose the others' figures
            print(f"part {name}: failed: {type(exc).__name__}: {exc}", flush=True)
            self.figures[name] = "failed"
        print(f"part {name}: {time.monotonic() - start:.0f}s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cpu-smoke", action="store_true", help="tiny, on CPU: checks it runs")
    p.add_argument("--scale", action="store_true", help="also benchmarks.scale at 16, 32")
    p.add_argument("--budget-s", type=float, default=360.0, help="the whole run's seconds")
    p.add_argument("--rounds", type=int, default=2, help="alternating gpt rounds")
    args = p.parse_args()
    if args.budget_s <= 0 or args.rounds < 1:
        p.error(f"--budget-s and --rounds must be positive, got {args.budget_s}, {args.rounds}")

    import torch

    smoke = args.cpu_smoke
    cuda = torch.cuda.is_available()
    if not smoke and not cuda:
        p.error("torch sees no CUDA device here; use --cpu-smoke to check the script on CPU")
    device = "cpu" if smoke else "cuda"
    card = torch.cuda.get_device_name(0) if cuda and not smoke else "cpu"
    print(f"card: {card}; torch {torch.__version__}; python {sys.version.split()[0]}")
    missing = _missing_modules()
    if missing:
        # torchrun's DDP needs none of them; clusterflow's parts fail without them.
        print(f"missing modules (clusterflow's parts will fail): {', '.join(missing)}")
    home = tempfile.mkdtemp(prefix="cf-gpu-")
    parts = Parts(args.budget_s, home)
    figures = parts.figures
    figures["card"] = re.sub(r"[^A-Za-z0-9_.-]+", "_", card)
    figures["torch"] = torch.__version__
    if missing:
        figures["missing"] = ",".join(missing)
    train = gpt_args(smoke, device)
    # Per launch: a GPU run is ~15 s of start (imports, CUDA, corpus) and ~5 s of steps.
    limit = 120.0 if smoke else 90.0
    threads = 1 if smoke else None
    rounds = 1 if smoke else args.rounds
    ddp_rates: list[float] = []

    def gpt() -> None:
        sides = {
            "ddp": lambda: parts.launch(torchrun(1, ["--strategy", "ddp", *train]), limit, threads),
            "mirrored": lambda: parts.launch(
                clusterflow(["--strategy", "mirrored", *train], workers=1), limit, threads
            ),
        }
        got: dict[str, list[Run]] = {"ddp": [], "mirrored": []}
        order = list(sides)
        for _ in range(rounds):
            for name in order:
                got[name].append(sides[name]())
            order.reverse()  # no side always runs right after the other
        pairs = [
            (m.tokens_per_s, d.tokens_per_s)
            for m, d in zip(got["mirrored"], got["ddp"], strict=True)
            if m.tokens_per_s and d.tokens_per_s
        ]
        ddp_rates.extend(r.tokens_per_s for r in got["ddp"] if r.tokens_per_s)
        for name, runs in got.items():
            ok = [r for r in runs if r.tokens_per_s]
            if ok:
                figures[f"{name}_tokens_per_s"] = statistics.median(r.tokens_per_s for r in ok)  # type: ignore[misc]
                figures[f"val_loss_{name}"] = ok[-1].val_loss
                figures[f"backend_{name}"] = ok[-1].backend or "none"
            else:
                figures[f"{name}"] = "failed"
        if pairs:
            ratios = [m / d for m, d in pairs]
            figures["mirrored_vs_torchrun_ddp"] = statistics.median(ratios)
            figures["mirrored_vs_torchrun_ddp_min"] = min(ratios)
            figures["mirrored_vs_torchrun_ddp_max"] = max(ratios)

    def ps() -> None:
        for workers, key in ((1, "ps_async"), (2, "ps_async2")):
            if smoke and workers == 2:
                continue  # the CPU smoke checks the path, not the sharing
            run = parts.launch(
                clusterflow(["--strategy", "ps-async", *train], workers=workers, ps=1),
                limit,
                threads,
            )
            if run.tokens_per_s:
                figures[f"{key}_tokens_per_s"] = run.tokens_per_s
                figures[f"val_loss_{key}"] = run.val_loss
                if ddp_rates:
                    figures[f"{key}_vs_torchrun_ddp"] = run.tokens_per_s / statistics.median(
                        ddp_rates
                    )
            else:
                figures[key] = "failed"

    def shared() -> None:
        # Two ranks on the one GPU: NCCL 2.x refuses ("Duplicate GPU detected") where it
        # checks; this records what this card and NCCL do.
        run = parts.launch(torchrun(2, ["--strategy", "ddp", *train, "--steps", "20"]), 60.0)
        outcome = "ok" if run.ok else "timed_out" if run.timed_out else "refused"
        figures["shared_gpu_nccl"] = outcome

    def bandwidth() -> None:
        mib, steps = ("1", "4") if smoke else ("64", "12")
        probe = ["--mib", mib, "--steps", steps, "--device", device]
        run = parts.launch(clusterflow(probe, workers=1, ps=1, script=PROBE), limit, threads)
        match = re.search(
            r"ps_step_s=([0-9.]+) ps_step_unstaged_s=([0-9.]+) copy_pageable_s=([0-9.]+) "
            r"copy_pinned_s=([0-9.]+)",
            run.output,
        )
        if not match:
            figures["bandwidth"] = "failed"
            return
        step, unstaged, pageable, pinned = (float(g) for g in match.groups())
        moved = 2 * int(mib) * 2**20 / 1e9
        figures["ps_gpu_push_pull_GBps"] = moved / step
        figures["copy_pinned_GBps"] = moved / pinned
        figures["copy_pageable_GBps"] = moved / pageable
        figures["ps_vs_pinned_copy"] = pinned / step
        figures["ps_unstaged_GBps"] = moved / unstaged
        figures["staged_vs_unstaged"] = unstaged / step

    def scale() -> None:
        command = [sys.executable, "-m", "benchmarks.scale", "--quick", "--sizes", "1,16,32"]
        run = parts.launch([*command, "--parts", "data"], parts.left() - 5)
        line = next((x for x in run.output.splitlines() if x.startswith("RESULT scale")), "")
        for key, value in re.findall(r"(\w+)=([0-9.eE+-]+)", line):
            if not key.endswith(("_min", "_max")):
                figures[f"scale_{key}"] = float(value)
        if not line:
            figures["scale"] = "failed"

    # The bandwidth first: it is short and measures what changed (the pinned staging);
    # two ranks on one GPU last: it only says whether NCCL allows it.
    parts.part("bandwidth", 20, bandwidth)
    parts.part("gpt", 40, gpt)
    parts.part("ps", 30, ps)
    if not smoke:
        parts.part("shared", 30, shared)
    if args.scale:
        parts.part("scale", 60, scale)
    print(f"clusters' state: {home}")
    print("RESULT gpu " + " ".join(f"{k}={_fmt(v)}" for k, v in figures.items()), flush=True)


def _missing_modules() -> list[str]:
    """clusterflow's dependencies (pyproject.toml) that this Python cannot import."""
    import importlib.util

    names = ("zmq", "msgpack", "numpy", "click", "rich", "psutil", "yaml", "pyarrow")
    names += ("fsspec", "cloudpickle", "safetensors")
    return [name for name in names if importlib.util.find_spec(name) is None]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value) if value is not None else "none"


if __name__ == "__main__":
    main()
