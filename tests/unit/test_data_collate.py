"""Collation to tensors and NumPy, and naming the record that cannot be collated."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from clusterflow.data.collate import find_bad_record, numpy_collate, torch_collate


def test_torch_collate_columns() -> None:
    import torch

    x = np.arange(6, dtype=np.float32)
    x.flags.writeable = False
    out = torch_collate(
        {
            "x": x,
            "v": np.array([np.array([1, 2]), np.array([3, 4])], dtype=object),
            "s": np.array(["a", "b"], dtype=object),
        }
    )
    assert out["x"].dtype == torch.float32 and out["x"].tolist() == x.tolist()
    assert out["v"].tolist() == [[1, 2], [3, 4]]
    assert out["s"] == ["a", "b"]


def test_numpy_collate_keeps_numpy() -> None:
    out = numpy_collate({"x": np.arange(3), "v": [[1.0], [2.0], [3.0]]})
    assert isinstance(out["x"], np.ndarray) and out["v"].shape == (3, 1)


def objects(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


@pytest.mark.parametrize(
    ("values", "bad", "reason"),
    [
        ([1, 2, None, 4], 2, "null"),
        ([[1, 2], [3, 4], [5, 6, 7], [8, 9]], 2, "differ in shape"),
        ([1.0, 2.0, "three", 4.0], 2, "not numbers"),
    ],
)
def test_bad_record_is_found(values: list[Any], bad: int, reason: str) -> None:
    columns = {"ok": np.arange(4), "v": objects(values)}
    with pytest.raises(ValueError, match=reason):
        numpy_collate(columns)
    found = find_bad_record(numpy_collate, columns)
    assert found is not None and found[0] == bad and reason in found[1]


def test_user_collate_failure_is_located() -> None:
    def picky(columns: Any) -> Any:
        if 13 in columns["id"]:
            raise KeyError("unlucky")
        return columns

    found = find_bad_record(picky, {"id": np.arange(10, 20)})
    assert found == (3, "KeyError: 'unlucky'")


def test_importing_the_data_package_does_not_import_torch() -> None:
    code = "import sys, clusterflow.data; print('torch' in sys.modules, 'pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
