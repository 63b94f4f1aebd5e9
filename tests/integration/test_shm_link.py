"""The pipeline's shared-memory link between two stage processes on this host
(``strategies/pipeline/shm_link.py``), one scenario per launch of ``shm_link_job.py``:

* every dtype and shape arrives bit for bit, in order, including a message over
  ``LARGEST`` that goes through gloo between the others; and in a ping-pong, where each
  receive waits before its message is sent;
* eight rings' worth sent each way, receives posted in between: no deadlock, and every
  message lands in its own receive, in order;
* a receive of another size than what was sent raises a one-line ``DistError``;
* a peer that exits makes the waiting rank raise ``DistNetworkError`` (a closed link),
  not wait out the group's timeout;
* a rank that does not offer the link leaves both on gloo, with the same results;
* a stranger's connection, ahead of the peer's, is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import shm_link_job as job
from script_ranks import run_script_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _run(scenario: str, out: Path) -> list[dict[str, Any]]:
    """Both ranks of ``scenario``; what each wrote (None for a rank that wrote nothing)."""
    run_script_ranks(Path(job.__file__), [scenario, str(out)], 2, timeout_s=120)
    paths = [out / f"{scenario}-{rank}.pt" for rank in range(2)]
    return [torch.load(p, weights_only=False) if p.exists() else None for p in paths]


def test_every_dtype_and_shape_arrives_bit_for_bit_in_order(tmp_path: Path) -> None:
    for rank, result in enumerate(_run("mixed", tmp_path)):
        assert result["usable"], "this machine should offer the link (x86-64)"
        assert result["peers"] == [1 - rank]
        assert len(result["equal"]) == 3 * len(job.MIXED) + job.PINGS
        assert all(result["equal"]), f"rank {rank}: {result['equal']}"


def test_four_rings_each_way_with_receives_posted_between_sends(tmp_path: Path) -> None:
    for rank, result in enumerate(_run("full", tmp_path)):
        assert result["peers"] == [1 - rank]
        assert result["count"] >= 8 * 4  # more frames than a ring holds, eight times over
        assert len(result["equal"]) == result["count"]
        assert all(result["equal"]), f"rank {rank}: {result['equal']}"


def test_a_receive_of_another_size_raises_naming_both(tmp_path: Path) -> None:
    result = _run("mismatch", tmp_path)[1]
    assert result["error"] == "DistError"
    assert "rank 0 sent 40 bytes" in result["text"] and "receive of 48 bytes" in result["text"]
    assert "\n" not in result["text"]


def test_a_peer_that_exits_fails_the_wait_at_once(tmp_path: Path) -> None:
    result = _run("peer_dies", tmp_path)[0]
    # Not "Timed out" after the group's timeout: the closed socket says the peer is gone.
    assert result["error"] == "DistNetworkError", result
    assert "rank 1 closed its shared-memory link" in result["text"]


def test_a_rank_that_does_not_offer_leaves_both_on_gloo(tmp_path: Path) -> None:
    for rank, result in enumerate(_run("refused", tmp_path)):
        assert result["peers"] == [], f"rank {rank}"
        assert all(result["equal"]) and len(result["equal"]) == 3 * len(job.MIXED) + job.PINGS


def test_a_stranger_that_connects_first_is_refused_and_the_peer_still_links(
    tmp_path: Path,
) -> None:
    """Anyone on the host can read the link's address (``/proc/net/unix``): the rank
    that accepts takes only a connection from its peer's own process (``SO_PEERCRED``),
    so a stranger claiming the peer's rank, ahead of it in the queue, is refused."""
    results = _run("stranger", tmp_path)
    assert results[1]["refusals"] == 1
    for rank, result in enumerate(results):
        assert result["peers"] == [1 - rank]
        assert all(result["equal"]) and len(result["equal"]) == 3 * len(job.MIXED) + job.PINGS
