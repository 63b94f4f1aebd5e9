"""The web dashboard and Prometheus ``/metrics`` of ``clusterflow ui`` (docs/dashboard.md).

It reads the manager's state as ``ps`` and ``describe`` do (``views``), serves it as
pages that update live (``app``), under the access rules of ``access``, on uvicorn
(``server``). Needs the ``[ui]`` extra (Starlette, uvicorn, prometheus-client).
"""
