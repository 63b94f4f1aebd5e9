"""``clusterflow ui``: serve the web dashboard and ``/metrics`` (docs/dashboard.md)."""

from __future__ import annotations

import os

import click

from clusterflow.cli.context import CONTEXT
from clusterflow.cluster.contract import ENV_UI_TOKEN
from clusterflow.errors import ConfigError

# A token chosen in advance (ENV_UI_TOKEN: a Prometheus scraping a dashboard off loopback
# keeps it) comes from the environment, never the command line, where `ps` would show it.


@click.command(context_settings=CONTEXT)
@click.option("--port", type=int, default=8265, show_default=True, help="TCP port (0: any).")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; any but loopback needs the printed token for every request.",
)
@click.option(
    "--interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between two reads of a watched cluster.",
)
def ui(port: int, host: str, interval: float) -> None:
    """Serve the dashboard: clusters, their tasks, live charts, logs; and /metrics."""
    try:
        from clusterflow.ui import access, server
    except ImportError as exc:
        raise ConfigError(
            f"the dashboard needs its extra ({exc.name} is missing): pip install 'clusterflow[ui]'"
        ) from None
    if not interval > 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {interval}")
    token = os.environ.get(ENV_UI_TOKEN) or access.new_token()
    bound = server.bind(host, port, token)
    click.echo(f"dashboard: {bound.url}")
    if not access.is_loopback(host):
        click.echo(f"  listening on {host}: every request needs the token above")
    click.echo("  metrics:   /metrics (Prometheus text format)   stop: Ctrl-C", nl=True)
    server.serve(bound, interval_s=interval)
