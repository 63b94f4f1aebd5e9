"""The one reader of a size as a user spells it (no layer of its own, like ``_files``).

``--memory 4G``, ``--resources worker:memory=512M``, a cluster file's ``memory:`` and
``cache create --memory-per-node 1.5GiB`` all name bytes. The manager's settings and the
cache's plan sit in layers that may not import each other, and each once had its own
parser; they differed (one took ``nan``, the other not), so both read through this one.
"""

from __future__ import annotations

from clusterflow.errors import ConfigError

__all__ = ["parse_size"]

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str, what: str) -> int:
    """``4G``, ``512M``, ``2GiB`` or plain bytes, as bytes (binary units, as Ray's).

    Raises:
        ConfigError: ``text`` is not a size of zero or more bytes; the message names
            ``what`` (the flag or setting it came from) and the bad value.
    """
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _UNITS and raw[-1:].isalpha() else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{what}: {text!r} is not a size such as 4G, 512M or 1073741824")
    return int(value * _UNITS[unit])
