"""Dashboard cost: training throughput while a browser watches the cluster, against none.

Twice, once per strategy: a real cluster (``ps``: 1 ps and 2 workers running async
parameter-server training; ``allreduce``: 2 workers running MultiWorkerMirroredStrategy;
both ``benchmarks/dashboard/job.py``, the MLP 784-512-512-10 of the ps and all-reduce
benchmarks, batch 128, records leased from the manager's data service) runs throughout,
and so does ``clusterflow ui``.
A headless Chromium (Debian's ``chromium``, driven by Playwright) either shows the
cluster's page, live (its charts, log tails, checkpoints and the data service's counts,
which cost the manager a ``data.status`` call a second), or ``about:blank``. Rounds
alternate the two sides in an order reversed each round; each window counts the samples
both workers trained, from the workers' own progress files.

* ``ps_watched_vs_not``, ``allreduce_watched_vs_not``: the median over rounds of that
  round's watched / unwatched samples/s (1.0: no cost; the spread says what noise is on
  this machine);
* ``*_ui_cpu``, ``*_browser_cpu``: CPU seconds per second of the dashboard's process and of
  the browser's processes while watching (of the machine's cores, 1.0 = one core).

    python -m benchmarks.dashboard [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    result,
)
from clusterflow.cluster.contract import ENV_CLUSTER_ID

ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "clusterflow.cli.main")
RECORDS = 8192
START_TIMEOUT_S = 180.0


def _write_data(path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((RECORDS, 784), dtype=np.float32)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 784),
            "y": pa.array(rng.integers(0, 10, RECORDS)),
        }
    )
    pq.write_table(table, path)


def _samples_at(path: Path, when: float) -> tuple[float, int] | None:
    """The last ``(time, samples)`` line of a worker's progress file at or before ``when``."""
    found = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) != 2:
            continue
        t, n = float(parts[0]), int(parts[1])
        if t > when:
            break
        found = (t, n)
    return found


class Bench:
    """The cluster, the dashboard and the browser of one run."""

    def __init__(self, root: Path, kind: str, window_s: float, verbose: bool) -> None:
        self.kind = kind
        self.root = root
        self.window_s = window_s
        self.verbose = verbose
        self.home = root / "home"
        self.progress = root / "progress"
        self.progress.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERFLOW_")}
        self.env["CLUSTERFLOW_HOME"] = str(self.home)
        self.cluster_id = ""
        self.ui: subprocess.Popen[str] | None = None
        self._playwright: Any = None
        self.page: Any = None
        self.ui_cpu: list[float] = []
        self.browser_cpu: list[float] = []

    def start(self) -> None:
        data = self.root / "data.parquet"
        _write_data(data)
        job = [sys.executable, str(ROOT / "benchmarks" / "dashboard" / "job.py")]
        job += [str(data), str(self.progress), self.kind]
        shape = ["--ps", "1", "--workers", "2"] if self.kind == "ps" else ["--workers", "2"]
        started = subprocess.run(
            [*CLI, "start", "--detach", *shape, "--", *job],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
            check=False,
        )
        if started.returncode != 0:
            raise SystemExit(f"benchmark failed: cluster did not start: {started.stderr}")
        self.cluster_id = started.stdout.strip()
        self.ui = subprocess.Popen(
            [*CLI, "ui", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=self.env,
        )
        assert self.ui.stdout is not None
        self.url = self.ui.stdout.readline().split()[1].split("/?")[0]
        from playwright.sync_api import sync_playwright

        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        self._playwright = sync_playwright().start()
        browser = self._playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        self.page = browser.new_page(viewport={"width": 1300, "height": 1000})
        deadline = time.monotonic() + START_TIMEOUT_S
        files = [self.progress / "worker-0", self.progress / "worker-1"]
        while not all(_samples_at(f, time.time()) for f in files):
            if time.monotonic() > deadline:
                raise SystemExit("benchmark failed: the workers did not train within 180 s")
            time.sleep(0.5)

    def owns(self, proc: psutil.Process) -> bool:
        """The detached cluster's processes count as the benchmark's own load."""
        return bool(self.cluster_id) and proc.environ().get(ENV_CLUSTER_ID) == self.cluster_id

    def _rate(self, t0: float, t1: float) -> float:
        total = 0.0
        for name in ("worker-0", "worker-1"):
            a = _samples_at(self.progress / name, t0)
            b = _samples_at(self.progress / name, t1)
            if a is None or b is None or b[0] <= a[0]:
                tail = (self.home / "clusters" / self.cluster_id / "output.log").read_text()
                raise SystemExit(
                    f"benchmark failed: {name} made no progress in a window: {a} {b}\n"
                    + tail[-3000:]
                )
            total += (b[1] - a[1]) / (b[0] - a[0])
        return total

    def _browsers(self) -> list[psutil.Process]:
        me = psutil.Process()
        return [p for p in me.children(recursive=True) if "chrom" in p.name().lower()]

    @staticmethod
    def _cpu(procs: list[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total

    def window(self, watched: bool) -> float:
        self.page.goto(f"{self.url}/clusters/{self.cluster_id}" if watched else "about:blank")
        ui = [psutil.Process(self.ui.pid)] if self.ui else []
        browsers = self._browsers()
        cpu_ui, cpu_browser = self._cpu(ui), self._cpu(browsers)
        t0 = time.time()
        time.sleep(self.window_s)
        t1 = time.time()
        if watched:
            self.ui_cpu.append((self._cpu(ui) - cpu_ui) / (t1 - t0))
            self.browser_cpu.append((self._cpu(browsers) - cpu_browser) / (t1 - t0))
        # The last progress line lands up to 10 steps after t1: wait for it.
        time.sleep(1.0)
        return self._rate(t0, t1)

    def stop(self) -> None:
        if self._playwright is not None:
            self._playwright.stop()
        if self.ui is not None:
            self.ui.terminate()
            self.ui.wait(15)
        if self.cluster_id:
            subprocess.run(
                [*CLI, "stop", self.cluster_id, "--grace", "5"],
                capture_output=True,
                env=self.env,
                timeout=60,
                check=False,
            )


def _measure(kind: str, rounds: int, window_s: float, verbose: bool) -> dict[str, Spread]:
    with tempfile.TemporaryDirectory(prefix=f"cf-bench-dashboard-{kind}-") as tmp:
        bench = Bench(Path(tmp), kind, window_s, verbose)
        load = MachineLoad(also_ours=bench.owns, interval=1.0)
        try:
            bench.start()
            figures = alternate(
                {"watched": lambda: bench.window(True), "unwatched": lambda: bench.window(False)},
                rounds,
                verbose=verbose,
            )
        finally:
            bench.stop()
    watched = ratio(figures["watched"], figures["unwatched"])
    print(f"{kind}: training samples/s, watched: {Spread.of(figures['watched'])}")
    print(f"{kind}: training samples/s, unwatched: {Spread.of(figures['unwatched'])}")
    print(f"{kind}: watched / unwatched: {watched}")
    print(f"{kind}: dashboard CPU while watched: {Spread.of(bench.ui_cpu)} cores")
    print(f"{kind}: browser CPU while watched: {Spread.of(bench.browser_cpu)} cores")
    print(f"{kind}: {load.describe()}", flush=True)
    return {
        f"{kind}_watched_vs_not": watched,
        f"{kind}_ui_cpu": Spread.of(bench.ui_cpu),
        f"{kind}_browser_cpu": Spread.of(bench.browser_cpu),
    }


def main() -> None:
    args = parser("dashboard", __doc__).parse_args()
    rounds = args.rounds or (3 if args.quick else 6)
    window_s = 8.0 if args.quick else 20.0
    one_thread_per_process()
    figures: dict[str, Spread] = {}
    for kind in ("ps", "allreduce"):
        figures.update(_measure(kind, rounds, window_s, args.verbose))
    result("dashboard", **figures)


if __name__ == "__main__":
    main()
