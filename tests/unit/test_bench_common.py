"""The benchmarks' shared method: alternating rounds, per-round ratios, the RESULT line.

Timings themselves live in benchmarks/ (never a threshold here); these check the
arithmetic and the order the figures are taken in, with fake sides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# benchmarks/ is a top-level folder of the repository, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    MachineLoad,
    Spread,
    alternate,
    parser,
    ratio,
    result,
)


def test_spread_is_median_min_max() -> None:
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.count) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError, match="no values"):
        Spread.of([])


def test_ratio_is_taken_within_each_round() -> None:
    # A load that halves round 2 for both sides leaves its ratio alone; a ratio of
    # medians would mix rounds, this does not.
    ours, peer = [2.0, 1.0, 2.2], [1.0, 0.5, 1.0]
    s = ratio(ours, peer)
    assert (s.median, s.low, s.high) == (2.0, 2.0, 2.2)
    with pytest.raises(ValueError):
        ratio([1.0], [1.0, 2.0])


def test_alternate_warms_every_side_then_reverses_the_order_each_round() -> None:
    calls: list[str] = []

    def side(name: str) -> float:
        calls.append(name)
        return float(len(calls))

    figures = alternate({"a": lambda: side("a"), "b": lambda: side("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    # The warm-up calls are not figures; each round gives one figure per side.
    assert figures == {"a": [3.0, 6.0, 7.0], "b": [4.0, 5.0, 8.0]}


def test_result_prints_one_line_with_the_spread(capsys: pytest.CaptureFixture[str]) -> None:
    result("x", r=Spread.of([1.0, 2.0, 4.0]), plain=0.5)
    out = capsys.readouterr().out
    assert out == "RESULT x r=2.000 r_min=1.000 r_max=4.000 plain=0.500\n"


def test_rounds_below_three_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    p = parser("x", None)
    assert p.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "2"])
    assert "--rounds must be at least 3, got 2" in capsys.readouterr().err


def test_machine_load_is_a_share() -> None:
    load = MachineLoad(interval=0.05)
    sum(i * i for i in range(200_000))  # our own work is not the others'
    share = load.others()
    assert 0.0 <= share <= 1.0
    assert "load: other processes used" in load.describe()
