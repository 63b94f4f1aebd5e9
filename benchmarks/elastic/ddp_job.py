"""The peer's job: an unmodified DDP script under torchrun's elastic mode,
``python ddp_job.py OUT``.

torchrun cannot re-form a running group: when agents join, every agent stops its
workers and starts them again at the new world size, so the script does what such a
script does to survive that: rank 0 saves the model and optimizer every
``CHECKPOINT_EVERY`` steps (``torch.save`` to a temporary file, then a rename), and
every rank loads the latest one at its start. The model and the global batch are those
of ``job.py``'s ``allreduce`` mode (``model``, ``batch``); each rank trains
``GLOBAL_BATCH / WORLD_SIZE`` rows of it. Each step appends ``rank:R STEP WORLD
WALL_TIME`` to ``OUT/steps.log``, after the optimizer's step; each start marks
``OUT/marks.log`` as ``job.py`` does (created, imported, joined: the process group
formed).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared import GLOBAL_BATCH, STEPS, batch, log_step, mark, model

CHECKPOINT_EVERY = 20


def main() -> None:
    import psutil

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mark(out, f"rank:{rank}", "created", psutil.Process().create_time())
    mark(out, f"rank:{rank}", "imported")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    mark(out, f"rank:{rank}", "joined")
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    step = 0
    path = out / "ddp.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    ddp = DistributedDataParallel(net)
    rows = GLOBAL_BATCH // world
    while step < STEPS:
        first = step * GLOBAL_BATCH + rank * rows
        x, y = batch(list(range(first, first + rows)))
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        log_step(out, f"rank:{rank}", step, world)
        if rank == 0 and step % CHECKPOINT_EVERY == 0:
            tmp = out / "ddp.pt.tmp"
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}
            torch.save(state, tmp)
            tmp.replace(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
