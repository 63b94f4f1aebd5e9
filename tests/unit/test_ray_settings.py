"""``--resources`` and ``--label`` as the CLI parses them (``parse_job_settings``)."""

from __future__ import annotations

import pytest

from clusterflow.errors import ConfigError
from clusterflow.manager.job_settings import parse_job_settings


def test_labels_take_ray_selectors_with_commas_inside_parentheses() -> None:
    got = parse_job_settings(
        ["worker:zone=in(a,b),gpu-type=!T4", "ps:zone=c", "worker:disk=ssd"], "labels"
    )
    assert got == {
        "worker": {"zone": "in(a,b)", "gpu-type": "!T4", "disk": "ssd"},
        "ps": {"zone": "c"},
    }


def test_resources_are_numbers_and_memory_a_size() -> None:
    got = parse_job_settings(["worker:GPU=1,CPU=0.5,memory=2G"], "resources")
    assert got == {"worker": {"GPU": 1.0, "CPU": 0.5, "memory": float(2 << 30)}}


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("worker", "expected JOB:NAME=VALUE"),
        ("worker:zone", "'zone' is not NAME=VALUE"),
        ("worker:zone=a,", "'' is not NAME=VALUE"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(item: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_job_settings([item], "labels")
