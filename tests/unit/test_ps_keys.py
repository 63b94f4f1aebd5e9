"""``KeyLedger`` and ``ParameterServerConfig``: pure, no ps, no processes."""

from __future__ import annotations

import pytest

from clusterflow.data import SplitKey
from clusterflow.errors import ConfigError
from clusterflow.ps.protocol import PushReply
from clusterflow.strategies.parameter_server.config import ParameterServerConfig
from clusterflow.strategies.parameter_server.keys import KeyLedger

A, B = SplitKey("ds", 0, 1), SplitKey("ds", 0, 2)


def reply(applied: bool, *duplicates: SplitKey) -> PushReply:
    return PushReply(
        applied=applied,
        version=1,
        duplicates=tuple((k.dataset, k.epoch, k.split) for k in duplicates),
    )


def test_async_a_key_is_applied_only_when_every_shard_has_it() -> None:
    ledger = KeyLedger()
    assert not ledger.async_replies([A, B], [reply(True), reply(False, A)])
    settled = ledger.take()
    # Shard 1 had A (a replay) but refused the push: B is on shard 0 only, so it goes back
    # and shard 0 will refuse it as a duplicate when it comes again.
    assert settled.applied == (A,) and settled.dropped == (B,)
    assert not ledger.take()


def test_sync_keys_wait_for_their_step_to_commit() -> None:
    ledger = KeyLedger()
    assert ledger.sync_reply([A], reply(True), step=4)
    ledger.reached(4)
    assert not ledger.take() and ledger.waiting_for_steps
    ledger.reached(5)
    assert ledger.take().applied == (A,) and not ledger.waiting_for_steps


def test_sync_a_late_push_gives_its_keys_back_and_a_duplicate_is_acked() -> None:
    ledger = KeyLedger()
    assert not ledger.sync_reply([B], reply(False), step=2)
    assert ledger.take().dropped == (B,)
    assert not ledger.sync_reply([A, B], reply(True, A), step=3)
    settled = ledger.take()
    assert settled.applied == (A,) and settled.dropped == (B,)


def test_the_config_checks_itself_and_names_an_unknown_option() -> None:
    assert (
        ParameterServerConfig.of({"mode": "sync", "backup_workers": 1})
        .ps_config(3)
        .replicas_per_step
        == 2
    )
    with pytest.raises(ConfigError, match="no option 'modes'"):
        ParameterServerConfig.of({"modes": "sync"})
    with pytest.raises(ConfigError, match="gradient_wire_dtype"):
        ParameterServerConfig(gradient_wire_dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backup_workers needs mode='sync'"):
        ParameterServerConfig(backup_workers=1)
