"""A parameter-server chief holds the ps tasks still for the whole of its write, and
lets them go again whatever the write's outcome (train/cut.py ``Checkpointer._save``).

Both promises live in a few lines of ``_save``: ``participant.quiesce()`` before the
first part is taken, ``participant.resume()`` in its ``finally``, after the manifest.
The chief here trains over an in-process ps (``LocalPS``); another worker's pushes go
straight to the same store, as they would reach a ps task while the chief saves.
"""

from __future__ import annotations

import errno
import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from clusterflow.checkpoint import CheckpointStorage, CheckpointWriteError
from clusterflow.checkpoint.names import DATA_PART, ps_part
from clusterflow.ps.api import PSError
from clusterflow.ps.local import LocalPS
from clusterflow.ps.store import VariableStore
from clusterflow.strategies import SimpleClusterResolver
from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.train.cut import Checkpointer

pytestmark = pytest.mark.usefixtures("bare_env")

LR = 0.1
HELD_S = 0.2
"""How long a push made during the write waits for the ps. Under the promise it is
refused after this long whatever the machine's speed (the ps stays held for the whole
write); without it the push is applied at once. Not a measurement."""


def _chief(store: VariableStore) -> tuple[ParameterServerStrategy, Callable[[], None]]:
    """worker:0 (the chief: the cluster has no chief task) over ``store``, one step taken."""
    strategy = ParameterServerStrategy(
        SimpleClusterResolver(
            {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
            task_type="worker",
            task_id=0,
        ),
        _connection=LocalPS(store),
    )
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.ones(3, 4)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    strategy.run(step)
    strategy.settled(wait=True)
    return strategy, step


def _ones(store: VariableStore) -> dict[str, torch.Tensor]:
    """Another worker's gradient: ones, so each of its pushes moves every value by -LR."""
    return {n: torch.ones_like(t) for n, t in store.vars.items() if store.trainable[n]}


class _Cursor:
    """Stands for the data service: a worker acks a split once the ps applied its push,
    and the chief reads the cursor (``dispatcher.state_dict``) last, after the ps parts.
    ``on_read`` runs as the chief reads it: while the checkpoint is being written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acked: set[tuple[str, int, int]] = set()
        self.on_read: Callable[[], None] | None = None

    def ack(self, key: tuple[str, int, int]) -> None:
        with self._lock:
            self.acked.add(key)

    def state_dict(self) -> dict[str, Any]:
        if self.on_read is not None:
            self.on_read()
        with self._lock:
            return {"acked": sorted(list(k) for k in self.acked)}


def _applied_keys(meta: dict[str, Any]) -> set[tuple[str, int, int]]:
    """The split keys a ps part's ``applied_keys`` state names (prefix and extras)."""
    keys = set()
    for dataset, epoch, prefix, extra in meta["applied_keys"]:
        keys |= {(dataset, epoch, s) for s in [*range(prefix), *extra]}
    return keys


def test_the_checkpoint_is_one_cut_while_another_worker_pushes_throughout() -> None:
    """Pins ``_save``'s ``participant.quiesce()`` ... ``participant.resume()`` around the
    whole write (in its ``finally``). A worker pushes throughout three saves, acking
    each split once its push was applied; and while each checkpoint is written (as the
    chief reads the data cursor, the last part) one more push is tried. It must wait on
    the held ps, and each checkpoint must be one cut: its step is the ps part's
    version, the cursor acks only splits the part applied, and the values are those of
    that version. Quiescing only to read the step and resuming before the parts are
    taken or written (``held = quiesce(); resume()``) lets that push through: the
    cursor then acks a split the ps part never applied, and this test fails."""
    store = VariableStore(0)
    strategy, _ = _chief(store)
    after_chief = {n: t.clone() for n, t in store.vars.items()}
    cursor = _Cursor()
    url = f"memory://cut-{uuid.uuid4().hex}"
    ckpt = Checkpointer(strategy, directory=url, data=SimpleNamespace(dispatcher=cursor))
    stop = threading.Event()
    failures: list[BaseException] = []
    splits = itertools.count()

    def push(split: int, timeout: float) -> None:
        key = ("ds", 0, split)
        reply = store.push(
            worker="worker:1", version=store.version, grads=_ones(store), keys=[key],
            timeout=timeout,
        )  # fmt: skip
        if reply.applied:
            cursor.ack(key)

    def pusher() -> None:
        try:
            while not stop.is_set():
                push(next(splits), 30.0)
        except BaseException as exc:  # the test reads it
            failures.append(exc)

    during: list[str] = []

    def push_during_write() -> None:
        try:
            push(next(splits), HELD_S)
            during.append("applied")
        except PSError as exc:
            assert "stayed quiesced" in str(exc)
            during.append("held")

    cursor.on_read = push_during_write
    thread = threading.Thread(target=pusher, daemon=True, name="other-worker")
    thread.start()
    try:
        for step in (1, 2, 3):
            # The other worker's pushes move the ps between two saves.
            store.wait_version(store.version + 3, 30)
            ckpt.save(step)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and not failures, failures

    storage = CheckpointStorage(url)
    committed = storage.committed()
    assert len(committed) == 3
    for manifest in committed:
        meta, tensors = storage.read_tensors(manifest, ps_part(0))
        version = int(meta["version"])
        assert manifest.step == version == manifest.meta["versions"][0]
        applied = _applied_keys(meta)
        assert len(applied) == version - 1  # every push but the chief's one named a split
        acked = {tuple(k) for k in storage.read_json(manifest, DATA_PART)["acked"]}
        assert acked <= applied, sorted(acked - applied)
        for name, value in after_chief.items():
            expected = value - LR * (version - 1)
            assert torch.allclose(tensors[f"var/{name}"], expected, atol=1e-5), name
    assert during == ["held"] * 3, during
    strategy.close()


class _FullMemory(MemoryFileSystem):  # type: ignore[misc]
    """An in-memory filesystem whose writes fail with ENOSPC while ``full`` is set."""

    protocol = "fullmem"
    full = False

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and type(self).full:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, *args, **kwargs)


@pytest.fixture
def full_disk() -> Iterator[type[_FullMemory]]:
    fsspec.register_implementation("fullmem", _FullMemory, clobber=True)
    _FullMemory.full = False
    yield _FullMemory
    _FullMemory.full = False


def test_a_failed_write_lets_the_held_ps_take_pushes_again(
    full_disk: type[_FullMemory],
) -> None:
    """Pins ``_save``'s ``finally: participant.resume()``: a checkpoint the disk refuses
    raises ``CheckpointWriteError`` naming the part, and the chief has let the ps go
    before it raised, so training goes on (the ps applies the next pushes at once) and
    the next save, once space is back, commits. Resuming only after a commit (the
    ``resume()`` moved out of the ``finally``) leaves the ps held: the push after the
    failed save is refused as quiesced, and this test fails."""
    store = VariableStore(0)
    strategy, step = _chief(store)
    url = f"fullmem://full-{uuid.uuid4().hex}"
    ckpt = Checkpointer(strategy, directory=url)
    ckpt.save(1)
    full_disk.full = True
    with pytest.raises(CheckpointWriteError, match="cannot write part 'ps-0' of checkpoint"):
        ckpt.save(2)
    full_disk.full = False
    version = store.version
    # Another worker's push: a held ps would make it wait, then refuse it.
    reply = store.push(worker="worker:1", version=version, grads=_ones(store), timeout=HELD_S)
    assert reply.applied and store.version == version + 1
    strategy.run(step)  # the chief trains on as well
    strategy.settled(wait=True)
    assert store.version == version + 2
    ckpt.save(3)
    latest = CheckpointStorage(url).latest()
    assert latest is not None and latest.step == version + 2
    strategy.close()
