"""``--param`` parsing and ``{name}`` filling (clusterflow/tune/space.py)."""

from __future__ import annotations

import pytest

from clusterflow.errors import ConfigError
from clusterflow.tune.space import (
    Param,
    check_command,
    distribution,
    fill_command,
    grid,
    parse_param,
    parse_params,
)


def test_each_kind_parses() -> None:
    assert parse_param("lr=loguniform:1e-4:1e-1") == Param("lr", "loguniform", 1e-4, 1e-1)
    assert parse_param("d=uniform:0:0.5") == Param("d", "uniform", 0.0, 0.5)
    assert parse_param("layers=int:1:4") == Param("layers", "int", 1, 4)
    assert parse_param("b=choice:32,64,adam").choices == (32, 64, "adam")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("lr", "expected NAME="),
        ("lr=loguniform", "expected NAME="),
        ("lr=normal:0:1", "unknown kind 'normal'"),
        ("lr=uniform:1", "needs LOW:HIGH"),
        ("lr=uniform:a:1", "'a' is not a number"),
        ("lr=uniform:2:1", "LOW must be below HIGH"),
        ("lr=loguniform:0:1", "LOW > 0"),
        ("n=int:1.5:3", "whole numbers"),
        ("c=choice:", "at least one value"),
        ("1x=uniform:0:1", "expected NAME="),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        parse_param(spec)
    assert "\n" not in str(err.value)


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse_params(["x=int:1:2", "x=int:3:4"])


def test_placeholders_are_filled_and_unknown_ones_refused() -> None:
    params = parse_params(["lr=uniform:0:1", "b=choice:1,2"])
    command = ("python", "t.py", "--lr={lr}", "--batch", "{b}", "{{literal}}")
    check_command(command[:-1], params)
    assert fill_command(command[:-1], {"lr": 0.5, "b": 2}) == (
        "python",
        "t.py",
        "--lr=0.5",
        "--batch",
        "2",
    )
    with pytest.raises(ConfigError, match=r"\{layers\} but no --param layers"):
        check_command(("t.py", "--layers", "{layers}"), params)


def test_to_spec_round_trips() -> None:
    for spec in ["lr=loguniform:0.0001:0.1", "n=int:1:4", "c=choice:a,2", "u=uniform:0.0:1.0"]:
        assert parse_param(parse_param(spec).to_spec()) == parse_param(spec)


def test_distributions_and_grid_are_optunas() -> None:
    import optuna  # a test dependency: its absence is a failure, not a skip

    lr = parse_param("lr=loguniform:1e-3:1e-1")
    dist = distribution(lr)
    assert isinstance(dist, optuna.distributions.FloatDistribution) and dist.log
    assert isinstance(distribution(parse_param("n=int:1:3")), optuna.distributions.IntDistribution)
    points = grid([lr, parse_param("n=int:1:3"), parse_param("c=choice:a,b")], points=3)
    assert points["n"] == [1, 2, 3] and points["c"] == ["a", "b"]
    assert points["lr"][0] == pytest.approx(1e-3) and points["lr"][-1] == pytest.approx(1e-1)
    assert points["lr"][1] == pytest.approx(1e-2)
