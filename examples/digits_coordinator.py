"""Handwritten digits trained through a ClusterCoordinator (TensorFlow 2's coordinator form).

Every task runs this file. Worker tasks only serve: they run what the chief schedules.
The chief creates the model and the optimizer inside the strategy's scope, so their
variables live on the ps tasks, and schedules one training step per batch. Each step
runs on whichever worker is free: it pulls the current values, computes the gradients
and pushes them to the ps, which applies them on arrival (asynchronous updates, as in
TensorFlow's ParameterServerStrategy). A worker that dies mid-run costs nothing but
time: its step runs again on another worker.

    clusterflow start --chief --ps 1 --workers 2 -- python examples/digits_coordinator.py

The data is scikit-learn's ``load_digits()`` (1797 8x8 images, shipped inside the
package, so nothing is downloaded), split as in ``digits_ddp.py``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from clusterflow.strategies import TFConfigClusterResolver
from clusterflow.strategies.coordinator import ClusterCoordinator, serve_worker
from clusterflow.strategies.parameter_server import ParameterServerStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    # Per step; the coordinator runs about one step per worker at a time.
    p.add_argument("--batch-size", type=int, default=64)
    # Adam at 5e-3, as digits_ddp.py: above 0.95 within a few epochs, asynchronous or not.
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    return p.parse_args()


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The same stratified split as digits_ddp.py, so the accuracies compare."""
    # Imported here: only the chief holds data; workers need not pay scikit-learn's import.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
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
    model.eval()
    x, y = data.tensors
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def main() -> None:
    args = parse_args()
    # One thread per process: the chief, the ps and two workers share two cores here.
    torch.set_num_threads(1)

    resolver = TFConfigClusterResolver()
    if resolver.task_type == "worker":
        serve_worker()  # until the chief's coordinator closes
        return
    if resolver.task_type != "chief":
        sys.exit("run this on a cluster with a chief: clusterflow start --chief --ps 1 ...")

    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    strategy = ParameterServerStrategy(resolver)  # asynchronous, as TensorFlow's
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    initial = [p.detach().clone() for p in model.parameters()]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        # Runs on a worker, with the values just pulled from the ps in `model`.
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()  # pushes the gradients; Adam is applied on the ps
        return loss.item()

    x_train, y_train = train_set.tensors
    shuffle = torch.Generator().manual_seed(args.seed)
    with ClusterCoordinator(strategy) as coordinator:
        for epoch in range(args.epochs):
            order = torch.randperm(len(y_train), generator=shuffle)
            batches = [(x_train[i], y_train[i]) for i in order.split(args.batch_size)]
            losses = [coordinator.schedule(train_step, args=batch) for batch in batches]
            coordinator.join()
            total = sum(loss.fetch() * len(y) for loss, (_, y) in zip(losses, batches, strict=True))
            # The chief's copy of the model is only refreshed on request.
            coordinator.pull_variables()
            print(
                f"epoch {epoch} loss {total / len(y_train):.4f} "
                f"test_accuracy {accuracy(model, test_set):.4f}",
                flush=True,
            )
        stats = coordinator.stats()
    strategy.close()
    moved = max(
        (p.detach() - p0).abs().max().item()
        for p, p0 in zip(model.parameters(), initial, strict=True)
    )
    print(
        f"final test_accuracy {accuracy(model, test_set):.4f} parameters_moved {moved:.4f} "
        f"steps {stats.completed} retried {stats.retried}",
        flush=True,
    )


if __name__ == "__main__":
    main()
