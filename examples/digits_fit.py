"""Handwritten digits with ``clusterflow.fit``: Keras's ``model.fit`` under any strategy.

The model and its optimizer are created inside the strategy's scope, then one ``fit``
call trains them; the same file runs alone and on every task of a cluster:

    python examples/digits_fit.py                                   # one process
    python examples/digits_fit.py --strategy central                # CentralStorageStrategy
    clusterflow start --workers 2 -- python examples/digits_fit.py --strategy mirrored
    clusterflow start --chief --ps 1 --workers 2 -- \\
        python examples/digits_fit.py --strategy ps-sync
    clusterflow start --ps 1 --workers 2 -- python examples/digits_fit.py --strategy ps-async

``--data-service`` feeds the training set from a Parquet file through the data service
(the manager's dispatcher in a cluster, an in-process one alone): each replica reads the
splits the dispatcher lends it. Every epoch is checkpointed: under ``clusterflow start``
into the cluster's checkpoint folder (``CLUSTERFLOW_CHECKPOINT_DIR``, which
``--max-restarts`` and ``start --resume`` recover from), alone only with
``--checkpoint-dir`` (run it again: it continues where it stopped; a finished run prints
its final figures again). With ``clusterflow start --evaluator`` the evaluator task
evaluates each checkpoint while the others train. ``--log-dir`` writes TensorBoard
summaries (chief only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from _digits import load_digits_split, make_model, pixels_and_labels, write_parquet
from clusterflow.data import DataClient, distributed_dataset
from clusterflow.strategies import Strategy
from clusterflow.train import (
    Checkpoint,
    Evaluate,
    Hook,
    Progress,
    Summary,
    accuracy,
    fit,
    is_evaluator,
)

STRATEGIES = ("none", "mirrored", "ps-async", "ps-sync", "central")
FIGURES = (("loss", "loss"), ("test_accuracy", "val_accuracy"))
"""The final line's figures: the name printed, and fit's History key."""
ENV_CHECKPOINT_DIR = "CLUSTERFLOW_CHECKPOINT_DIR"
"""Set by ``clusterflow start`` on every task: the cluster's checkpoint folder."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="none")
    p.add_argument("--epochs", type=int, default=10)
    # Per replica: the global batch is this times the replicas in sync, so adding
    # workers keeps each replica's share (and the step count per epoch falls).
    p.add_argument("--batch-size", type=int, default=64)
    # Adam at 5e-3 reaches about 0.97 on the test set within 10 epochs.
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    p.add_argument("--log-dir", help="TensorBoard summaries (written by the chief)")
    p.add_argument(
        "--checkpoint-dir",
        help="save every epoch; resume from the newest [default: $CLUSTERFLOW_CHECKPOINT_DIR, "
        "the cluster's folder under clusterflow start; alone: none]",
    )
    p.add_argument("--data-service", action="store_true", help="read Parquet via leases")
    return p.parse_args()


def make_strategy(name: str) -> Strategy | None:
    """The strategy named on the command line; imported lazily (ps pulls in more)."""
    if name == "none" or is_evaluator():  # the evaluator trains nothing: no replica
        return None
    if name == "mirrored":
        from clusterflow.strategies import MultiWorkerMirroredStrategy

        return MultiWorkerMirroredStrategy()
    from clusterflow.strategies.central_storage import CentralStorageStrategy
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    if name == "central":
        return CentralStorageStrategy()
    return ParameterServerStrategy(mode="sync" if name == "ps-sync" else "async")


def main() -> None:
    args = parse_args()
    # One thread per process: replicas on a small machine must not fight over cores.
    torch.set_num_threads(1)
    strategy = make_strategy(args.strategy)
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    train, test = load_digits_split()

    torch.manual_seed(args.seed)  # the same initial weights on every replica
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    steps_per_epoch = -(-len(train) // (args.batch_size * replicas))
    hooks: list[Hook] = [Progress(every_steps=steps_per_epoch)]
    if args.log_dir:
        hooks.append(Summary(args.log_dir, every_steps=5))
    # In a cluster the manager names a checkpoint folder: saving there by default is what
    # lets --max-restarts and `start --resume` recover a run instead of starting it over.
    checkpoints = args.checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR)
    if checkpoints:
        hooks.append(Checkpoint(checkpoints, every_steps=steps_per_epoch))
        hooks.append(Evaluate(lambda m: test_accuracy(m, test), directory=checkpoints))

    with contextlib.ExitStack() as stack:
        data: Any = train
        if args.data_service and not is_evaluator():
            data = stack.enter_context(open_data_service(train, args))
        history = fit(
            model,
            nn.CrossEntropyLoss(),
            optimizer,
            data,
            strategy=strategy,
            epochs=args.epochs,
            # A data-service client's batches are each replica's own already.
            global_batch_size=None if data is not train else args.batch_size * replicas,
            validation_data=test,
            metrics=["accuracy"],
            hooks=hooks,
            seed=args.seed,
        )
    if is_evaluator():
        for step, value in zip(history.epoch, history.history.get("accuracy", []), strict=True):
            print(f"evaluated step {step} test_accuracy {value:.4f}", flush=True)
    elif strategy is None or strategy.is_chief:
        last = history.last()
        # A figure fit could not compute (a resumed run of the data service that had
        # nothing left to read has no training loss) is left out, never printed as nan.
        shown = [f"{name} {last[key]:.4f}" for name, key in FIGURES if key in last]
        print(f"final {' '.join(shown)} step {history.step}", flush=True)


def open_data_service(train: TensorDataset, args: argparse.Namespace) -> DataClient:
    """This replica's share of the training set, leased from the data service."""
    # The cluster's state folder is shared by its tasks; alone, any folder will do.
    folder = Path(os.environ.get("CLUSTERFLOW_STATE_DIR") or tempfile.mkdtemp())
    return distributed_dataset(
        write_parquet(folder, train),
        batch_size=args.batch_size,  # per replica: each reads its own leases
        split_size=128,
        seed=args.seed,
        epochs=args.epochs,
        collate_fn=pixels_and_labels,
    )


@torch.no_grad()
def test_accuracy(model: nn.Module, test: TensorDataset) -> Mapping[str, float]:
    x, y = test.tensors
    return {"accuracy": float(accuracy(model(x), y))}


if __name__ == "__main__":
    main()
