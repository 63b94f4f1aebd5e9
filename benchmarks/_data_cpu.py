"""Where a data-service worker's CPU goes, against the direct read, per pass of a file.

``benchmarks.data`` times wall clock, which a busy shared machine moves by 2x within
seconds. This counts CPU instead, which a neighbour moves far less: one worker process,
per round, reads the whole file once directly (``benchmarks.data._direct``) and once
through the data service (a ``DataClient`` of the same settings; the dispatcher in this
process), and reports the least CPU of each over the rounds, split by thread:

* ``loop``: the training loop's thread (``next()``: cutting and collating batches);
* ``reader``: the reading thread (``ArrowSource.read``, and the copy where one is made);
* ``fetcher``: the leasing thread (``data.lease`` calls);
* ``rest``: every other thread of the process: pyarrow's I/O pool (which the direct
  read pays too) and ZeroMQ's I/O thread.

``direct / (service / 2)`` is what two workers, each reading half, could reach against
one direct reader on two free cores if nothing else cost wall time. Then two workers
(``benchmarks.data``'s) pull the file together, as ``benchmarks.data``'s service side
does: the least CPU of both together, from the signal to the end of their pass, and
``direct / (pair / 2)``, the same bound with their shares as the splits fall.

    python -m benchmarks._data_cpu [--rounds N]
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.common import one_thread_per_process, parser
from benchmarks.data import (
    BATCH,
    PREFETCH,
    SPLIT,
    _direct,
    _start_worker,
    _through_service,
    _write,
)


def _worker(conn: Connection, address: str, secret: bytes, path: str) -> None:
    import torch  # noqa: F401  (imported before timing, as a training process would have)

    from clusterflow.data import ArrowSource, DataClient, DataConfig
    from clusterflow.data import client as client_module
    from clusterflow.rpc import Credentials

    spent: dict[str, float] = {}

    def counted(name: str, label: str) -> None:
        method = getattr(client_module.DataClient, name)

        def wrapper(self: Any) -> Any:
            start = time.thread_time()
            try:
                return method(self)
            finally:
                spent[label] = time.thread_time() - start

        setattr(client_module.DataClient, name, wrapper)

    counted("_read_loop", "reader")
    counted("_fetch_loop", "fetcher")
    credentials = Credentials(secret)
    names = itertools.count()
    while (request := conn.recv()) is not None:
        if request == "direct":
            cpu = time.process_time()
            _direct(Path(path))
            conn.send({"total": time.process_time() - cpu})
            continue
        client = DataClient(
            ArrowSource(path),
            DataConfig(
                name=f"d{next(names)}", batch_size=BATCH, split_size=SPLIT, prefetch=PREFETCH
            ),
            dispatcher=address,
            credentials=credentials,
            worker="w",
        )
        spent.clear()
        cpu, loop = time.process_time(), time.thread_time()
        with client:
            for _ in client:
                pass
        loop = time.thread_time() - loop
        total = time.process_time() - cpu  # close() joined both threads: all counted
        rest = total - loop - spent["reader"] - spent["fetcher"]
        conn.send({"total": total, "loop": loop, **spent, "rest": rest})


def main() -> None:
    args = parser("_data_cpu", __doc__).parse_args()
    rounds = args.rounds or 20
    rows = 250_000  # the file of benchmarks.data --quick
    one_thread_per_process()
    from clusterflow.data import DispatcherService
    from clusterflow.rpc import Credentials, RpcServer

    with tempfile.TemporaryDirectory(prefix="clusterflow-bench-data-cpu-") as tmp:
        path = Path(tmp) / "records.parquet"
        _write(path, rows)
        credentials = Credentials.generate()
        server = RpcServer(credentials, name="bench-dispatcher")
        DispatcherService().register_on(server)
        server.start()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker, args=(child, server.address, credentials.secret, str(path)), daemon=True
        )
        proc.start()
        direct: list[dict[str, float]] = []
        service: list[dict[str, float]] = []
        pair: list[float] = []
        pair_workers = [
            _start_worker(server.address, credentials.secret, path, f"worker:{i}") for i in range(2)
        ]
        try:
            for r in range(rounds + 1):  # the first round warms up
                parent.send("direct")
                direct.append(parent.recv())
                parent.send("service")
                service.append(parent.recv())
                conns = [conn for _, conn in pair_workers]
                pair.append(_through_service(conns, f"pair-{r}")[2])
        finally:
            parent.send(None)
            for pair_proc, conn in pair_workers:
                conn.send(None)
                pair_proc.join(10)
                pair_proc.kill()
            proc.join(10)
            proc.kill()
            server.stop()
    best_direct = min(d["total"] for d in direct[1:])
    best = min(service[1:], key=lambda s: s["total"])
    ms = {k: v * 1e3 for k, v in best.items()}
    print(f"{rows} rows, splits of {SPLIT}, batches of {BATCH}; least CPU of {rounds} rounds")
    print(f"direct read:  {best_direct * 1e3:.1f} ms a pass")
    print(
        f"service:      {ms['total']:.1f} ms a pass: loop {ms['loop']:.1f}, reader "
        f"{ms['reader']:.1f}, fetcher {ms['fetcher']:.1f}, rest {ms['rest']:.1f}"
    )
    print(f"direct / (service / 2): {best_direct / (best['total'] / 2):.2f}")
    best_pair = min(pair[1:])
    print(
        f"two workers together: {best_pair * 1e3:.1f} ms a pass; "
        f"direct / (pair / 2): {best_direct / (best_pair / 2):.2f}"
    )
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
