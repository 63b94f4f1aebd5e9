"""``clusterflow secret``: a new cluster secret for manual-mode servers.

Its own module to keep ``cli/main.py`` to the cluster commands.
"""

from __future__ import annotations

import os

import click

from clusterflow.cli.context import CONTEXT
from clusterflow.errors import ConfigError


@click.command(context_settings=CONTEXT)
@click.argument("path")
def secret(path: str) -> None:
    """Write a new cluster secret to PATH (mode 0600) for manual-mode servers."""
    from clusterflow.rpc import Credentials

    if os.path.lexists(path):
        raise ConfigError(f"{path!r} exists; refusing to overwrite a secret")
    try:
        # Created exclusively first, so a file that appears meanwhile is not clobbered.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        Credentials.generate().to_file(path)
    except FileExistsError as exc:
        raise ConfigError(f"{path!r} exists; refusing to overwrite a secret") from exc
    except OSError as exc:
        raise ConfigError(f"cannot write secret {path!r}: {exc.strerror or exc}") from exc
    click.echo(path)
