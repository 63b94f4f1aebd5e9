"""The click settings every ``clusterflow`` command and group shares.

One definition, so ``-h`` works and help wraps at the same width in every subcommand
(``start``, ``cache``, ``tune``, ``secret``, ``ui``, ...).
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["CONTEXT"]

CONTEXT: Final[dict[str, Any]] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""``context_settings`` of every command: ``-h`` as well as ``--help``; help lines up
to 100 columns (click's default of 80 wraps the option tables of ``start``)."""
