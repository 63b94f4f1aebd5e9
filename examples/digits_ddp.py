"""Handwritten digits with PyTorch DDP: the job that clusterflow's README runs.

A plain DistributedDataParallel script with nothing clusterflow-specific in it. It reads
the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) through
``init_process_group``, so the same file runs as:

    python examples/digits_ddp.py                          # one process
    torchrun --nproc-per-node 2 examples/digits_ddp.py     # two ranks
    clusterflow start --workers 2 -- python examples/digits_ddp.py

The data is scikit-learn's ``load_digits()`` (1797 8x8 images, shipped inside the
package, so nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

# Imported before init_process_group, on purpose: this module binds ``group.WORLD`` as
# default arguments when first imported (DistributedDataParallel imports it through
# torch._dynamo), and imported after the group is formed it would hold that group for
# good, its threads alive into the interpreter's exit (see leave_process_group).
import torch.distributed.nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    # Per worker, as with torchrun: two workers make a global batch of 128.
    p.add_argument("--batch-size", type=int, default=64)
    # Adam at 5e-3 reaches 0.97 +- 0.005 in 20 epochs on 1 or 2 workers (seeds 0-4).
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    return p.parse_args()


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The same split on every rank and every run, stratified so each digit is in both parts."""
    x, y = load_digits(return_X_y=True)
    # A split seed apart from --seed, so accuracies of runs with different seeds compare.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    return _as_dataset(x_train, y_train), _as_dataset(x_test, y_test)


def _as_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    # Pixels are 0..16; scaled to 0..1 so the inputs match the weights' initial scale.
    return TensorDataset(
        torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    )


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """Every rank holds the whole (small) test set, so no gather is needed."""
    model.eval()
    x, y = data.tensors
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def main() -> None:
    args = parse_args()
    # One thread per process: two workers on two cores must not fight over them.
    torch.set_num_threads(1)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")  # env:// rendezvous from MASTER_ADDR/MASTER_PORT
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1

    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model: nn.Module = DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        total, count = torch.zeros(2), 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total[0] += loss.detach() * len(y)
            count += len(y)
        total[1] = count
        if distributed:
            dist.all_reduce(total)  # mean loss over every rank's samples
        if rank == 0:
            mean_loss = (total[0] / total[1]).item()
            print(
                f"epoch {epoch} loss {mean_loss:.4f} test_accuracy {accuracy(net, test_set):.4f}",
                flush=True,
            )

    if rank == 0:
        print(f"final test_accuracy {accuracy(net, test_set):.4f}", flush=True)
    if distributed:
        del model  # first: DDP's reducer would free the group from C++, holding the GIL
        leave_process_group()


def leave_process_group() -> None:
    """Destroys the process group and frees it now, while the interpreter is whole.

    Why (torch 2.13, gloo): a gloo worker thread drops its reference to a finished
    collective's tensors after the caller went on, and that drop takes the GIL (the
    tensor's Python object). A group still alive when the interpreter exits keeps such
    threads; one that wakes while Python finalizes is ended by CPython with
    ``pthread_exit``, whose unwinding through torch's ``noexcept`` destructor aborts the
    process ("terminate called without an active exception", SIGABRT, exit 134) after
    training finished. A group freed from its last *Python* reference is destroyed with
    the GIL released (torch's holder for groups), so its threads finish and are joined.
    Hence the order: the caller drops its DDP wrapper first (its reducer would free the
    group from C++ with the GIL held, and hang), and this frame holds the last reference
    (``torch.distributed.nn`` was imported before the group formed, so its default
    arguments hold none).
    """
    group = dist.group.WORLD
    dist.destroy_process_group()
    del group  # the last reference: the group's threads are joined here


if __name__ == "__main__":
    main()
