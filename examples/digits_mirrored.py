"""Handwritten digits with MultiWorkerMirroredStrategy: the DDP job, the tf.distribute way.

The same model, data and optimizer as ``digits_ddp.py``, with no ``init_process_group``,
no ``DistributedSampler`` and no DDP wrapper in sight: the strategy forms the group from
what the launcher injected, mirrors the model created in its ``scope()``, and gives each
replica its slice of every global batch. The same file runs as:

    python examples/digits_mirrored.py                                  # one replica
    clusterflow start --workers 2 -- python examples/digits_mirrored.py  # two replicas

The data is scikit-learn's ``load_digits()`` (1797 8x8 images, shipped inside the
package, so nothing is downloaded).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clusterflow.strategies import MultiWorkerMirroredStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    # Per replica, as in digits_ddp.py: two replicas make a global batch of 128.
    p.add_argument("--batch-size", type=int, default=64)
    # Adam at 5e-3 reaches about 0.97 in 20 epochs on 1 or 2 replicas, as the DDP example.
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    p.add_argument("--save", help="where the chief saves the trained model's state dict")
    return p.parse_args()


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The same split on every replica and every run, stratified so each digit is in both."""
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
    """Under no_grad the mirrored model runs locally: the chief evaluates alone."""
    model.eval()
    x, y = data.tensors
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def main() -> None:
    args = parse_args()
    # One thread per process: two replicas on two cores must not fight over them.
    torch.set_num_threads(1)

    # Reads TF_CONFIG and the torchrun variables; alone, it is a single replica.
    strategy = MultiWorkerMirroredStrategy()
    global_batch_size = args.batch_size * strategy.num_replicas_in_sync

    torch.manual_seed(args.seed)
    train_set, test_set = load_data()
    with strategy.scope():
        # Mirrored when the block ends: rank 0's weights broadcast, wrapped in DDP.
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # gradients averaged over the replicas here
        optimizer.step()
        return torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)))])

    for epoch in range(args.epochs):
        # Every replica shuffles alike (the same generator seed), so they walk the same
        # global batches and each keeps its own slice of every one.
        loader = DataLoader(
            train_set,
            batch_size=global_batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(args.seed + epoch),
        )
        total = torch.zeros(2)
        for x, y in strategy.distribute(loader, global_batch_size):
            total += strategy.run(train_step, (x, y))
        total = strategy.reduce("sum", total)  # loss and count over every replica's rows
        if strategy.is_chief:
            mean_loss = (total[0] / total[1]).item()
            print(
                f"epoch {epoch} loss {mean_loss:.4f} test_accuracy {accuracy(model, test_set):.4f}",
                flush=True,
            )

    if strategy.is_chief:
        print(f"final test_accuracy {accuracy(model, test_set):.4f}", flush=True)
    if args.save:
        strategy.save_model(model, args.save)  # every replica calls it; the chief writes


if __name__ == "__main__":
    main()
