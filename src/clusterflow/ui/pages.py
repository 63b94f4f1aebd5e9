"""The pages beside the clusters': tuning studies (``tune/``) and caches (``cache/``).

Each page calls the public reading functions its package's CLI calls (``tune.view`` for
``tune ls``/``describe``, ``cache.local`` for ``cache ls``/``describe``) in a worker
thread; a package whose optional dependency is missing (Optuna, the ``[tune]`` extra)
shows a page saying so instead of failing. An unknown name is a 404 page.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from clusterflow.errors import ClusterflowError, ConfigError

__all__ = ["routes"]


def _studies() -> tuple[list[dict[str, str]], str | None]:
    from clusterflow.tune import view

    try:
        return view.studies(None), None
    except ClusterflowError as exc:
        return [], str(exc)


def _trials(name: str) -> list[dict[str, str]]:
    from clusterflow.tune import view

    try:
        return view.trials(name, None)
    except ConfigError as exc:
        raise HTTPException(404, str(exc)) from None


def _caches() -> list[dict[str, Any]]:
    from clusterflow.cache import local

    return [_cache_row(c) for c in local.list_caches()]


def _cache(name: str) -> dict[str, Any]:
    from clusterflow.cache import local

    try:
        cache = local.describe(name)
    except ConfigError as exc:
        raise HTTPException(404, str(exc)) from None
    row = _cache_row(cache)
    row["partitions"] = [
        {
            "index": p.index,
            "records": f"[{p.start}, {p.stop})",
            "rows": p.rows,
            "bytes": p.bytes,
            "owner": p.owner,
            "replica": p.replica or "-",
        }
        for p in cache.partitions
    ]
    row["nodes"] = [
        {
            "node": node,
            "bytes": total,
            "server": cache.servers[node].address if node in cache.servers else "-",
            "status": cache.servers[node].status if node in cache.servers else "-",
        }
        for node, total in cache.bytes_per_node().items()
    ]
    return row


def _cache_row(cache: Any) -> dict[str, Any]:
    return {
        "name": cache.name,
        "backend": cache.backend,
        "status": cache.status,
        "source": cache.source,
        "schema": cache.schema,
        "partition_count": len(cache.partitions),
        "records": cache.num_records,
        "bytes": sum(p.bytes for p in cache.partitions),
        "node_count": len(cache.nodes),
        "replicas": cache.replicas,
    }


def routes(templates: Jinja2Templates) -> list[Route]:
    """The routes of the studies' and caches' pages."""

    async def studies(request: Request) -> Response:
        rows, problem = await anyio.to_thread.run_sync(_studies)
        context: dict[str, Any] = {"studies": rows, "problem": problem}
        return templates.TemplateResponse(request, "studies.html", context)

    async def study(request: Request) -> Response:
        name = request.path_params["name"]
        rows = await anyio.to_thread.run_sync(_trials, name)
        context: dict[str, Any] = {"name": name, "trials": rows}
        return templates.TemplateResponse(request, "study.html", context)

    async def caches(request: Request) -> Response:
        rows = await anyio.to_thread.run_sync(_caches)
        return templates.TemplateResponse(request, "caches.html", {"caches": rows})

    async def cache(request: Request) -> Response:
        row = await anyio.to_thread.run_sync(_cache, request.path_params["name"])
        return templates.TemplateResponse(request, "cache.html", {"c": row})

    return [
        Route("/studies", studies),
        Route("/studies/{name}", study),
        Route("/caches", caches),
        Route("/caches/{name}", cache),
    ]
