"""Handwritten digits on parameter servers: clusterflow's ParameterServerStrategy.

Every worker runs this same script (between-graph training, as in TensorFlow 1 and
TensorFlow 2's ParameterServerStrategy). The model's variables live on the ps tasks;
each worker pulls them, computes gradients on its own batches and pushes them, and the
ps applies Adam there::

    clusterflow start --ps 1 --workers 2 -- python examples/digits_ps.py
    clusterflow start --ps 2 --workers 3 -- \\
        python examples/digits_ps.py --mode sync --backup-workers 1
    python examples/digits_ps.py                 # no cluster: CentralStorageStrategy, one process

The data is scikit-learn's ``load_digits()`` (1797 8x8 images shipped inside the package).

Every worker ends with the same line, ``final test_accuracy A global_step N
dropped_pushes D``: the accuracy of the ps's final values, once every worker's data ran
out (``wait_for_every_worker``), and the step they reached; only ``dropped_pushes`` is
the worker's own. Asynchronous workers finish at different times and the ps takes the
others' pushes after one finished, so a worker that evaluated when its own data ran out
would report a model still missing the others' last updates (0.84 against the last
worker's 0.94, once), and every worker a different figure.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from clusterflow.strategies.central_storage import CentralStorageStrategy
from clusterflow.strategies.parameter_server import ParameterServerStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--backup-workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    as_x = lambda a: torch.tensor(a / 16.0, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def wait_for_every_worker(strategy: ParameterServerStrategy) -> None:
    """Returns once every replica (chief and workers) called this, after its ``leave()``.

    ``leave()`` returns once this replica's pushes are applied, so when every replica
    has left, the ps holds its final values. The meeting point is the cluster's own
    store, the TCPStore ``clusterflow start`` hosts at ``MASTER_ADDR:MASTER_PORT`` (as
    torchrun does): each replica sets its key and waits for all of them. A replica
    respawned after it set its key (``--max-restarts``) is not waited for again.
    """
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        # As long as the slowest replica may train after the first finished.
        timeout=datetime.timedelta(hours=1),
        wait_for_workers=False,
    )
    store.set(f"examples/digits_ps/left/{strategy.worker_index}", "1")
    store.wait([f"examples/digits_ps/left/{i}" for i in range(strategy.config.num_replicas)])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if "TF_CONFIG" in os.environ:
        strategy: ParameterServerStrategy = ParameterServerStrategy(
            mode=args.mode, backup_workers=args.backup_workers
        )
    else:
        strategy = CentralStorageStrategy()
    x_train, y_train, x_test, y_test = load_data()

    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # applied on the ps
        optimizer.zero_grad()
        return loss.item()

    # A different shuffle per worker and epoch: each replica sees its own batches.
    generator = torch.Generator().manual_seed(args.seed * 1000 + strategy.worker_index)
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_train), generator=generator)
        losses = [
            strategy.run(step, (x_train[idx], y_train[idx])) for idx in order.split(args.batch_size)
        ]
        if strategy.is_chief:
            print(f"epoch {epoch} loss {sum(losses) / len(losses):.4f}", flush=True)

    strategy.leave()  # this replica's data ran out: sync steps stop waiting for it
    if isinstance(strategy, ParameterServerStrategy) and strategy.config.num_replicas > 1:
        print(
            f"data done at global_step {strategy.global_step()}: waiting for the other "
            "workers' last pushes",
            flush=True,
        )
        wait_for_every_worker(strategy)
    strategy.pull_values()  # the ps's final values: every replica's pushes are in
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    # Every worker reports the final model's accuracy and global step (the same figures
    # on every worker), and how many of its own pushes a sync step dropped as late
    # (backup workers at work).
    print(
        f"final test_accuracy {acc:.4f} global_step {strategy.global_step()} "
        f"dropped_pushes {strategy.dropped_pushes}",
        flush=True,
    )
    strategy.close()


if __name__ == "__main__":
    main()
