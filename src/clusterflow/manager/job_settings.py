"""Per-job placement settings as a user spells them: ``JOB:NAME=VALUE`` pairs and sizes.

``--resources worker:GPU=1,memory=4G`` and ``--label ps:zone=a`` become
``{job: {name: value}}``; ``4G``, ``512M`` or plain bytes become bytes. Pure parsing,
used by the CLI's flags, the cluster file and ``RunConfig``'s checks, so the forms are
read one way wherever they are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clusterflow._sizes import parse_size
from clusterflow.errors import ConfigError

__all__ = ["RAY_ONLY", "parse_job_settings", "parse_size"]

RAY_ONLY = {
    "address": "--address",
    "resources": "--resources",
    "labels": "--label",
    "job_dir": "--job-dir",
    "memory": "--memory",
}
"""Settings that mean something only where tasks are placed on many machines."""


def parse_job_settings(items: Sequence[str], what: str) -> dict[str, dict[str, Any]]:
    """``["worker:GPU=1,CPU=8", "ps:CPU=2"]`` as ``{job: {name: value}}``.

    ``what`` is ``resources`` (numbers; ``memory`` may be a size such as ``4G``) or
    ``labels`` (strings).
    """
    out: dict[str, dict[str, Any]] = {}
    flag = RAY_ONLY[what]
    for item in items:
        job, sep, pairs = item.partition(":")
        if not sep or not job or not pairs:
            raise ConfigError(f"{flag} {item!r}: expected JOB:NAME=VALUE[,NAME=VALUE...]")
        settings = out.setdefault(job.strip(), {})
        for pair in _split_pairs(pairs):
            name, eq, value = (part.strip() for part in pair.partition("="))
            if not eq or not name or not value:
                raise ConfigError(f"{flag} {item!r}: {pair!r} is not NAME=VALUE")
            settings[name] = _resource_value(name, value, item) if what == "resources" else value
    return out


def _split_pairs(pairs: str) -> list[str]:
    """``a=1,b=in(x,y)`` as ``["a=1", "b=in(x,y)"]``: a comma inside parentheses (a label
    selector's ``in(...)``) does not end a pair."""
    out, depth, start = [], 0, 0
    for i, char in enumerate(pairs):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth <= 0:
            out.append(pairs[start:i])
            start = i + 1
    out.append(pairs[start:])
    return out


def _resource_value(name: str, value: str, item: str) -> float:
    if name == "memory":
        return float(parse_size(value, f"--resources {item!r}"))
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--resources {item!r}: {name}={value!r} is not a number") from None
