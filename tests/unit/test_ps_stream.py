"""The streamed ps (issue 28): a push is stepped frame by frame, a pull written frame by frame.

A gradient over ``codec.WHOLE_BYTES`` travels in frames; the ps steps its optimizer on
chunks of the variable, each gradient chunk a view of the received frame
(``ps/chunks.py``), and the worker writes each pulled frame into its parameter
(``shards.load_into``). These tests hold the streamed path, over a real ps server and
RPC client, to the unstreamed one (one whole tensor per variable, torch's optimizer on
it) bit for bit, for float32 and bfloat16 gradients and for embedding rows; and they
pin the all-or-nothing rules: a push is checked in full before its first write, its
keys count only once all of it applied, and a checkpoint never reads part of it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clusterflow.ps.api import PSConfig, Shard, VariableSpec
from clusterflow.ps.loans import Loan
from clusterflow.ps.rows import RowOptimizerSpec, TableSpec
from clusterflow.ps.rows_protocol import RowsPullRequest, RowsPushRequest
from clusterflow.ps.service import PSService
from clusterflow.ps.store import VariableStore
from clusterflow.ps.tables import RowStore
from clusterflow.rpc import Credentials, RpcClient, codec
from clusterflow.server import create_local_server
from clusterflow.strategies.parameter_server.shards import TrackedVar, load_into

pytestmark = pytest.mark.timeout(120)

N = 2 * 1024 * 1024 + 12_345
"""Elements of the variable: 8 MiB of float32, so 17 chunks, the last one short; its
bfloat16 gradient is over ``codec.WHOLE_BYTES`` too, so it travels in frames."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.join() if isinstance(t, codec.Framed) else t
    return t.contiguous().view(-1).view(torch.uint8 if t.element_size() == 1 else torch.int16)


def _same(a: Any, b: Any) -> bool:
    return torch.equal(_bits(a), _bits(b))


@pytest.fixture
def ps() -> Iterator[tuple[PSService, RpcClient]]:
    credentials = Credentials.generate()
    server = create_local_server(credentials=credentials)
    service = PSService(server)
    client = RpcClient(server.target, credentials, deadline=60)
    try:
        yield service, client
    finally:
        client.close()
        server.stop()


def _grads(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(N, generator=gen) * 1e-2 for _ in range(steps)]


OPTIMIZERS = {
    "sgd": ({"name": "SGD", "groups": [{"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}]}),
    "adam": ({"name": "Adam", "groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}]}),
}


def _reference(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """The unstreamed path: the whole variable, torch's optimizer over it."""
    var = torch.linspace(-1, 1, N)
    hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["groups"][0].items()}
    return var, getattr(torch.optim, spec["name"])([var], **hyper)


def _setup(client: RpcClient, spec: dict[str, Any]) -> None:
    decl = [{"name": "w", "shape": [N], "dtype": "float32"}]
    config = {"mode": "async", "num_replicas": 1}
    client.call("ps.create", {"config": config, "vars": decl}, {"w": torch.linspace(-1, 1, N)})
    client.call("ps.optimizer", {"spec": spec, "group_of": {"w": 0}})


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_streamed_push_and_pull_equal_the_unstreamed_path_bit_for_bit(
    ps: tuple[PSService, RpcClient], opt: str, wire: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, client = ps
    _setup(client, OPTIMIZERS[opt])
    var, reference = _reference(OPTIMIZERS[opt])
    seen: list[type] = []
    check = VariableStore._check

    def spy(self: VariableStore, grads: Any, *rest: Any) -> Any:
        seen.extend(type(g) for g in grads.values())
        return check(self, grads, *rest)

    monkeypatch.setattr(VariableStore, "_check", spy)
    dtype = getattr(torch, wire)
    for version, grad in enumerate(_grads(3)):
        sent = grad.to(dtype)
        reply = client.call(
            "ps.push",
            {"worker": "w", "version": version, "want_values": True, "values_dtype": wire},
            {"g/w": sent},
            framed=True,
        )
        var.grad = sent.to(torch.float32)
        reference.step()
        values = reply.tensors["w"]
        assert isinstance(values, codec.Framed)  # the reply was not joined either
        assert _same(values, var.to(dtype))
    # every gradient reached the store as the frames it came in, never joined
    assert seen == [codec.Framed] * 3
    assert _same(service.store.vars["w"], var)
    # the worker's side: the pulled frames, written straight into a parameter
    pulled = client.call("ps.pull", {"dtype": wire}, framed=True).tensors["w"]
    param = torch.zeros(N)
    address = param.data_ptr()
    monkeypatch.setattr(codec.Framed, "join", _no_join)
    load_into([_tracked(param)], {"w": pulled})
    assert param.data_ptr() == address and _same(param, var.to(dtype).to(torch.float32))
    # the checkpoint holds the whole variable's slots, as the unstreamed optimizer's
    _, tensors = service.store.state()
    for key, value in reference.state[var].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            assert _same(tensors[f"slot/w/{key}"], value), key


def _no_join(self: codec.Framed) -> torch.Tensor:
    raise AssertionError("a pulled value was joined before it reached the parameter")


def _tracked(param: torch.Tensor) -> TrackedVar:
    spec = VariableSpec(name="w", shape=tuple(param.shape), dtype="float32")
    shape = tuple(param.shape)
    shard = Shard(variable="w", name="w", ps=0, start=0, stop=shape[0], shape=shape)
    return TrackedVar(tensor=param, spec=spec, shards=(shard,))


def test_a_checkpoint_of_a_chunked_optimizer_resumes_as_the_whole_one() -> None:
    spec = OPTIMIZERS["adam"]
    store = _store(spec)
    var, reference = _reference(spec)
    grads = _grads(4)
    for version, grad in enumerate(grads[:2]):
        store.push(worker="w", version=version, grads={"w": grad})
        var.grad = grad
        reference.step()
    meta, tensors = store.state()
    restored = VariableStore(0)
    restored.load_state(meta, tensors)
    for version, grad in enumerate(grads[2:], start=2):
        restored.push(worker="w", version=version, grads={"w": grad})
        var.grad = grad
        reference.step()
    assert _same(restored.vars["w"], var)


@pytest.mark.parametrize("part_bytes", [0, 1024 * 1024], ids=["one_message", "in_parts"])
def test_embedding_rows_pushed_in_frames_equal_the_rows_pushed_in_process(
    ps: tuple[PSService, RpcClient], part_bytes: int
) -> None:
    """In one message of frames, and in parts of 1 MiB (``codec.encode_parts``: 10 parts)."""
    _, client = ps
    rows, dim = 40_000, 64  # a push of 10 MiB of rows: it travels in frames
    table = TableSpec(name="t", rows=rows, dim=dim, num_shards=1, init="zeros")
    config = PSConfig(mode="async", num_replicas=1)
    optimizer = RowOptimizerSpec(name="Adagrad", hyper={"lr": 0.1, "eps": 1e-10})
    local = RowStore(0)
    local.create(config, [table])
    local.set_optimizer({"t": optimizer})
    client.call(
        "ps.rows_create", {"config": config.to_dict(), "tables": [table.to_dict()], "shard": None}
    )
    client.call("ps.rows_optimizer", {"optimizers": {"t": optimizer.to_dict()}})
    gen = torch.Generator().manual_seed(3)
    for version in range(3):
        ids = torch.randint(0, rows, (rows,), generator=gen)
        grads = torch.randn(rows, dim, generator=gen)
        push = RowsPushRequest(worker="w", version=version, ids={"t": ids}, grads={"t": grads})
        reply = client.call("ps.rows_push", *push.to_wire(), part_bytes=part_bytes)
        assert reply.body["applied"]
        local.push(worker="w", version=version, grads={"t": (ids, grads)})
    every = torch.arange(rows)
    pull = RowsPullRequest(ids={"t": every})
    remote = client.call("ps.rows_pull", *pull.to_wire()).tensors["r/t"]
    assert _same(remote, local.pull({"t": every})[1]["t"])


def _store(spec: dict[str, Any]) -> VariableStore:
    from clusterflow.ps.optimizer import OptimizerSpec

    store = VariableStore(0)
    store.create(
        PSConfig(mode="async", num_replicas=1),
        [{"name": "w", "shape": [N], "dtype": "float32"}],
        {"w": torch.linspace(-1, 1, N)},
    )
    store.set_optimizer(OptimizerSpec.from_dict(spec), {"w": 0})
    return store


def _framed(grad: torch.Tensor) -> codec.Framed:
    """``grad`` as a receiver framing it gets it: the frames the codec cuts it into."""
    frames = codec.encode(codec.KIND_REQUEST, 1, "ps.push", None, {"g/w": grad})
    header = codec.decode_header(frames[0])
    framed = codec.decode_tensors(header, [bytes(f) for f in frames[1:]], framed=True)["g/w"]
    assert isinstance(framed, codec.Framed) and len(framed.pieces) > 2
    return framed


def test_a_nan_in_the_last_frame_refuses_the_whole_push() -> None:
    store = _store(OPTIMIZERS["sgd"])
    before = store.vars["w"].clone()
    grad = _grads(1)[0]
    grad[-1] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        store.push(worker="w", version=0, grads={"w": _framed(grad)}, keys=[("d", 0, 1)])
    assert _same(store.vars["w"], before) and store.version == 0
    assert not store.applied.applied([("d", 0, 1)])


def _halfway(store: VariableStore, between: Any, fail: bool) -> None:
    """Makes ``store``'s next step apply its first chunks, call ``between``, then either
    fail (as a ps killed there would stop) or apply the rest."""
    step = store._step

    def halves(grads: Any, hyper: Any, lr_scale: float) -> None:
        def half(first: bool) -> Any:
            return {
                n: [g if (k < len(c) // 2) == first else None for k, g in enumerate(c)]
                for n, c in grads.items()
            }

        step(half(True), hyper, lr_scale)
        between()
        if fail:
            raise RuntimeError("the ps died between two chunks")
        step(half(False), hyper, lr_scale)

    store._step = halves  # type: ignore[method-assign]


def test_a_push_that_fails_between_two_chunks_counts_no_key_and_no_version() -> None:
    store = _store(OPTIMIZERS["sgd"])
    _halfway(store, lambda: None, fail=True)
    with pytest.raises(RuntimeError, match="between two chunks"):
        store.push(worker="w", version=0, grads={"w": _framed(_grads(1)[0])}, keys=[("d", 0, 1)])
    assert store.version == 0
    assert not store.applied.applied([("d", 0, 1)])


def test_a_checkpoint_taken_while_a_push_applies_holds_none_of_it() -> None:
    store = _store(OPTIMIZERS["sgd"])
    before = store.vars["w"].clone()
    cut: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
    reader = threading.Thread(target=lambda: cut.append(store.state()), daemon=True)

    def checkpoint_between_chunks() -> None:
        reader.start()
        # The reader waits for the lock this push holds; were it not held, it would
        # copy half a push here. (Bounded only so that the broken case finishes.)
        reader.join(1.0)

    _halfway(store, checkpoint_between_chunks, fail=False)
    result = store.push(
        worker="w", version=0, grads={"w": _framed(_grads(1)[0])}, keys=[("d", 0, 1)]
    )
    reader.join(30)
    assert result.applied and cut, "the push or the checkpoint never finished"
    meta, tensors = cut[0]
    # all of the push (its keys and version too), never half of it
    assert not _same(tensors["var/w"], before) and _same(tensors["var/w"], store.vars["w"])
    assert meta["version"] == 1 and meta["applied_keys"] == store.applied.to_state()


def test_a_variable_moved_off_a_reply_in_flight_takes_its_chunks_along() -> None:
    store = _store(OPTIMIZERS["sgd"])
    var, reference = _reference(OPTIMIZERS["sgd"])
    _, lent = store.pull(None, lend=Loan())  # a reply whose bytes never left
    grad = _grads(1)[0]
    store.push(worker="w", version=0, grads={"w": _framed(grad)})
    var.grad = grad
    reference.step()
    assert store.stats["copied_on_write"] == 1
    assert _same(store.vars["w"], var)  # the step wrote the copy, through every chunk
    assert _same(lent["w"], torch.linspace(-1, 1, N))  # and never the lent memory


def _cut(grad: torch.Tensor, size: int) -> list[bytearray]:
    """``grad``'s bytes in frames of ``size`` bytes, each a buffer of its own."""
    raw = grad.view(torch.uint8).numpy().tobytes()
    return [bytearray(raw[i : i + size]) for i in range(0, len(raw), size)]


@pytest.mark.parametrize("size", [300 * 1024, 3 * 1024 * 1024 + 2])
def test_frames_cut_at_other_sizes_apply_as_the_whole_gradient(size: int) -> None:
    # 300 KiB: chunks straddle frames (each joined alone); an odd size: frames of
    # partial elements, which the codec joins whole before the store sees them.
    grad = _grads(1)[0]
    header = {"t": [["g/w", "float32", [N], N * 4]]}
    framed = codec.decode_tensors(header, _cut(grad, size), framed=True)["g/w"]
    assert isinstance(framed, codec.Framed) == (size % 4 == 0)
    store = _store(OPTIMIZERS["sgd"])
    store.push(worker="w", version=0, grads={"w": framed})
    var, reference = _reference(OPTIMIZERS["sgd"])
    var.grad = grad
    reference.step()
    assert _same(store.vars["w"], var)


def test_a_framed_tensor_views_the_received_frames_without_a_copy() -> None:
    grad = _grads(1)[0]
    frames = _cut(grad, codec.FRAME_BYTES)
    header = {"t": [["g/w", "float32", [N], N * 4]]}
    framed = codec.decode_tensors(header, frames, framed=True)["g/w"]
    addresses = [torch.frombuffer(f, dtype=torch.uint8).data_ptr() for f in frames]
    assert [p.data_ptr() for p in framed.pieces] == addresses
    assert _same(framed.join(), grad)
    joined = codec.decode_tensors(header, frames)["g/w"]  # unasked, joined as before
    assert isinstance(joined, torch.Tensor) and _same(joined, grad)
