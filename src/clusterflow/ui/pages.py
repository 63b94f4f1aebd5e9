"""The pages beside the clusters': tuning studies (``tune/``), read as ``tune ls`` reads them.

Each page calls the public reading functions of its package (``tune.view``) in a worker
thread; a package whose optional dependency is missing (Optuna, the ``[tune]`` extra)
shows a page saying so instead of failing.
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


def routes(templates: Jinja2Templates) -> list[Route]:
    """The routes of the studies' pages."""

    async def studies(request: Request) -> Response:
        rows, problem = await anyio.to_thread.run_sync(_studies)
        context: dict[str, Any] = {"studies": rows, "problem": problem}
        return templates.TemplateResponse(request, "studies.html", context)

    async def study(request: Request) -> Response:
        name = request.path_params["name"]
        rows = await anyio.to_thread.run_sync(_trials, name)
        context: dict[str, Any] = {"name": name, "trials": rows}
        return templates.TemplateResponse(request, "study.html", context)

    return [Route("/studies", studies), Route("/studies/{name}", study)]
