"""Reading from an in-memory cache vs decoding Parquet: records/s to the training loop.

The records are MNIST-shaped: ``x``, 784 float32 pixels (about 80% zeros, the rest
multiples of 1/255, as MNIST's are), and ``y``, an int64 label; 30k records with
--quick (94 MB in memory), 60k without. They are written as a snappy-compressed Parquet
file in row groups of 4096, and loaded into a cache of 2 partitions
(``clusterflow.cache.local.create``, a real cache-server daemon under a temporary
``CLUSTERFLOW_HOME``).

* parquet (the peer): one process reads the file row group by row group and cuts each
  into batches of 256 records as tensors (one copy per row group into writable memory,
  then ``torch.from_numpy`` views): what a loader that decodes every epoch costs.
* cache: a ``DispatcherService`` in this process; two worker processes iterate
  ``distributed_dataset("cache://bench")``-style ``DataClient``s (leases, reading
  threads, batches of 256 collated to tensors), started together on a signal; timed
  from the signal to the last batch of a fresh dataset.
* ray_data (a second peer, when ``ray.data`` imports): Ray Data's
  ``iter_torch_batches(batch_size=256)`` over the same file read with ``read_parquet``
  and ``materialize()``d, so its blocks are already decoded in Ray's object store (Ray's
  own in-memory answer; without --quick, a dataset read anew, as each epoch would, is
  timed once and printed: it takes seconds). One driver of a one-node Ray instance
  started here inside a network namespace of its own (only loopback up; needs root), so
  nothing leaves the machine.

``vs_parquet`` = cache records/s (2 workers together) / parquet records/s (goal >= 3:
memory instead of decoding). ``local_fraction`` = records the workers read from their
own node's shared memory / all records, from the sources' counters (on this machine
every partition is local; the Ray test measures it across nodes). ``vs_ray_data`` =
cache records/s / Ray Data's records/s (goal >= 1.5; left out, with the reason printed,
when ``ray.data`` does not import, e.g. without pandas).

Rounds alternate the sides in an order reversed each round (``common.alternate``);
each side's turn is the best of 3 passes.

    python -m benchmarks.cache [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MachineLoad,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    result,
)

PIXELS = 784
BATCH = 256
ROW_GROUP = 4096
SPLIT = 1024
"""Records per lease: the cache's granule, so no split spans two partitions."""
PREFETCH = 16
BURST = 3


def _write(path: Path, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pixels = rng.integers(1, 256, size=(rows, PIXELS)).astype(np.float32) / 255.0
    pixels[rng.random((rows, PIXELS)) < 0.8] = 0.0
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), PIXELS),
            "y": rng.integers(0, 10, size=rows),
        }
    )
    pq.write_table(table, path, row_group_size=ROW_GROUP, compression="snappy")


def _parquet(path: Path) -> int:
    """The peer: row groups decoded in order, cut into batches of tensors, one process."""
    import pyarrow.parquet as pq
    import torch

    f = pq.ParquetFile(path)
    records = 0
    for g in range(f.num_row_groups):
        table = f.read_row_group(g, use_threads=False)
        n = table.num_rows
        x = table.column("x").combine_chunks().flatten().to_numpy().reshape(n, PIXELS).copy()
        y = table.column("y").to_numpy().copy()
        for lo in range(0, n, BATCH):
            batch = {
                "x": torch.from_numpy(x[lo : lo + BATCH]),
                "y": torch.from_numpy(y[lo : lo + BATCH]),
            }
            records += len(batch["y"])
    return records


def _worker(conn: Connection, address: str, secret: bytes, name: str) -> None:
    """A worker process: per request, iterate one fresh dataset of the cache."""
    import torch  # noqa: F401  (imported before timing, as a training process would have)

    from clusterflow.data import DataClient, DataConfig
    from clusterflow.data.cache_source import CacheSource
    from clusterflow.rpc import Credentials

    credentials = Credentials(secret)
    source = CacheSource("bench")
    while True:
        dataset = conn.recv()
        if dataset is None:
            conn.send(source.stats())
            return
        client = DataClient(
            source,
            DataConfig(name=dataset, batch_size=BATCH, split_size=SPLIT, prefetch=PREFETCH),
            dispatcher=address,
            credentials=credentials,
            worker=name,
            host=source.node,
        )
        conn.send("ready")
        conn.recv()  # go
        records = 0
        start = time.monotonic()
        with client:
            for batch in client:
                records += batch.size
        conn.send((records, start, time.monotonic()))


def _through_cache(conns: list[Connection], dataset: str) -> tuple[int, float]:
    for conn in conns:
        conn.send(dataset)
    for conn in conns:
        assert conn.recv() == "ready"
    for conn in conns:
        conn.send("go")
    done = [conn.recv() for conn in conns]
    return sum(d[0] for d in done), max(d[2] for d in done) - min(d[1] for d in done)


RAY_PEER = """
import logging, sys, time
import ray, ray.data
ray.init(num_cpus=2, object_store_memory=400 << 20, include_dashboard=False,
         logging_level="ERROR", log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
logging.getLogger("ray.data").setLevel(logging.ERROR)

def rate(dataset):
    records, start = 0, time.perf_counter()
    for batch in dataset.iter_torch_batches(batch_size=256):
        records += len(batch["y"])
    return records / (time.perf_counter() - start)

rate(ray.data.read_parquet(sys.argv[1]).limit(256))  # imports ray.train, starts workers
if sys.argv[2] == "anew":
    print("reading", rate(ray.data.read_parquet(sys.argv[1])), flush=True)
held = ray.data.read_parquet(sys.argv[1]).materialize()
print("ready", flush=True)
for line in sys.stdin:
    print(rate(held), flush=True)
"""


@contextlib.contextmanager
def _ray_data(path: Path, anew: str) -> Iterator[Callable[[], float] | str]:
    """A side that times Ray Data over ``path`` in a namespaced Ray; or why there is none."""
    probe = subprocess.run(
        [sys.executable, "-c", "import ray.data, ray.train.torch"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1]
        yield f"ray.data or ray.train.torch (iter_torch_batches needs it) fails: {why}"
        return
    if shutil.which("ip") is None or os.geteuid() != 0:
        yield "needs root and iproute2 for a network namespace"
        return
    ns = f"cache-bench-{secrets.token_hex(3)}"
    root = tempfile.mkdtemp(prefix="ray-c-")
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc: subprocess.Popen[str] | None = None
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        # HOME too: a local ray.init writes ~/.ray/auth_token, and every Ray cluster
        # started on this machine afterwards would then require it.
        env = {**os.environ, "RAY_TMPDIR": root, "HOME": root, "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", RAY_PEER, str(path), anew],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert proc.stdout is not None and proc.stdin is not None
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            if line.startswith("reading "):
                anew = float(line.split()[1])
                print(f"Ray Data reading the Parquet file anew: {anew:.0f} records/s, once")

        def side() -> float:
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            return float(proc.stdout.readline())

        yield side
    finally:
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:  # every process in the namespace was started here
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    args = parser("cache", __doc__).parse_args()
    rows = 30_000 if args.quick else 60_000
    rounds = args.rounds or (7 if args.quick else 15)
    one_thread_per_process()
    load = MachineLoad()
    from clusterflow.cluster.contract import ENV_HOME
    from clusterflow.data import DispatcherService
    from clusterflow.rpc import Credentials, RpcServer

    with tempfile.TemporaryDirectory(prefix="clusterflow-bench-cache-") as tmp:
        os.environ[ENV_HOME] = str(Path(tmp) / "home")
        from clusterflow.cache import local

        path = Path(tmp) / "mnist.parquet"
        _write(path, rows)
        made = time.perf_counter()
        cache = local.create("bench", str(path), 2)
        made = time.perf_counter() - made
        credentials = Credentials.generate()
        server = RpcServer(credentials, name="bench-dispatcher")
        DispatcherService().register_on(server)
        server.start()
        ctx = mp.get_context("spawn")
        workers: list[tuple[Any, Connection]] = []
        for i in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(child, server.address, credentials.secret, f"worker:{i}")
            )
            proc.start()
            workers.append((proc, parent))
        conns = [conn for _, conn in workers]
        fresh = itertools.count()
        stats: list[dict[str, int]] = []
        try:
            with _ray_data(path, "no" if args.quick else "anew") as ray_side:
                sides: dict[str, Callable[[], float]] = {
                    "parquet": functools.partial(
                        _best, lambda: rows / _timed(lambda: _parquet(path))
                    ),
                    "cache": functools.partial(
                        _best, lambda: _rate(*_through_cache(conns, f"pass-{next(fresh)}"))
                    ),
                }
                if callable(ray_side):
                    sides["ray_data"] = functools.partial(_best, ray_side)
                rates = alternate(sides, rounds, verbose=args.verbose)
        finally:
            for proc, conn in workers:
                with contextlib.suppress(OSError, EOFError):
                    conn.send(None)
                    stats.append(conn.recv())
                proc.join(10)
                proc.kill()
            server.stop()
            local.drop("bench")

    local_records = sum(s["records_local"] for s in stats)
    all_records = local_records + sum(s["records_remote"] for s in stats)
    local_fraction = local_records / all_records if all_records else 0.0
    vs_parquet = ratio(rates["cache"], rates["parquet"])
    m = 1e6
    total = sum(p.bytes for p in cache.partitions)
    print(f"{rows} records of {PIXELS} float32 + a label, batches of {BATCH}, splits of {SPLIT}")
    print(
        f"cache: {len(cache.partitions)} partitions, {total / 2**20:.0f} MiB, loaded in {made:.1f}s"
    )
    print(f"medians of {rounds} rounds, each side the best of {BURST} passes:")
    print(f"parquet, one process:  {_median(rates['parquet']) / m:6.3f} M records/s")
    print(f"cache, 2 workers:      {_median(rates['cache']) / m:6.3f} M records/s")
    figures: dict[str, Any] = {"vs_parquet": vs_parquet}
    if "ray_data" in rates:
        print(f"Ray Data, iter_torch_batches: {_median(rates['ray_data']) / m:6.3f} M records/s")
        figures["vs_ray_data"] = ratio(rates["cache"], rates["ray_data"])
    else:
        print(f"vs_ray_data left out: {ray_side}")
    bytes_copied = sum(s["bytes_copied"] for s in stats)
    remote = sum(s["bytes_remote"] for s in stats)
    print(
        f"workers' counters: {local_records} records local, {all_records - local_records} "
        f"remote; {bytes_copied} bytes copied, {remote} bytes over the wire"
    )
    print(load.describe(), flush=True)
    result("cache", **figures, local_fraction=local_fraction)


def _rate(records: int, seconds: float) -> float:
    return records / seconds


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _best(fn: Callable[[], float]) -> float:
    return max(fn() for _ in range(BURST))


if __name__ == "__main__":
    main()
