"""The work in series with a 64 MiB push's transfer, joined against streamed, no network.

A 64 MiB gradient is encoded once into its frames, each copied into a buffer of its
own as ZeroMQ receives them. Then, alternating per round, both ways of consuming it:

* joined (as before issue 28): the ps joins the frames into one buffer, checks it and
  steps torch's SGD over the whole variable; the worker joins a reply's frames and
  copies the result into its parameter.
* streamed: the ps checks each frame and steps the variable's chunks from the frames
  (``ps/chunks.py``); the worker writes each frame into its parameter
  (``codec.Framed.copy_into``).

No sockets, so the load of a busy machine moves these less than a round trip: the
minimum over rounds is the work itself. ``benchmarks._ps_phases`` splits a real round
trip instead.

    python -m benchmarks._ps_serial [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from clusterflow.ps import chunks
from clusterflow.ps.api import PSConfig
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.store import VariableStore
from clusterflow.rpc import codec

N = 16 * 1024 * 1024
"""64 MiB of float32."""


@contextlib.contextmanager
def _whole_variables() -> Iterator[None]:
    """The store as before chunks: one optimizer parameter per variable."""
    cut = chunks.bounds
    chunks.bounds = lambda var: [(0, var.numel())]
    try:
        yield
    finally:
        chunks.bounds = cut


def _store(joined: bool) -> VariableStore:
    store = VariableStore(0)
    decl = [{"name": "w", "shape": [N], "dtype": "float32"}]
    store.create(PSConfig(mode="async", num_replicas=1), decl, {"w": torch.zeros(N)})
    spec = OptimizerSpec.from_dict({"name": "SGD", "groups": [{"lr": 0.01}]})
    with _whole_variables() if joined else contextlib.nullcontext():
        store.set_optimizer(spec, {"w": 0})
    return store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    frames = codec.encode(codec.KIND_REQUEST, 1, "ps.push", None, {"g/w": torch.full((N,), 1e-3)})
    header = codec.decode_header(frames[0])
    received = [bytearray(f) for f in frames[1:]]
    stores = {"joined": _store(True), "streamed": _store(False)}
    param = torch.zeros(N)
    spent: dict[str, dict[str, list[float]]] = {k: {"ps": [], "worker": []} for k in stores}

    def once(kind: str) -> None:
        joined = kind == "joined"
        store = stores[kind]
        start = time.perf_counter()
        with _whole_variables() if joined else contextlib.nullcontext():
            grad = codec.decode_tensors(header, received, framed=not joined)["g/w"]
            store.push(worker="w", version=store.version, grads={"w": grad})
        spent[kind]["ps"].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        values = codec.decode_tensors(header, received, framed=not joined)["g/w"]
        if isinstance(values, codec.Framed):
            values.copy_into(param)
        else:
            param.copy_(values)
        spent[kind]["worker"].append((time.perf_counter() - start) * 1e3)

    for r in range(args.rounds):
        for kind in ("joined", "streamed") if r % 2 else ("streamed", "joined"):
            once(kind)
    print(f"64 MiB, ms over {args.rounds} alternating rounds: min (median)")
    print(f"{'':9} {'ps: decode, check, SGD':>24} {'worker: decode, into param':>28}")
    for kind, times in spent.items():
        cells = [f"{min(t):.1f} ({statistics.median(t):.1f})" for t in times.values()]
        print(f"{kind:9} {cells[0]:>24} {cells[1]:>28}")


if __name__ == "__main__":
    main()
