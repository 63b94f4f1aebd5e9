"""clusterflow's own all-reduce algorithms against gloo's, in real process groups.

Each world is separate processes on loopback; every rank sums tensors of several sizes
(smaller than the world, odd, a bucket's size) both ways and writes the largest
difference. Worlds that are not a power of two fold their extra ranks first.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SIZES = (1, 2, 7, 1000, 32 * 1024 + 3)


def rank_main(rank: int, world: int, port: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from clusterflow.collective.halving import HalvingDoublingSum

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    summed = HalvingDoublingSum(timeout_seconds=60)
    diffs = {}
    for n in SIZES:
        g = torch.Generator().manual_seed(1000 * rank + n)
        x = torch.randn(n, generator=g, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        summed(x)
        diffs[n] = float((x - expected).abs().max())
    dist.destroy_process_group()
    (out / f"rank-{rank}.json").write_text(json.dumps(diffs))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 4, 6])
def test_halving_doubling_sums_as_gloo_does(world: int, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(world), str(port), str(tmp_path)], env=env
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world
    for r in range(world):
        diffs = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert set(diffs) == {str(n) for n in SIZES}
        assert max(diffs.values()) < 1e-9, (r, diffs)


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
