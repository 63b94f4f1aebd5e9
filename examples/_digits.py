"""The digits data every example trains on: scikit-learn's ``load_digits()``.

1797 8x8 images shipped inside scikit-learn, so nothing is downloaded. One stratified
split with its own seed (apart from the training seed), so every example, replica and
run sees the same train and test sets and their accuracies compare.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset


def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` datasets of (pixels scaled to 0..1, label)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )

    def as_dataset(x: object, y: object) -> TensorDataset:
        # Pixels are 0..16; scaled to 0..1 so the inputs match the weights' initial scale.
        return TensorDataset(
            torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long)
        )

    return as_dataset(x_train, y_train), as_dataset(x_test, y_test)


def make_model() -> torch.nn.Module:
    """The classifier of every digits example: 64 -> 128 -> 10."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def write_parquet(folder: Path, train: TensorDataset) -> Path:
    """The training set as one Parquet file (every task writes the same bytes)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = train.tensors
    table = pa.table(
        {
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(x.numpy().ravel()), 64),
            "label": pa.array(y.numpy()),
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "digits-train.parquet"
    # Every task writes it; the rename makes each write atomic.
    partial = folder / f".digits-train.{os.getpid()}.parquet"
    pq.write_table(table, partial, row_group_size=128)
    os.replace(partial, path)
    return path


def pixels_and_labels(columns: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A data-service batch's columns as the ``(inputs, targets)`` pair ``fit`` takes."""
    from clusterflow.data import torch_collate

    batch = torch_collate(columns)
    return batch["pixels"], batch["label"]
