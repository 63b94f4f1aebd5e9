"""The manager's side of a sync step's membership: the ps tasks hear who the replicas
are whenever ``clusterflow scale`` (or a loss above MIN) changes them (issue 32).

A synchronous parameter-server step waits for every replica (``ps/engine.py``). In an
elastic cluster that set changes, and each ps task must learn it at a step boundary:

- **A worker leaves**: once its process is gone, every ps task gets ``ps.leave`` (the
  step being collected stops waiting for it at once) and ``ps.members`` without it (the
  steps after it never count it again, even if a request it sent before it died is
  served late and would have made it a replica again).
- **Workers join**: every ps task gets ``ps.members`` with them *before* they are
  launched, so a newcomer's first push always finds the membership that names it. The
  ps takes it from its next step: the step being collected keeps the replicas it began
  with, and the newcomer is waited for from the next one.

Why the manager sends it, and not the chief replica when it sees a new spec:

- **Exactly once.** The manager alone knows when a leaver can push no more (its process
  exited), so it can stop the steps waiting for it without ever dropping a push that
  was counted: a counted push is always applied (``ApplyEngine.leave`` keeps a replica
  that committed in its step), and its split keys, unacked, are lent again and are a
  duplicate at the ps, an empty part of a later step. A replica would have to guess.
- **A newcomer gets the next step.** The manager orders the message before the launch,
  so no newcomer's push races it; the ps, not the sender, picks the boundary, so no
  sender needs to know the step and no step changes its count while it is collected.
- **It does not stop when the chief does.** A chief whose data ran out has left the
  steps; the manager is there until the end.

The cost of the design: a sync step after a grow waits for the newcomer's start (its
interpreter, torch, the first pull), as a newcomer of torchft heals before it steps.
The messages are the typed ``ps/membership.py`` requests, which load no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from clusterflow.cluster import ClusterSpec, TaskId
from clusterflow.manager.config import RunConfig
from clusterflow.manager.fences import cluster_credentials
from clusterflow.manager.registry import ClusterDir
from clusterflow.ps.membership import LeaveRequest, MembersRequest
from clusterflow.rpc import Credentials, RpcClient
from clusterflow.rpc.errors import RpcError

if TYPE_CHECKING:
    from clusterflow.manager.rendezvous import Rendezvous
    from clusterflow.manager.tasks import TaskTable

log = logging.getLogger(__name__)

REPLICA_JOBS = ("chief", "worker")
"""The jobs whose tasks push to the ps: each task is one replica, named ``job:index``."""

TELL_DEADLINE_S = 10.0
"""How long one ps task may take to answer: it answers at once (nothing waits on a
step), so only a dead or partitioned one runs out, and the resize goes on without it."""


def tell_ps_tasks(
    spec: ClusterSpec | None,
    credentials: Credentials,
    *,
    before: Sequence[str],
    after: Sequence[str],
    left: str | None = None,
    deadline_s: float = TELL_DEADLINE_S,
) -> dict[str, str]:
    """Tells every ps task of ``spec`` that the replicas are now ``after`` (from its next
    step), and first that ``left`` left (at once). Call it for a leaver once its process
    is gone; for newcomers before they are launched.

    ``before``: the replicas until now, for a ps told no membership yet (it counted its
    steps by number, ``MembersRequest.previous``).

    Returns:
        The ps addresses that did not take it, with why. Such a ps keeps its old
        membership: its steps wait for a leaver until the failure policy acts, and
        refuse a newcomer's pushes (never counted, so never applied twice).
    """
    if spec is None or "ps" not in spec.jobs or not after:
        return {}
    addresses = [spec.task_address("ps", i) for i in spec.task_indices("ps")]
    requests: list[LeaveRequest | MembersRequest] = []
    if left is not None:
        requests.append(LeaveRequest(worker=left))
    requests.append(MembersRequest(workers=tuple(after), previous=tuple(before)))

    def tell(address: str) -> str | None:
        try:
            with RpcClient(address, credentials, deadline=deadline_s) as client:
                for request in requests:
                    body, _ = request.to_wire()
                    client.call(f"ps.{request.METHOD}", body)
        except RpcError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(min(len(addresses), 16), thread_name_prefix="ps-members") as pool:
        answers = dict(zip(addresses, pool.map(tell, addresses), strict=True))
    missed = {a: why for a, why in answers.items() if why is not None}
    for address, why in missed.items():
        log.warning("ps %s did not take the membership %s: %s", address, list(after), why)
    return missed


class Resizing(Protocol):
    """What the two calls below read of the manager (``Elastic``, in the controller)."""

    cluster: ClusterDir
    config: RunConfig
    tasks: TaskTable
    rendezvous: Rendezvous


def replicas(manager: Resizing) -> list[str]:
    """The replicas of the task table now, by task name (as a worker names its pushes)."""
    return [str(t) for t in manager.tasks if t.job in REPLICA_JOBS]


def joining(manager: Resizing, added: Sequence[TaskId]) -> None:
    """``added`` are about to be launched: every ps waits for them from its next step."""
    now = replicas(manager)
    _tell(manager, before=now, after=[*now, *(str(t) for t in added if str(t) not in now)])


def leaving(manager: Resizing, left: TaskId) -> None:
    """``left`` is gone (its process exited, it is out of the task table): no step of any
    ps waits for it from now on."""
    after = replicas(manager)
    _tell(manager, before=[*after, str(left)], after=after, left=str(left))


def _tell(
    manager: Resizing, *, before: list[str], after: list[str], left: str | None = None
) -> None:
    spec = manager.rendezvous.current()[0]
    if spec is None or "ps" not in spec.jobs:
        return  # all-reduce, pipelines: no step of theirs is a ps's
    credentials = cluster_credentials(manager.cluster, manager.config)
    missed = tell_ps_tasks(spec, credentials, before=before, after=after, left=left)
    if missed:  # an event, and on: the failure policy acts on a dead ps by itself
        manager.cluster.append_event(
            "ps_members_missed", members=after, left=left, ps=sorted(missed)
        )
