"""The data service end to end: a dispatcher on an RpcServer, workers as threads and processes.

Workers read one Parquet file whose ``id`` column numbers the records, so "exactly once"
is checked by counting ids. For the balance check the workers are processes that take
their batches on a common clock, so they consume at the same pace even on a loaded
machine; that is what makes "no worker gets more than one split more" meaningful.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterflow.data import (
    ArrowSource,
    CollateError,
    Columns,
    DataClient,
    DataConfig,
    DispatcherConfig,
    DispatcherService,
    TensorSource,
    distributed_dataset,
    numpy_collate,
)
from clusterflow.rpc import Credentials, RemoteError, RpcServer
from conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RECORDS = 1120
SPLIT = 32
BATCH = 8


@dataclass
class Dispatcher:
    service: DispatcherService
    server: RpcServer
    credentials: Credentials

    @property
    def address(self) -> str:
        return self.server.address

    def client(
        self, source: Any, worker: str, *, collate: Any = numpy_collate, **config: Any
    ) -> DataClient:
        options = {"batch_size": BATCH, "split_size": SPLIT, "prefetch": 2, **config}
        return DataClient(
            source,
            DataConfig(**options),
            dispatcher=self.address,
            credentials=self.credentials,
            collate_fn=collate,
            worker=worker,
        )


def host_dispatcher(config: DispatcherConfig | None = None) -> Dispatcher:
    credentials = Credentials.generate()
    server = RpcServer(credentials, name="test-dispatcher")
    service = DispatcherService(config).register_on(server)
    server.start()
    return Dispatcher(service, server, credentials)


@pytest.fixture
def dispatcher() -> Iterator[Dispatcher]:
    d = host_dispatcher()
    yield d
    d.server.stop()


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "records.parquet"
    ids = np.arange(RECORDS, dtype=np.int64)
    table = pa.table({"id": ids, "x": ids.astype(np.float32) * 0.5})
    pq.write_table(table, path, row_group_size=SPLIT * 2)
    return path


def consume(client: DataClient) -> list[Any]:
    """Every batch of the client, acked as the simple mode does; closes the client."""
    batches = []
    with client:
        for batch in client:
            batches.append(batch)
    return batches


def ids_of(batches: list[Any]) -> Counter[int]:
    return Counter(int(i) for b in batches for i in b.data["id"])


def run_threads(targets: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]
    return results


LOCKSTEP = """\
import json, sys
from clusterflow.data import ArrowSource, DataClient, DataConfig, numpy_collate
from clusterflow.rpc import Credentials

address, path, name = sys.argv[1], sys.argv[2], sys.argv[3]
client = DataClient(
    ArrowSource(path), DataConfig(batch_size=32, split_size=32, prefetch=1, leases_ahead=1),
    dispatcher=address, credentials=Credentials.from_env(), collate_fn=numpy_collate,
    worker=name,
)
client.start()  # read ahead before the first round
print("ready", flush=True)
ids, leases = [], set()
with client:
    batches = iter(client)
    while sys.stdin.readline():  # one batch per round; the test starts each round
        batch = next(batches, None)
        if batch is None:
            break
        ids.extend(int(i) for i in batch.data["id"])
        leases.update(batch.leases)
        print("took", flush=True)
print(json.dumps({"ids": ids, "splits": len(leases)}), flush=True)
"""


@pytest.mark.parametrize("workers", [1, 3, 7])
def test_every_record_once_and_workers_balanced(
    dispatcher: Dispatcher, parquet: Path, workers: int
) -> None:
    # Equally fast workers, whatever the load: processes (threads of one process share
    # the GIL unfairly), one split per batch, one batch read ahead, one split leased
    # ahead (more would let the first workers up take the last of these 35 splits
    # before the seventh has started: 6 each, with its read-ahead), and every worker
    # takes its next batch only when all of them took the previous one (rounds the
    # test starts), so no clock decides who gets more.
    env = {**os.environ, "CLUSTERFLOW_SECRET": dispatcher.credentials.to_hex()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOCKSTEP, dispatcher.address, str(parquet), f"w{i}"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    results: dict[int, dict[str, Any]] = {}
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        running = list(range(workers))
        while running:
            for i in running:
                stdin = procs[i].stdin
                assert stdin is not None
                stdin.write("next\n")
                stdin.flush()
            for i in list(running):
                stdout = procs[i].stdout
                assert stdout is not None
                line = stdout.readline().strip()
                if line != "took":  # its data ran out: the line is its result
                    results[i] = json.loads(line)
                    running.remove(i)
        for proc in procs:
            proc.communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert all(proc.returncode == 0 for proc in procs)
    assert Counter(i for r in results.values() for i in r["ids"]) == Counter(range(RECORDS))
    status = dispatcher.service.status("default")
    assert status["finished"] and status["outstanding"] == 0
    splits = [r["splits"] for r in results.values()]
    assert sum(splits) == RECORDS // SPLIT
    # A worker's data ends in the round it finds the queue empty and its read-ahead used
    # up; a peer takes a batch in that round and may still hold its own read-ahead: one
    # split queued (prefetch=1 batch of one split), one being read, one lease fetched
    # ahead (data/client.py). So equal workers end at most 1 + 3 splits apart, whatever
    # the machine's load; a dispatcher that favoured one worker would break this.
    assert max(splits) - min(splits) <= 4, splits


VICTIM = """\
import os, signal, sys
from clusterflow.data import ArrowSource, DataClient, DataConfig, numpy_collate
from clusterflow.rpc import Credentials

address, path, out, ahead = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = DataClient(
    ArrowSource(path),
    DataConfig(batch_size=8, split_size=32, prefetch=4, leases_ahead=ahead, auto_ack=False),
    dispatcher=address, credentials=Credentials.from_env(), collate_fn=numpy_collate,
    worker="victim",
)
ids = {}
acked = 0
with open(out, "a") as log:
    for batch in client:
        ids.setdefault(batch.leases[0], []).extend(int(i) for i in batch.data["id"])
        if acked == 2:  # holding an unacked split, and more read ahead: wait for the kill
            log.write("READY\\n")
            log.flush()
            signal.pause()  # hung, holding its leases, until the test kills it
        if batch.completes:
            client.ack(batch.completes)
            for lease in batch.completes:
                log.write(" ".join(map(str, ids.pop(lease))) + "\\n")
            log.flush()
            acked += 1
"""


@pytest.mark.parametrize("ahead", [1, 4])
@pytest.mark.parametrize("recovery", ["release_worker", "deadline"])
def test_worker_killed_mid_epoch_every_record_acked_once(
    parquet: Path, tmp_path: Path, recovery: str, ahead: int
) -> None:
    """A worker holding splits at every stage (one being cut, one read, one being read,
    ``ahead`` leased and unread) is SIGKILLed: every split it held goes back to the
    dispatcher (by the manager's ``release_worker`` or the lease deadline), and two
    survivors, themselves leasing ahead, read every record once."""
    d = host_dispatcher(DispatcherConfig(lease_timeout_s=1.0))
    out = tmp_path / "victim.txt"
    env = {**os.environ, "CLUSTERFLOW_SECRET": d.credentials.to_hex()}
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, d.address, str(parquet), str(out), str(ahead)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: Counter[int] = Counter()
    lock = threading.Lock()
    try:
        wait_until(
            lambda: victim.poll() is not None or (out.exists() and "READY" in out.read_text()),
            60,
            "the victim to hold unacked splits",
        )
        assert victim.poll() is None, victim.communicate()[1]
        # Stalled in the training loop, it still fills its read-ahead and its leases
        # ahead: the split being cut, one read, one being read, and at least half of
        # ``ahead`` more (refilled once half are taken).
        stalled = 3 + max(1, ahead - ahead // 2)
        held = wait_until(
            lambda: (n := d.service.status("default")["workers"]["victim"]) >= stalled and n,
            60,
            f"the victim to hold {stalled} splits",
        )
        assert held <= 3 + ahead
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        if recovery == "release_worker":  # what the manager does when a task dies
            assert d.service.release_worker("victim") == held
        else:
            wait_until(
                lambda: "victim" not in d.service.status("default")["workers"],
                60,
                "the lease deadline to take the victim's splits back",
            )
        status = d.service.status("default")
        # Every split it held is pending again; only the two it acked are done.
        assert status["outstanding"] == 0
        assert status["live"]["0"] == {"pending": RECORDS // SPLIT - 2, "acked": 2}

        def survivor(name: str) -> None:
            client = d.client(ArrowSource(str(parquet)), name, auto_ack=False)
            ids: dict[int, list[int]] = {}
            with client:
                for batch in client:
                    ids.setdefault(batch.leases[0], []).extend(int(i) for i in batch.data["id"])
                    if batch.completes:
                        client.ack_through(batch)
                        with lock:
                            for lease in batch.completes:
                                acked.update(ids.pop(lease))

        run_threads([lambda: survivor("s0"), lambda: survivor("s1")])
        for line in out.read_text().splitlines():
            if line != "READY":
                acked.update(int(i) for i in line.split())
        assert acked == Counter(range(RECORDS))
        assert d.service.status("default")["finished"]
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.communicate(timeout=10)
        d.server.stop()


def test_closing_client_hands_back_its_leased_ahead_splits_and_acks_only_what_it_read(
    dispatcher: Dispatcher, parquet: Path
) -> None:
    """A client with splits leased ahead acks one split and closes: the cursor counts
    that split alone as done (the leased-ahead ones are not delivered), the close hands
    back every other split it held, and a second client reads exactly the rest."""
    client = dispatcher.client(ArrowSource(str(parquet)), "w", auto_ack=False, leases_ahead=4)
    first: list[Any] = []
    for batch in client:
        first.append(batch)
        if batch.completes:  # one whole split (SPLIT is 4 batches)
            client.ack_through(batch)
            break
    held = wait_until(  # the split being cut, one read, one being read, >= 2 ahead
        lambda: (n := dispatcher.service.status("default")["workers"]["w"]) >= 5 and n,
        60,
        "the client to lease ahead",
    )
    cursor = client.state_dict()["datasets"]["default"]["epochs"][0]
    assert len(cursor["acked"]) == 1 and len(cursor["outstanding"]) == held
    client.close()
    status = dispatcher.service.status("default")
    assert status["outstanding"] == 0 and status["workers"].get("w", 0) == 0
    rest = consume(dispatcher.client(ArrowSource(str(parquet)), "w2"))
    assert ids_of(rest) == Counter(range(RECORDS)) - ids_of(first)
    assert dispatcher.service.status("default")["finished"]


def test_acks_of_the_simple_mode_go_alone_when_no_lease_call_is_due(
    dispatcher: Dispatcher, parquet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many splits leased ahead, the next lease call may be several splits away;
    the simple mode's acks (and with them the worker's sign of life) go alone once they
    waited ``ACK_DUE_S`` (0 here) instead of waiting for it."""
    from clusterflow.data import client as client_module

    monkeypatch.setattr(client_module, "ACK_DUE_S", 0.0)
    client = dispatcher.client(ArrowSource(str(parquet)), "w", leases_ahead=16)
    with client:
        batches = [next(client) for _ in range(SPLIT // BATCH)]
        assert batches[-1].completes  # the first split, whole
        next(client)  # the batches before are applied: their split's ack is due
        wait_until(
            lambda: dispatcher.service.status("default")["live"]["0"]["acked"] == 1,
            10,
            "the first split's ack, with 8 or more splits still leased ahead",
        )
        assert dispatcher.service.status("default")["workers"]["w"] >= 8 + 2


@pytest.mark.parametrize("waits", [False, True])
def test_a_worker_that_stops_when_nothing_is_left_asks_nothing_after_the_last_grant(
    dispatcher: Dispatcher, parquet: Path, monkeypatch: pytest.MonkeyPatch, waits: bool
) -> None:
    """The grant that lends the last pending split says so (``last``): the simple mode
    stops after those splits without another ask (it could only be told to stop), while
    a worker that waits for every ack asks on, since a peer's splits may come back."""
    statuses: list[tuple[str, bool]] = []
    lease = dispatcher.service.lease

    def counted(*args: Any, **kwargs: Any) -> Any:
        grant = lease(*args, **kwargs)
        statuses.append((grant.status.value, grant.last))
        return grant

    monkeypatch.setattr(dispatcher.service, "lease", counted)
    client = dispatcher.client(ArrowSource(str(parquet)), "w", wait_for_all_acks=waits)
    assert ids_of(consume(client)) == Counter(range(RECORDS))
    leases = [s for s in statuses if s[0] == "lease"]
    assert leases[-1] == ("lease", True) and not any(last for _, last in leases[:-1])
    if waits:
        assert statuses[-1][0] == "end"
    else:
        assert statuses == leases


def lease_orders(parquet: Path, seed: int) -> list[list[int]]:
    d = host_dispatcher()
    try:
        batches = consume(d.client(ArrowSource(str(parquet)), "w", seed=seed, epochs=2))
    finally:
        d.server.stop()
    orders: list[list[int]] = [[], []]
    for b in batches:
        start = int(b.data["id"][0]) // SPLIT
        if not orders[b.epoch] or orders[b.epoch][-1] != start:
            orders[b.epoch].append(start)
    assert all(sorted(o) == list(range(RECORDS // SPLIT)) for o in orders)
    return orders


def test_epochs_reshuffle_and_runs_repeat(parquet: Path) -> None:
    first = lease_orders(parquet, seed=3)
    assert first[0] != first[1]
    assert lease_orders(parquet, seed=3) == first
    assert lease_orders(parquet, seed=4) != first


def test_cursor_restored_in_a_new_dispatcher_delivers_exactly_the_rest(parquet: Path) -> None:
    old = host_dispatcher()
    try:
        client = old.client(ArrowSource(str(parquet)), "w", auto_ack=False, shuffle_buffer=SPLIT)
        acked: Counter[int] = Counter()
        taken: Counter[int] = Counter()
        for batch in client:
            taken.update(int(i) for i in batch.data["id"])
            if batch.completes:  # with split % batch == 0, the split is all in `taken`
                client.ack_through(batch)
                acked, taken = acked + taken, Counter()
                if len(acked) >= RECORDS // 3:
                    break
        next(client)  # one more batch taken, its split not acked: it must come again
        state = json.loads(json.dumps(client.state_dict()))  # as a checkpoint stores it
        client.close()
    finally:
        old.server.stop()
    assert state["datasets"]["default"]["epochs"][0]["outstanding"]

    new = host_dispatcher()
    try:
        new.service.load_state_dict(state)
        rest = consume(new.client(ArrowSource(str(parquet)), "w2", shuffle_buffer=SPLIT))
    finally:
        new.server.stop()
    assert ids_of(rest) == Counter(range(RECORDS)) - acked


def test_unknown_lease_and_conflicting_definition_are_clear_errors(
    dispatcher: Dispatcher, parquet: Path
) -> None:
    client = dispatcher.client(ArrowSource(str(parquet)), "w", auto_ack=False)
    with client:
        batch = next(client)
        with pytest.raises(RemoteError, match="lease 4242 was never issued") as info:
            client.ack([4242])
        assert info.value.error_type == "UnknownLeaseError"
        with pytest.raises(RemoteError, match=r"split_size: 32 != 16") as conflict:
            dispatcher.client(ArrowSource(str(parquet)), "w2", split_size=16)
        assert conflict.value.error_type == "DatasetConflictError"
        with pytest.raises(RemoteError, match="no dataset 'other'"):
            client.dispatcher.ack("other", [1])
        assert next(client).index == batch.index + 1  # the dispatcher kept serving


def test_one_call_acks_and_leases_several_splits_each_once(dispatcher: Dispatcher) -> None:
    """``data.lease`` with ``count``: several splits per round trip over the wire, each
    under its own lease; the acks that ride along settle the previous ones; a bad count
    is refused with its value named, and the dispatcher serves on."""
    from clusterflow.data import DatasetSpec
    from clusterflow.data.dispatcher_client import DispatcherClient
    from clusterflow.rpc import RpcClient

    spec = DatasetSpec(name="many", source="range://40", num_records=40, split_size=4)
    rpc = RpcClient(dispatcher.address, dispatcher.credentials, deadline=10.0)
    try:
        client = DispatcherClient(rpc)
        client.register(spec, [])
        seen: list[list[int]] = []
        acks: list[int] = []
        while (reply := client.lease("many", "w", None, acks, count=3)).status == "lease":
            assert 1 <= len(reply.leases) <= 3
            seen.extend(lease.to_wire() for lease in reply.leases)
            acks = [lease.lease_id for lease in reply.leases]
        assert reply.status == "end"
        assert len({lease[0] for lease in seen}) == len(seen) == 10
        assert Counter(r for _, _, a, b in seen for r in range(a, b)) == Counter(range(40))
        for bad in (0, 10_000, True, "3"):
            with pytest.raises(RemoteError, match=f"lease count .* got {bad!r}"):
                client.lease("many", "w", None, count=bad)  # type: ignore[arg-type]
        assert client.status("many")["finished"]
    finally:
        rpc.close()


class NullAt:
    """A source whose ``v`` column holds a null at one record (a corrupt record)."""

    def __init__(self, n: int, bad: int) -> None:
        self.uri = f"null-at:{n}"
        values: list[Any] = list(range(n))
        values[bad] = None
        self._inner = TensorSource({"id": np.arange(n), "v": values})

    def num_records(self) -> int:
        return self._inner.num_records()

    def read(self, start: int, stop: int) -> Columns:
        return self._inner.read(start, stop)


def test_corrupt_record_fails_its_worker_not_the_dispatcher(dispatcher: Dispatcher) -> None:
    bad = dispatcher.client(NullAt(64, 37), "bad", epochs=1)
    with bad, pytest.raises(CollateError, match=r"record 37 of split \[32, 64\) of epoch 0"):
        for _ in bad:
            pass
    # The dispatcher lives on: a worker that keeps only the good column finishes the epoch,
    # including the split the failed worker handed back on close.
    good = consume(
        dispatcher.client(NullAt(64, 37), "good", collate=lambda c: numpy_collate({"id": c["id"]}))
    )
    assert dispatcher.service.status("default")["finished"]
    # Exactly that split, once: the bad worker's first split was acked when it asked
    # for the next batch (auto-ack), so it is not lent again.
    assert ids_of(good) == Counter(range(32, 64))


class TwoHosts:
    """Records 0-255 stored on host ``a``, 256-511 on host ``b``."""

    uri = "two-hosts"

    def num_records(self) -> int:
        return 512

    def read(self, start: int, stop: int) -> Columns:
        return {"id": np.arange(start, stop)}

    def location(self, start: int, stop: int) -> str:
        return "a" if start < 256 else "b"


def test_workers_read_local_splits_first(dispatcher: Dispatcher) -> None:
    options = {"batch_size": 16, "split_size": 16, "prefetch": 2, "auto_ack": False}
    clients = {
        host: DataClient(
            TwoHosts(),
            DataConfig(**options),
            dispatcher=dispatcher.address,
            credentials=dispatcher.credentials,
            collate_fn=numpy_collate,
            worker=f"on-{host}",
            host=host,
        )
        for host in ("a", "b")
    }
    with clients["a"], clients["b"]:
        first_a = [int(next(clients["a"]).data["id"][0]) for _ in range(4)]
        first_b = [int(next(clients["b"]).data["id"][0]) for _ in range(4)]
    assert all(i < 256 for i in first_a), first_a
    assert all(i >= 256 for i in first_b), first_b


def test_one_process_runs_without_a_cluster(monkeypatch: pytest.MonkeyPatch, parquet: Path) -> None:
    import torch

    for name in ("CLUSTERFLOW_DISPATCHER", "CLUSTERFLOW_MANAGER", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    with distributed_dataset(
        f"file://{parquet}", batch_size=100, split_size=SPLIT, shuffle_buffer=64, epochs=2
    ) as data:
        batches = list(data)
    assert isinstance(batches[0].data["x"], torch.Tensor)
    assert next(len(b) for b in batches if b.epoch == 0) == 100
    for epoch in (0, 1):
        assert ids_of([b for b in batches if b.epoch == epoch]) == Counter(range(RECORDS))
    x = torch.cat([b.data["x"] for b in batches])
    ids = torch.cat([b.data["id"] for b in batches])
    assert torch.equal(x, ids.float() * 0.5)  # columns stay aligned through the shuffle


def test_chief_hosts_the_dispatcher_on_its_server(parquet: Path) -> None:
    from clusterflow.server import create_local_server

    server = create_local_server()  # manual mode: the chief's Server
    try:
        service = DispatcherService().register_on(server)
        assert server.credentials is not None
        client = DataClient(
            ArrowSource(str(parquet)),
            DataConfig(batch_size=BATCH * 4, split_size=SPLIT * 4),
            dispatcher=server.target,
            credentials=server.credentials,
            collate_fn=numpy_collate,
            worker="chief:0",
        )
        assert ids_of(consume(client)) == Counter(range(RECORDS))
        assert service.status("default")["finished"]
    finally:
        server.stop()
