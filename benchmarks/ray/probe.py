"""The job ``benchmarks.ray`` starts: a 2-worker DDP step, then ``ready rank=<RANK>``.

Imports torch, joins the process group (the rendezvous every DDP script makes), wraps a
small model in DDP and takes one step (an all-reduce across the workers), then prints
its line and exits. Run by clusterflow (local or Ray backend) and by Ray Train alike.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    torch.set_num_threads(1)
    owned = not dist.is_initialized()  # Ray Train's TorchTrainer has joined it already
    if owned:
        dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(32, 64)).square().mean()
    loss.backward()
    optimizer.step()
    print(f"ready rank={os.environ.get('RANK', dist.get_rank())}", flush=True)
    if owned:
        # The DDP wrapper first: its reducer would free the group from C++ with the GIL
        # held when main returns, which can hang on a gloo thread (examples/digits_ddp.py).
        del model, optimizer, loss
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group


if __name__ == "__main__":
    main()
