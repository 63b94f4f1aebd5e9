"""The dashboard's data-service row: each count means what its label says.

Driven by a real ``LeaseBook`` (``data/leases.py``) in the state the dashboard once
showed as ``leased 11`` of 12 splits with 10 acknowledged: the next epoch had opened and
lent 9 splits while 2 of this epoch's were still out.
"""

from __future__ import annotations

from clusterflow.data.api import DatasetSpec
from clusterflow.data.leases import LeaseBook
from clusterflow.ui.data_progress import _num_splits, _row


def _book() -> LeaseBook:
    spec = DatasetSpec(name="d", source="s", num_records=24, split_size=2, epochs=3)
    return LeaseBook(spec, lease_timeout_s=60.0)


def _row_of(book: LeaseBook) -> dict[str, object]:
    spec = {"num_records": book.spec.num_records, "split_size": book.spec.split_size}
    return _row("d", _num_splits(spec), book.status())


def test_acked_leased_and_pending_are_this_epochs_and_add_up_to_its_splits() -> None:
    """Pins ``_row``: ``leased`` is the shown epoch's outstanding splits only (the
    ledger's ``outstanding`` spans every live epoch); the next epoch's leases are
    ``leased_ahead``."""
    book = _book()
    first = [book.grant("w", None, 0.0).lease for _ in range(12)]
    book.ack([lease.lease_id for lease in first[:10] if lease is not None], 0.0)
    ahead = [book.grant("w", None, 0.0).lease for _ in range(9)]
    assert {lease.epoch for lease in ahead if lease is not None} == {1}
    assert book.status()["outstanding"] == 11  # what the page used to call "leased"

    row = _row_of(book)

    assert (row["epoch"], row["splits"], row["acked"], row["leased"], row["pending"]) == (
        0,
        12,
        10,
        2,
        0,
    )
    assert row["leased_ahead"] == 9


def test_a_finished_dataset_shows_every_split_acknowledged_and_none_out() -> None:
    book = _book()
    while (grant := book.grant("w", None, 0.0)).lease is not None:
        book.ack([grant.lease.lease_id], 0.0)
    row = _row_of(book)
    assert row["finished"] and (row["acked"], row["leased"], row["pending"]) == (12, 0, 0)
    assert row["leased_ahead"] == 0
