"""The job of test_elastic_restart.py: a plain DDP script with nothing of clusterflow in
it, as torchrun runs one. ``python elastic_ddp_job.py OUT STEPS``.

It reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) through
``init_process_group``; without them it is one process, the same code. It keeps its own
checkpoint, ``OUT/ckpt.pt`` (model, optimizer, step), written by rank 0 after every
step and read at start, as a torchrun elastic script must: a resize restarts it.

Each start appends one line to ``OUT/starts.log`` (what the launcher told this rank,
and the step it resumes at). Step ``s`` trains on the global batch of rows
``s*12 .. s*12+11`` (mod 48) of fixed data, each rank on rows ``rank::world`` of it: with
DDP's average of the ranks' gradients, a step is the one-process step over the same
global batch at any world size that divides 12. Rank 0 writes the final parameters to
``OUT/final.json``.

The test paces it with ``OUT/allow`` (a step number): while the file exists, no rank
starts a step at or past that number (polling it), so a resize lands on a step
boundary the test chose, with that step's checkpoint written (``OUT/progress``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Before init_process_group: imported later it would hold the group for good
# (examples/digits_ddp.py, leave_process_group).
import torch.distributed.nn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_job import hold_at

ROWS, GLOBAL_BATCH = 48, 12


def write_atomically(path: Path, save: object) -> None:
    temporary = path.with_suffix(".tmp")
    if isinstance(save, str):
        temporary.write_text(save)
    else:
        torch.save(save, temporary)
    os.replace(temporary, path)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1

    data = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 4, generator=data)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(ROWS, 1, generator=data)
    torch.manual_seed(1)
    net = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    step = 0
    checkpoint = out / "ckpt.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    model: nn.Module = DistributedDataParallel(net) if distributed else net
    # What the launcher told this rank (CLUSTERFLOW_TASK only for the test's record).
    told = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"]
    told += ["TORCHELASTIC_RESTART_COUNT", "CLUSTERFLOW_TASK"]
    seen = {k: os.environ.get(k) for k in told}
    with open(out / "starts.log", "a") as log:
        log.write(json.dumps({**seen, "rank": rank, "world": world, "resumes": step}) + "\n")

    while step < steps:
        hold_at(out, step)
        rows = [(step * GLOBAL_BATCH + i) % ROWS for i in range(GLOBAL_BATCH)][rank::world]
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict()}
            write_atomically(checkpoint, {**state, "step": step})
            write_atomically(out / "progress", str(step))

    if rank == 0:
        final = {"step": step, "weight": net.weight.tolist(), "bias": net.bias.tolist()}
        write_atomically(out / "final.json", json.dumps(final))
    if distributed:
        del model  # first: DDP's reducer would free the group from C++, holding the GIL
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group  # the last reference: the group's threads are joined here


if __name__ == "__main__":
    main()
