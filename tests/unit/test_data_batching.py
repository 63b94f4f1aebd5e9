"""Cutting splits into batches, the leases each batch completes, and finding the dispatcher."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clusterflow.data import (
    CollateError,
    DataConfig,
    default_worker_name,
    distributed_dataset,
    resolve_dispatcher,
)
from clusterflow.data.api import Lease
from clusterflow.data.batching import Batcher, ReadSplit
from clusterflow.data.collate import numpy_collate, torch_batches, torch_collate
from clusterflow.errors import ConfigError


def split(lease_id: int, start: int, stop: int, epoch: int = 0) -> ReadSplit:
    return ReadSplit(Lease(lease_id, epoch, start, stop), {"id": np.arange(start, stop)}, None)


def test_batches_carry_over_splits_and_name_the_leases_they_complete() -> None:
    batcher = Batcher(4, numpy_collate, "d")
    first, second = split(1, 0, 6), split(2, 10, 16)
    a = batcher.cut(first)
    assert a is not None and a.data["id"].tolist() == [0, 1, 2, 3]
    assert (a.leases, a.completes) == ((1,), ())
    assert batcher.cut(first) is None and batcher.holding  # 4, 5 carried over
    b = batcher.cut(second)
    assert b is not None and b.data["id"].tolist() == [4, 5, 10, 11]
    assert (b.leases, b.completes, b.index) == ((1, 2), (1,), 1)
    c = batcher.cut(second)
    assert c is not None and c.completes == (2,) and len(c) == 4


def test_flush_hands_out_a_smaller_batch_and_epochs_never_mix() -> None:
    batcher = Batcher(4, numpy_collate, "d")
    assert batcher.cut(split(1, 0, 3)) is None
    later = split(2, 3, 6, epoch=1)
    assert batcher.starts_new_epoch(later)
    held = batcher.flush()
    assert held is not None and len(held) == 3 and held.completes == (1,)
    assert batcher.flush() is None


def test_default_collate_cuts_a_split_at_once_into_the_same_tensors() -> None:
    """torch_collate's batches of a split are made in one go (torch_batches): each equals
    torch_collate of its records, over the split's own memory, after a carried
    remainder, and after the batch size changes in the middle of a split."""
    batcher = Batcher(4, torch_collate, "d")
    assert batcher.cut(split(1, 0, 2)) is None  # 0, 1 carried: the next split's cuts shift
    two_d = np.arange(40, 80, dtype=np.float32).reshape(20, 2)
    second = ReadSplit(Lease(2, 0, 10, 30), {"id": np.arange(10, 30), "xy": two_d}, None)
    got = []
    while (batch := batcher.cut(second)) is not None:
        got.append(batch)
        if len(got) == 2:
            batcher.batch_size = 3
    rest = batcher.flush()
    assert rest is not None
    got.append(rest)
    ids = [b.data["id"].tolist() for b in got]
    assert ids == [[0, 1, 10, 11], [12, 13, 14, 15], [16, 17, 18], [19, 20, 21], [22, 23, 24],
                   [25, 26, 27], [28, 29]]  # fmt: skip
    for b in got[1:]:
        lo = b.data["id"][0].item() - 10
        expected = torch_collate({k: v[lo : lo + len(b)] for k, v in second.columns.items()})
        for name, tensor in b.data.items():
            assert tensor.equal(expected[name]) and tensor.data_ptr() == expected[name].data_ptr()
    assert got[3].completes == () and got[-1].completes == (2,)
    assert second.views and second.views_size == 3  # made at once, anew for the new size


def test_default_collate_cuts_other_columns_batch_by_batch() -> None:
    names = np.empty(6, dtype=object)
    names[:] = [f"r{i}" for i in range(6)]
    batcher = Batcher(4, torch_collate, "d")
    batch = batcher.cut(ReadSplit(Lease(1, 0, 0, 6), {"id": np.arange(6), "name": names}, None))
    assert batch is not None and batch.data["name"] == ["r0", "r1", "r2", "r3"]
    assert batch.data["id"].tolist() == [0, 1, 2, 3]


def test_a_strided_column_is_cut_at_once_into_the_same_tensors() -> None:
    """Batches made at once from a strided column, a contiguous one and a 2-D one each
    equal torch_collate of the batch's records, over the split's own memory."""
    pairs = np.arange(40, dtype=np.int64).reshape(20, 2)
    columns = {"strided": pairs[:, 1], "flat": pairs[:, 0].copy(), "xy": pairs}
    assert not columns["strided"].flags.c_contiguous
    batches = torch_batches(columns, 2, 4)
    assert len(batches) == 4  # records 2..17; 18 and 19 are left for a smaller batch
    for i, batch in enumerate(batches):
        lo = 2 + 4 * i
        expected = torch_collate({k: v[lo : lo + 4] for k, v in columns.items()})
        for name, tensor in batch.items():
            assert tensor.equal(expected[name]), name
            assert tensor.data_ptr() == expected[name].data_ptr(), name
    assert torch_batches(columns, 17, 4) == []  # not one full batch left


def test_a_split_that_cannot_be_cut_at_once_is_collated_batch_by_batch() -> None:
    """Columns torch_batches cannot take (strings) leave the split's batches to
    torch_collate one by one, every batch of the split, not only the first."""
    names = np.empty(10, dtype=object)
    names[:] = [f"r{i}" for i in range(10)]
    batcher = Batcher(4, torch_collate, "d")
    whole = ReadSplit(Lease(1, 0, 0, 10), {"id": np.arange(10), "name": names}, None)
    got = [batcher.cut(whole), batcher.cut(whole), batcher.cut(whole), batcher.flush()]
    assert [b.data["name"] if b else None for b in got] == [
        ["r0", "r1", "r2", "r3"],
        ["r4", "r5", "r6", "r7"],
        None,  # 8, 9 held back
        ["r8", "r9"],
    ]
    assert [b.completes for b in got if b] == [(), (), (1,)]


def test_collate_error_names_the_source_record_through_a_shuffle() -> None:
    values = np.empty(8, dtype=object)
    values[:] = [1, 2, 3, 4, 5, None, 7, 8]
    order = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    shuffled = ReadSplit(Lease(9, 2, 100, 108), {"v": values[order]}, order)
    batcher = Batcher(4, numpy_collate, "d")
    with pytest.raises(  # the first batch holds records 107, 106, 105, 104
        CollateError, match=r"record 105 of split \[100, 108\) of epoch 2 \(lease 9\).*null"
    ):
        batcher.cut(shuffled)


def test_config_validates_itself() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        DataConfig(batch_size=0)
    for bad in (0, 257, True):
        with pytest.raises(ConfigError, match=f"leases_ahead must be .*got {bad!r}$"):
            DataConfig(leases_ahead=bad)
    with pytest.raises(ConfigError, match="leases_ahead must be an integer >= 1, got 0"):
        distributed_dataset({"x": np.arange(4)}, batch_size=2, leases_ahead=0)
    assert DataConfig(auto_ack=True).waits_for_all_acks is False
    assert DataConfig(auto_ack=False).waits_for_all_acks is True
    assert DataConfig(auto_ack=True, wait_for_all_acks=True).waits_for_all_acks is True


def test_dispatcher_and_worker_name_from_the_environment() -> None:
    tf_config = json.dumps(
        {
            "cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    assert resolve_dispatcher({"TF_CONFIG": tf_config}) == "10.0.0.1:2222"
    assert resolve_dispatcher({"CLUSTERFLOW_MANAGER": "127.0.0.1:5", "TF_CONFIG": tf_config}) == (
        "127.0.0.1:5"
    )
    env = {"CLUSTERFLOW_DISPATCHER": "h:1", "CLUSTERFLOW_MANAGER": "127.0.0.1:5"}
    assert resolve_dispatcher(env) == "h:1"
    assert resolve_dispatcher({}) is None
    assert default_worker_name({"TF_CONFIG": tf_config}) == "worker:0"
    assert default_worker_name({"CLUSTERFLOW_TASK": "worker:3"}) == "worker:3"
    assert default_worker_name({}).endswith(f":{__import__('os').getpid()}")
