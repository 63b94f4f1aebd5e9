"""Growth on Ray (issue 32): a node that joins is used while the cluster is below MAX.

Under ``--workers MIN:MAX`` on the Ray backend, a node that joins the Ray cluster later
(an autoscaler's, spot capacity coming back, a colleague's job ending) should carry more
workers. A :class:`GrowthWatcher` beside the manager reads Ray's nodes and their free
resources every ``POLL_S`` (each read with a deadline, on a thread of its own), asks
:func:`workers_to_add` how many workers of the job's request the free room takes, and
asks for that many more through ``manager.scale``: the path ``clusterflow scale``
takes, so the same checks (``check_scale``), the same membership history and the same
spec versions hold. The watcher itself reserves nothing: what a change adds is placed
per change (a placement group of the newcomers' bundles, removed when it does not place
within the placement timeout, ``ray_placement.reserve``), never a group sized for MAX
held from the start.

How soon: a node Ray reports is seen at the next poll (``POLL_S``) once a read returns
(``READ_DEADLINE_S`` at most), so the grow is asked within ``POLL_S + READ_DEADLINE_S``
(6 s) of Ray reporting the node; the issue's bound is 10 s.

The manager actor starts one for an elastic cluster (``ManagerHost.start`` in
``manager/ray_host.py``) and stops it before its backend closes; the decision and the
watcher are unit-tested in ``tests/unit/test_ray_growth_watcher.py``, the whole path on
emulated hosts in ``tests/integration/test_ray_growth.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from clusterflow.backends.ray_placement import TaskRequest, label_matches
from clusterflow.errors import ClusterflowError
from clusterflow.manager.elastic import SCALE_DEADLINE_S
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.server.manager_messages import ScaleReply, ScaleRequest

log = logging.getLogger(__name__)

POLL_S: Final = 1.0
"""How often the watcher reads Ray's nodes: a joined node is seen within a second of
Ray reporting it, and a read costs the GCS one small call."""
READ_DEADLINE_S: Final = 5.0
"""The most one read of Ray's nodes may take; past it the poll is skipped (and the next
one waits for the late read to end, so reads never pile up on a stuck GCS)."""
BACKOFF_S: Final = 10.0
"""After a grow that failed (the room went before the change placed), how long the
watcher waits before asking again: it must not ask Ray for the same room every poll."""


class ReadTimeout(ClusterflowError):
    """Ray's nodes were not read within ``READ_DEADLINE_S``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRoom:
    """One alive Ray node as the watcher sees it."""

    node_id: str
    labels: Mapping[str, str] = field(default_factory=dict)
    """Its Ray labels (a request's label selector is matched against them)."""
    free: Mapping[str, float] = field(default_factory=dict)
    """Its resources not held by anyone now (Ray's ``available_resources_per_node``)."""


def fits_on(request: TaskRequest, node: NodeRoom) -> int:
    """How many tasks of ``request`` the free room of ``node`` takes (0: labels differ)."""
    if not label_matches(request.labels, node.labels):
        return 0
    bundle = {k: v for k, v in request.bundle().items() if v > 0}
    if not bundle:
        return 0  # a request of nothing: never a reason to grow
    return min(int((float(node.free.get(k, 0.0)) + 1e-9) // v) for k, v in bundle.items())


def workers_to_add(
    nodes: Sequence[NodeRoom], request: TaskRequest, *, workers: int, high: int
) -> int:
    """How many workers to add now: what the nodes' free room takes, up to MAX.

    Args:
        nodes: the alive nodes and their free resources.
        request: what one worker asks (the worker job's resources and labels).
        workers: the worker tasks the cluster has now.
        high: MAX (``--workers MIN:MAX``).
    """
    if workers >= high:
        return 0
    return min(sum(fits_on(request, n) for n in nodes), high - workers)


class NodeReader:
    """Reads the alive nodes of the Ray cluster this process joined, with their free
    room: ``reader()``. Each read runs on a daemon thread, waited for at most
    ``timeout_s``; while a late read still runs no other starts, so reads never pile up
    on a GCS that does not answer."""

    def __init__(self, timeout_s: float = READ_DEADLINE_S) -> None:
        self._timeout_s = timeout_s
        self._late: threading.Thread | None = None

    def __call__(self) -> list[NodeRoom]:
        """Raises:
        ReadTimeout: Ray did not answer in time, or an earlier read still runs.
        """
        if self._late is not None and self._late.is_alive():
            raise ReadTimeout("an earlier read of Ray's nodes still runs")
        outcome: list[Any] = []
        done = threading.Event()

        def read() -> None:
            try:
                outcome.append(_ray_nodes())
            except Exception as exc:  # handed to the waiting thread, which raises it
                outcome.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=read, name="ray-growth-read", daemon=True)
        thread.start()
        if not done.wait(self._timeout_s):
            self._late = thread
            raise ReadTimeout(f"Ray's nodes were not read within {self._timeout_s:g}s")
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        found: list[NodeRoom] = outcome[0]
        return found


def _ray_nodes() -> list[NodeRoom]:
    import ray
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return [
        NodeRoom(
            node_id=str(n["NodeID"]),
            labels=dict(n.get("Labels") or {}),
            free=dict(free.get(n["NodeID"], {})),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def scale_asker(address: str, credentials: Credentials) -> Callable[[int], ScaleReply]:
    """``grow`` for a :class:`GrowthWatcher`: asks the manager at ``address`` for that many
    workers in all through ``manager.scale`` (``ScaleRequest``, ``ScaleReply``), as
    ``clusterflow scale`` does, within ``SCALE_DEADLINE_S``; returns its answer.

    Raises (from the returned function):
        ScaleRefused: the manager would not (not running, MAX, a job that does not
            resize live); nothing changed.
        RpcError: the manager did not answer in time.
    """

    def grow(workers: int) -> ScaleReply:
        request = ScaleRequest(workers=workers, automatic=True)
        with RpcClient(address, credentials, deadline=SCALE_DEADLINE_S) as client:
            reply = client.call(request.METHOD, request.to_wire()).body
        return ScaleReply.from_wire(reply)

    return grow


class GrowthWatcher:
    """Asks for more workers when Ray's free room takes them (see the module).

    Args:
        request: what one worker asks of its node.
        size: the worker tasks now and the most to grow to (MAX, or the size a user last
            asked with `clusterflow scale`); None once the cluster is not running (the
            watcher then asks for nothing).
        grow: asks the manager for this many workers in all (``manager.scale``); it
            returns once the change took effect and raises when it failed.
        nodes: reads the alive nodes with their free room (a ``NodeReader``).
        clock: seconds, for the back-off after a failed grow.
    """

    def __init__(
        self,
        *,
        request: TaskRequest,
        size: Callable[[], tuple[int, int] | None],
        grow: Callable[[int], Any],
        nodes: Callable[[], Sequence[NodeRoom]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._request = request
        self._size = size
        self._grow = grow
        self._nodes = nodes or NodeReader()
        self._clock = clock
        self._quiet_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> int:
        """One look at Ray: asks for the workers its free room takes; returns how many
        were asked for (0: none fit, at MAX, not running, backing off, or a failure,
        logged)."""
        if self._clock() < self._quiet_until:
            return 0
        size = self._size()
        if size is None:
            return 0
        workers, high = size
        if workers >= high:
            return 0  # no read of Ray at MAX
        try:
            nodes = self._nodes()
        except Exception as exc:
            log.warning("growth: Ray's nodes could not be read: %s", exc)
            return 0
        more = workers_to_add(nodes, self._request, workers=workers, high=high)
        if not more:
            return 0
        log.info("growth: room for %d more worker(s): asking for %d", more, workers + more)
        try:
            self._grow(workers + more)
        except Exception as exc:
            self._quiet_until = self._clock() + BACKOFF_S
            log.warning("growth: asking for %d workers failed: %s", workers + more, exc)
            return 0
        return more

    def start(self) -> None:
        """Polls every ``POLL_S`` on a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._run, name="ray-growth", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(READ_DEADLINE_S + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()
