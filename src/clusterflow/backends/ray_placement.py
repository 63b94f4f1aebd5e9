"""Placing a whole cluster on Ray at once: one placement group, one bundle per task.

A placement group is gang-scheduled: Ray reserves every bundle or none, so a cluster
never holds some nodes' resources while it waits for others. Before asking, the request
is checked against the nodes that exist (their total resources and labels): a request
no node could ever satisfy fails at once, naming the job and what is missing, and so do
tasks that each fit some node but cannot all be held at once, node by node (naming the
task no node has room for); one that fits the nodes but not their free resources fails
after ``timeout_s``.

Only plain values here (no manager types): the manager turns its ``RunConfig`` into
``TaskRequest``\\ s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterflow.cluster import TaskId
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_CPUS = 1.0
"""What a task asks for when its job names no resources: one CPU, as a Ray task does."""


class PlacementError(ConfigError):
    """The cluster cannot be placed; the message is one line naming the job."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskRequest:
    """What one task needs from the node it runs on."""

    task: TaskId
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resource names: ``CPU``, ``GPU``, ``memory`` (bytes), custom ones."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """A Ray label selector: ``{"gpu-type": "A100"}``; values may be ``!v``, ``in(a,b)``."""
    memory_named: bool = True
    """The ``memory`` is the user's; False: sized automatically (manager/memory_sizing.py).
    Either is enforced (``memory_watch``); only a named one is blamed in an error."""
    memory_before: float = 0.0
    """An automatic memory's peak measured by earlier runs (bytes; 0: none), a floor of
    the sizes later placements of this run ask for (``memory_sizing.within_run``)."""

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle: the resources, one CPU unless CPUs were named."""
        wanted = {k: float(v) for k, v in self.resources.items() if v}
        if "CPU" not in self.resources:
            wanted = {"CPU": DEFAULT_CPUS, **wanted}
        return wanted

    def describe(self, names: Sequence[str] | None = None) -> str:
        """``GPU=1,CPU=8 with gpu-type=A100``: the request (or its ``names``) in the words
        of the CLI."""
        bundle = self.bundle()
        shown = [k for k in bundle if names is None or k in names] or list(bundle)
        text = ",".join(f"{k}={_number(k, bundle[k])}" for k in shown)
        if self.labels:
            text += " with " + ",".join(f"{k}={v}" for k, v in self.labels.items())
        return text


def _number(name: str, value: float) -> str:
    if name == "memory":
        gib = value / 2**30
        return f"{gib:g}G" if gib >= 1 else f"{value / 2**20:g}M"
    return f"{value:g}"


def label_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` satisfies ``selector`` (Ray's label-selector syntax)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        body = want[1:] if negate else want
        if body.startswith("in(") and body.endswith(")"):
            hit = have in {v.strip() for v in body[3:-1].split(",")}
        else:
            hit = have == body
        if hit == negate:
            return False
    return True


def node_fits(request: TaskRequest, node: Mapping[str, Any], resources_key: str) -> bool:
    """Whether ``node`` (an entry of ``ray.nodes()``) has the labels and the resources."""
    if not label_matches(request.labels, node.get("Labels") or {}):
        return False
    have = node.get(resources_key) or {}
    return all(float(have.get(k, 0.0)) + 1e-9 >= v for k, v in request.bundle().items())


def unplaceable(requests: Sequence[TaskRequest], nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """The one-line reason no node could ever run some task; None if each fits a node."""
    alive = [n for n in nodes if n.get("Alive")]
    for request in requests:
        if any(node_fits(request, n, "Resources") for n in alive):
            continue
        labelled = [n for n in alive if label_matches(request.labels, n.get("Labels") or {})]
        bundle = request.bundle()
        # Name what is missing: what no labelled node has; with no such node, what the
        # user asked for (the memory sized for them only if that is what no node has).
        missing = [
            k
            for k, v in bundle.items()
            if not any(float((n.get("Resources") or {}).get(k, 0.0)) + 1e-9 >= v for n in labelled)
        ]
        if not labelled:  # what the user named (not the defaults, not an automatic memory)
            missing = [
                k
                for k in bundle
                if k in request.resources and (k != "memory" or request.memory_named)
            ]
        return f"job {request.task.job} needs {request.describe(missing)}: no node has it"
    return _not_node_by_node(requests, alive)


PACK_STEPS = 20_000
"""Most tries of a task on a node when packing the cluster into the nodes' totals: past
it the search gives up and Ray decides (only a packing proven impossible fails at once)."""


class _GaveUp(Exception):
    """The packing search ran past ``PACK_STEPS``."""


def _not_node_by_node(
    requests: Sequence[TaskRequest], nodes: Sequence[Mapping[str, Any]]
) -> str | None:
    """The one-line reason the tasks, each of which fits some node, cannot all be held by
    the nodes at once, node by node (two tasks of ``CPU=2`` that only one 2-CPU node may
    take); None if they can, or the search gave up.

    First fit in the cluster's task order decides most clusters at once; when it fails,
    an exhaustive search (nodes of equal labels and room tried once) decides, and the
    task first fit could not place is the one named.
    """
    totals = [{k: float(v) for k, v in (n.get("Resources") or {}).items()} for n in nodes]
    bundles = [r.bundle() for r in requests]
    homes = [
        [i for i, n in enumerate(nodes) if label_matches(r.labels, n.get("Labels") or {})]
        for r in requests
    ]
    room = [dict(t) for t in totals]
    stuck = None
    for index, bundle in enumerate(bundles):
        node = next((i for i in homes[index] if _fits(bundle, room[i])), None)
        if node is None:
            stuck = index
            break
        _take(bundle, room[node], -1.0)
    if stuck is None:
        return None
    try:
        if _packs(bundles, homes, totals, nodes):
            return None
    except _GaveUp:
        return None
    request = requests[stuck]
    bundle = bundles[stuck]
    missing = [
        k
        for k, v in bundle.items()
        if not any(room[i].get(k, 0.0) + 1e-9 >= v for i in homes[stuck])
    ] or list(bundle)
    held = ", ".join(
        f"{nodes[i].get('NodeManagerAddress') or str(nodes[i].get('NodeID', '?'))[:12]} has "
        + ",".join(f"{k}={_number(k, totals[i].get(k, 0.0))}" for k in missing)
        + " in all"
        for i in homes[stuck]
    )
    where = f"the nodes with {_labels(request)}" if request.labels else "the nodes"
    return (
        f"task {request.task} needs {request.describe(missing)}: no node has room for it "
        f"beside the cluster's other tasks ({where}: {held})"
    )


def _labels(request: TaskRequest) -> str:
    return ",".join(f"{k}={v}" for k, v in request.labels.items())


def _fits(bundle: Mapping[str, float], room: Mapping[str, float]) -> bool:
    return all(room.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _take(bundle: Mapping[str, float], room: dict[str, float], sign: float) -> None:
    for k, v in bundle.items():
        room[k] = room.get(k, 0.0) + sign * v


def _packs(
    bundles: Sequence[Mapping[str, float]],
    homes: Sequence[Sequence[int]],
    totals: Sequence[Mapping[str, float]],
    nodes: Sequence[Mapping[str, Any]],
) -> bool:
    """Whether every bundle has a node among its ``homes`` at once, within the nodes'
    ``totals`` (an exhaustive search, the most constrained task first).

    Raises:
        _GaveUp: past ``PACK_STEPS`` tries, or too many tasks to search.
    """
    if len(bundles) > 500:  # deeper than the search's recursion may go
        raise _GaveUp
    labels = [tuple(sorted((n.get("Labels") or {}).items())) for n in nodes]
    order = sorted(range(len(bundles)), key=lambda i: (len(homes[i]), -len(bundles[i])))
    room = [dict(t) for t in totals]
    steps = 0

    def place(depth: int) -> bool:
        nonlocal steps
        if depth == len(order):
            return True
        index = order[depth]
        bundle = bundles[index]
        tried = set()
        for node in homes[index]:
            alike = (labels[node], tuple(sorted(room[node].items())))
            if alike in tried or not _fits(bundle, room[node]):
                continue
            tried.add(alike)
            steps += 1
            if steps > PACK_STEPS:
                raise _GaveUp
            _take(bundle, room[node], -1.0)
            if place(depth + 1):
                return True
            _take(bundle, room[node], 1.0)
        return False

    return place(0)


def reserve(requests: Sequence[TaskRequest], name: str, timeout_s: float) -> Any:
    """Reserves one bundle per task (in ``requests``' order) as one placement group.

    Blocks until Ray placed every bundle, at most ``timeout_s`` seconds.

    Raises:
        PlacementError: no node could run some task (at once), or the cluster did not
            fit the free resources within ``timeout_s`` (the group is then removed).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    reason = unplaceable(requests, ray.nodes())
    if reason:
        raise PlacementError(reason)
    group = placement_group(
        [r.bundle() for r in requests],
        # Tasks of a cluster stand for machines of their own: spread them when possible.
        strategy="SPREAD",
        name=name,
        bundle_label_selector=[dict(r.labels) for r in requests],
    )
    if group.wait(timeout_s):
        log.info("placement group %s ready (%d bundles)", name, len(requests))
        return group
    remove_placement_group(group)
    raise PlacementError(_not_free(requests, ray.available_resources(), timeout_s))


def _not_free(requests: Sequence[TaskRequest], free: Mapping[str, float], timeout_s: float) -> str:
    """Names the first job at which the cluster's summed requests outgrow the free
    resources (the whole cluster is placed at once, so earlier tasks count too)."""
    needed: dict[str, float] = {}
    for request in requests:
        for name, value in request.bundle().items():
            needed[name] = needed.get(name, 0.0) + value
            if needed[name] > free.get(name, 0.0) + 1e-9:
                count = sum(1 for r in requests if r.task.job == request.task.job)
                return (
                    f"job {request.task.job} needs {request.describe([name])} for each of its "
                    f"{count} task(s): not free within {timeout_s:g}s (the cluster needs "
                    f"{name}={_number(name, needed[name])} at once or more; free now: "
                    f"{name}={_number(name, free.get(name, 0.0))})"
                )
    job = requests[0].task.job
    return (
        f"job {job} needs {requests[0].describe()}: the cluster was not placed within "
        f"{timeout_s:g}s (its tasks fit the free resources in sum, not node by node)"
    )
