"""``clusterflow cache``: create, list, describe and drop in-memory caches.

Parsing and printing only; the work is ``clusterflow.cache`` (``local.py`` on this
machine, ``ray_nodes.py`` on a Ray cluster). Bad input (an unknown cache, 0
partitions, a missing source, files of differing schemas, a cache that does not fit)
is one ``error:`` line and exit code 2, raised as a ``ClusterflowError`` and printed by
``cli.main.main``; a cache that exists is never touched by a failed command.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from clusterflow.backends import kinds
from clusterflow.cli.context import CONTEXT
from clusterflow.errors import ConfigError

if TYPE_CHECKING:
    from clusterflow.data.cache_map import CacheMap


@click.group(name="cache", context_settings=CONTEXT)
def cache_group() -> None:
    """In-memory distributed datasets (caches) that training reads where they lie."""


@cache_group.command(context_settings=CONTEXT)
@click.argument("name")
@click.option("--from", "source", required=True, help="Files to load: a path, glob or fsspec URL.")
@click.option("--partitions", type=int, required=True, help="Partitions to cut the records into.")
@click.option(
    "--replicas", type=int, default=0, show_default=True, help="Copies on another node (0 or 1)."
)
@click.option(
    "--memory-per-node",
    help="The most memory a node gives this cache (e.g. 2G) [default: its free memory, less 10%].",
)
@click.option(
    "--backend",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where the cache servers run: this machine, or one actor per Ray node.",
)
@click.option("--address", help="The Ray cluster's HOST:PORT [default: RAY_ADDRESS, or auto].")
@click.option("--label", "label", help="Ray: only nodes with these labels, KEY=VALUE,...")
def create(
    name: str,
    source: str,
    partitions: int,
    replicas: int,
    memory_per_node: str | None,
    backend: str,
    address: str | None,
    label: str | None,
) -> None:
    """Load files into a new cache NAME, held in memory until `cache drop`.

    \b
    Example:
      clusterflow cache create mnist --from 's3://bucket/mnist/*.parquet' --partitions 8
    """
    from clusterflow._sizes import parse_size
    from clusterflow.cache.plan import human
    from clusterflow.data import UnknownFormatError

    limit = parse_size(memory_per_node, "--memory-per-node") if memory_per_node else None
    try:
        cache = _create(name, source, partitions, replicas, limit, backend, address, label)
    except UnknownFormatError as exc:
        raise exc.with_remedy(
            "`cache create --from` tells the format by the file names: name them so"
        ) from None
    total = sum(p.bytes for p in cache.partitions)
    click.echo(
        f"cache {cache.name}: {cache.num_records} records in {len(cache.partitions)} "
        f"partitions on {len(cache.nodes)} node(s), {human(total)}"
    )


def _create(
    name: str,
    source: str,
    partitions: int,
    replicas: int,
    limit: int | None,
    backend: str,
    address: str | None,
    label: str | None,
) -> Any:
    from clusterflow.cache import local

    if kinds.named(backend).placed_by_ray:
        from clusterflow.cache import ray_nodes

        cache = ray_nodes.create(
            name,
            source,
            partitions,
            replicas=replicas,
            memory_per_node=limit,
            address=address,
            labels=_labels(label),
        )
    elif address or label:
        raise ConfigError("--address and --label are for --backend ray")
    else:
        cache = local.create(name, source, partitions, replicas=replicas, memory_per_node=limit)
    return cache


@cache_group.command(name="ls", context_settings=CONTEXT)
def ls_command() -> None:
    """List caches: name, partitions, rows, bytes, nodes, status."""
    from clusterflow.cache import local
    from clusterflow.cache.plan import human

    rows: list[tuple[str, ...]] = [("NAME", "PARTITIONS", "ROWS", "BYTES", "NODES", "STATUS")]
    for cache in local.list_caches():
        total = sum(p.bytes for p in cache.partitions)
        rows.append(
            (
                cache.name,
                str(len(cache.partitions)),
                str(cache.num_records),
                human(total),
                str(len(cache.nodes)),
                cache.status,
            )
        )
    _print_table(rows)


@cache_group.command(context_settings=CONTEXT)
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="The map as JSON.")
def describe(name: str, as_json: bool) -> None:
    """Show a cache: partition -> node and replica, bytes per node, servers."""
    from clusterflow.cache import local

    cache = local.describe(name)
    if as_json:
        click.echo(json.dumps(_as_dict(cache), indent=1))
        return
    from clusterflow.cache.plan import human

    click.echo(f"cache {cache.name} ({cache.backend}): {cache.status}")
    click.echo(f"source: {cache.source}")
    click.echo(f"schema: {cache.schema}")
    click.echo(f"records: {cache.num_records} in {len(cache.partitions)} partitions")
    rows: list[tuple[str, ...]] = [("PARTITION", "RECORDS", "ROWS", "BYTES", "OWNER", "REPLICA")]
    for p in cache.partitions:
        rows.append(
            (
                str(p.index),
                f"[{p.start}, {p.stop})",
                str(p.rows),
                human(p.bytes),
                p.owner,
                p.replica or "-",
            )
        )
    _print_table(rows)
    click.echo("")
    rows = [("NODE", "BYTES", "SERVER", "STATUS")]
    for node, total in cache.bytes_per_node().items():
        server = cache.servers.get(node)
        rows.append(
            (
                node,
                human(total),
                server.address if server else "-",
                server.status if server else "-",
            )
        )
    _print_table(rows)
    for event in cache.events:
        click.echo(f"event: {event}")


@cache_group.command(context_settings=CONTEXT)
@click.argument("name")
def drop(name: str) -> None:
    """Stop a cache's servers and free its memory."""
    from clusterflow.cache import local

    cache = local.drop(name)
    click.echo(f"dropped cache {cache.name}")


def _labels(text: str | None) -> dict[str, str]:
    """``KEY=VALUE,...`` as a Ray label selector (a value may be ``in(a,b)`` or ``!v``)."""
    import re

    out: dict[str, str] = {}
    rest = (text or "").strip()
    item = re.compile(r"\s*([^,=\s]+)\s*=\s*(in\([^)]*\)|[^,]*?)\s*(?:,|$)")
    while rest:
        match = item.match(rest)
        if not match or not match.group(2):
            raise ConfigError(f"--label wants KEY=VALUE,..., got {rest!r}")
        out[match.group(1)] = match.group(2)
        rest = rest[match.end() :].strip()
    return out


def _as_dict(cache: CacheMap) -> dict[str, Any]:
    return {**cache.to_wire(), "bytes_per_node": cache.bytes_per_node()}


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


NODE_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id: a selector on it is node affinity."""


def cache_placement(config: Any) -> Any:
    """``start --cache NAME``: the run's config with its workers placed at the cache.

    Every task learns the cache's name (``cache://`` alone names it). On Ray, the chief
    and the workers get a label selector naming the nodes that own partitions (node
    affinity; the cluster's placement group spreads them over those nodes); on the local
    backend every partition is on this node already.

    Raises:
        UnknownCacheError: no such cache. ConfigError: it is not ready, or it lives
            on another backend than the cluster.
    """
    from dataclasses import replace

    from clusterflow.cache import local
    from clusterflow.cluster.contract import ENV_CACHE

    cache = local.describe(config.cache)
    if not cache.status.startswith(("ready", "degraded")):
        raise ConfigError(f"cache {cache.name!r} is not ready: {cache.status}")
    if cache.backend != config.backend:
        raise ConfigError(
            f"cache {cache.name!r} is on the {cache.backend} backend, the cluster on "
            f"{config.backend}: start it with --backend {cache.backend}"
        )
    labels = dict(config.labels)
    if kinds.named(cache.backend).placed_by_ray:  # the chief and workers to the owners' nodes
        owners = sorted({p.owner for p in cache.partitions})
        for job in ("chief", "worker"):
            labels[job] = {**labels.get(job, {}), NODE_LABEL: f"in({','.join(owners)})"}
    return replace(config, env={**config.env, ENV_CACHE: cache.name}, labels=labels)
