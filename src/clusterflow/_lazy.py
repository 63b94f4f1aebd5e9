"""Names a package exports but loads on first use (a module ``__getattr__``, PEP 562).

The control plane (the CLI, the manager, supervisors) must start without paying torch's
import, about 2.5 s of CPU; so a package whose public names include torch's users hands
those out only when they are first asked for. ``tests/unit/test_layers.py`` checks that
the control plane's packages import without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``homes`` maps each name loaded on first
    use to the module that defines it.

    Use as ``__getattr__ = lazy_exports(__name__, {"Name": "package.module"})``, with the
    same names imported under ``TYPE_CHECKING`` for type checkers.
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        # A subpackage exported under its own name (``clusterflow.tune``): the module.
        return module if home == f"{package}.{name}" else getattr(module, name)

    return __getattr__
