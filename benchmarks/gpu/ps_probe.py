"""The ps's bandwidth from device memory: a worker whose one variable lives on the device.

Run by ``benchmarks.gpu`` under ``clusterflow start --ps 1 --workers 1``. The variable
(``--mib`` MiB of float32) is created in a ``ParameterServerStrategy`` scope, moved to
the device, and trained by sync steps of almost no compute: each step pushes its whole
gradient from device memory and pulls the whole value back into it, so the step time is
the GPU path's transfer time (device to host, the wire both ways, host to device), with
the pinned staging (``parameter_server/staging.py``) and then without it. In the same process it
times the copies alone: the tensor to host memory and back, from
pageable and from pinned host memory. Prints one line::

    probe ps_step_s=... ps_step_unstaged_s=... copy_pageable_s=... copy_pinned_s=...
          mib=... device=...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from clusterflow.strategies.parameter_server import ParameterServerStrategy
from clusterflow.strategies.parameter_server.staging import HostStaging


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: object, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    n = args.mib * 2**20 // 4
    strategy = ParameterServerStrategy(mode="sync")
    with strategy.scope():
        model = nn.Linear(n, 1, bias=False)  # one variable of n floats
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    model.to(device)
    x = torch.ones(1, n, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()  # the push; the pull is taken at the next step's start

    def median_step() -> float:
        times = []
        for _ in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            strategy.run(step)
            _sync(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])  # the first steps pay connections, warm-up

    ps_step = median_step()
    # The path before parameter_server/staging.py, for comparison in the same process:
    # nothing staged, so the codec copies each gradient with .cpu() and values are copied
    # from pageable memory. (A benchmark's probe may swap the strategy's private staging;
    # code may not.)
    strategy._staging = HostStaging(stage=lambda t: False)
    unstaged_step = median_step()

    value = model.weight.detach()
    pageable = torch.empty(value.shape, dtype=value.dtype)
    pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=device.type == "cuda")

    def copy(host: torch.Tensor) -> None:
        host.copy_(value)
        value.copy_(host)

    copy_pageable = _median_time(lambda: copy(pageable), 5, device)
    copy_pinned = _median_time(lambda: copy(pinned), 5, device)
    strategy.close()
    print(
        f"probe ps_step_s={ps_step:.5f} ps_step_unstaged_s={unstaged_step:.5f} "
        f"copy_pageable_s={copy_pageable:.5f} "
        f"copy_pinned_s={copy_pinned:.5f} mib={args.mib} device={device}",
        flush=True,
    )


if __name__ == "__main__":
    main()
