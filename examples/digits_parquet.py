"""Handwritten digits read from Parquet through clusterflow's data service.

The training set is written to one Parquet file; every worker pulls leases of records
from the dispatcher, reads them itself, and acks each lease once the step that used it
is done. The same file runs as:

    python examples/digits_parquet.py                        # one process: the dispatcher
                                                             # runs in-process
    clusterflow start --workers 2 -- python examples/digits_parquet.py

Under ``clusterflow start`` the dispatcher is the manager's; workers share a Parquet file
in the cluster's state folder. With one file and two workers, each still gets half of
the records per epoch, in a different order each epoch; DDP's ``join()`` absorbs the
last uneven step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

# Before init_process_group: imported later (DDP does, through torch._dynamo), it would
# bind the group as default arguments and keep it alive into the interpreter's exit.
import torch.distributed.nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from clusterflow.data import distributed_dataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and record order")
    return p.parse_args()


def write_digits(folder: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The training split as Parquet (the same bytes from every worker), and the test set."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    table = pa.table(
        {
            "pixels": pa.FixedSizeListArray.from_arrays(
                pa.array((x_train / 16.0).astype(np.float32).ravel()), 64
            ),
            "label": pa.array(y_train.astype(np.int64)),
        }
    )
    path = folder / "digits-train.parquet"
    # Every worker writes the same file; the rename makes each write atomic.
    tmp = folder / f".digits-train.{os.getpid()}.parquet"
    pq.write_table(table, tmp, row_group_size=128)
    os.replace(tmp, path)
    test = torch.tensor(x_test / 16.0, dtype=torch.float32), torch.tensor(y_test)
    return path, *test


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    folder = Path(os.environ.get("CLUSTERFLOW_STATE_DIR") or tempfile.mkdtemp())
    path, x_test, y_test = write_digits(folder)
    data = distributed_dataset(
        path, batch_size=args.batch_size, split_size=128, seed=args.seed, epochs=args.epochs
    )

    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model: nn.Module = DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    epoch, total, count = 0, 0.0, 0
    with data, model.join() if isinstance(model, DistributedDataParallel) else nullcontext():
        for batch in data:  # the previous batch's leases are acked when this one is asked for
            if batch.epoch != epoch:
                report(rank, epoch, total / max(count, 1), net, x_test, y_test)
                epoch, total, count = batch.epoch, 0.0, 0
            x, y = batch.data["pixels"], batch.data["label"]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            count += len(y)
    report(rank, epoch, total / max(count, 1), net, x_test, y_test)
    if rank == 0:
        print(f"final test_accuracy {accuracy(net, x_test, y_test):.4f}", flush=True)
    if distributed:
        # As digits_ddp.py's leave_process_group says: the DDP wrapper first, then the
        # group's last reference, so its gloo threads are joined before Python exits
        # (else one may abort the process at exit, SIGABRT after a finished run).
        del model
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (net(x).argmax(dim=1) == y).float().mean().item()


def report(
    rank: int, epoch: int, loss: float, net: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> None:
    """Rank 0's own mean loss (no all-reduce: ranks may run different step counts)."""
    if rank == 0:
        print(f"epoch {epoch} loss {loss:.4f} test_accuracy {accuracy(net, x, y):.4f}", flush=True)


if __name__ == "__main__":
    main()
