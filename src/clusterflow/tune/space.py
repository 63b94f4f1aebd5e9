"""The search space: ``--param name=kind:...`` parsed, and ``{name}`` filled in a command.

Parsing needs no Optuna, so bad input is refused (one line, exit 2) before anything
starts; :func:`distribution` maps a parsed parameter onto Optuna's own distribution.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterflow.errors import ConfigError

__all__ = ["Param", "fill_command", "parse_param", "parse_params"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
KINDS = ("loguniform", "uniform", "int", "choice")


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    kind: str
    """``loguniform``, ``uniform``, ``int`` or ``choice``."""
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()

    def to_spec(self) -> str:
        """The ``--param`` text this came from (stored with the study)."""
        if self.kind == "choice":
            return f"{self.name}=choice:" + ",".join(str(c) for c in self.choices)
        if self.kind == "int":
            return f"{self.name}=int:{int(self.low)}:{int(self.high)}"
        return f"{self.name}={self.kind}:{self.low!r}:{self.high!r}"


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--param {spec!r}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"--param {spec!r}: {text!r} is not a finite number")
    return value


def _choice(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_param(spec: str) -> Param:
    """``lr=loguniform:1e-4:1e-1``, ``units=int:8:64``, ``opt=choice:sgd,adam``."""
    name, eq, rest = spec.partition("=")
    kind, colon, args = rest.partition(":")
    if not eq or not colon or not _NAME.match(name):
        raise ConfigError(
            f"--param {spec!r}: expected NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, "
            "int:LOW:HIGH or choice:A,B,..."
        )
    if kind == "choice":
        choices = tuple(_choice(c) for c in args.split(",") if c != "")
        if not choices:
            raise ConfigError(f"--param {spec!r}: a choice needs at least one value")
        return Param(name, kind, choices=choices)
    if kind not in KINDS:
        raise ConfigError(f"--param {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    bounds = args.split(":")
    if len(bounds) != 2:
        raise ConfigError(f"--param {spec!r}: {kind} needs LOW:HIGH")
    low, high = (_number(b, spec) for b in bounds)
    if kind == "int" and (low != int(low) or high != int(high)):
        raise ConfigError(f"--param {spec!r}: int bounds must be whole numbers")
    if low >= high:
        raise ConfigError(f"--param {spec!r}: LOW must be below HIGH")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"--param {spec!r}: loguniform needs LOW > 0")
    return Param(name, kind, low, high)


def parse_params(specs: Iterable[str]) -> list[Param]:
    params = [parse_param(s) for s in specs]
    names = [p.name for p in params]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--param {name!r} is given twice")
    return params


def check_command(command: Sequence[str], params: Sequence[Param]) -> None:
    """Every ``{name}`` in the command must be a parameter (else one line, exit 2)."""
    known = {p.name for p in params}
    for word in command:
        for name in _PLACEHOLDER.findall(word):
            if name not in known:
                raise ConfigError(f"the command uses {{{name}}} but no --param {name}=... is given")


def fill_command(command: Sequence[str], values: Mapping[str, Any]) -> tuple[str, ...]:
    """The command with each ``{name}`` replaced by the trial's value."""
    return tuple(
        _PLACEHOLDER.sub(
            lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), w
        )
        for w in command
    )


def distribution(param: Param) -> Any:
    """Optuna's distribution for ``param``."""
    import optuna

    if param.kind == "choice":
        return optuna.distributions.CategoricalDistribution(param.choices)
    if param.kind == "int":
        return optuna.distributions.IntDistribution(int(param.low), int(param.high))
    return optuna.distributions.FloatDistribution(
        param.low, param.high, log=param.kind == "loguniform"
    )


def grid(params: Sequence[Param], points: int = 5) -> dict[str, list[Any]]:
    """A grid for Optuna's GridSampler: choices as they are, ranges at ``points`` values."""
    out: dict[str, list[Any]] = {}
    steps = [i / (points - 1) for i in range(points)]
    for p in params:
        if p.kind == "choice":
            out[p.name] = list(p.choices)
        elif p.kind == "int":
            out[p.name] = sorted({round(p.low + (p.high - p.low) * t) for t in steps})
        elif p.kind == "loguniform":
            out[p.name] = [p.low * (p.high / p.low) ** t for t in steps]
        else:
            out[p.name] = [p.low + (p.high - p.low) * t for t in steps]
    return out
