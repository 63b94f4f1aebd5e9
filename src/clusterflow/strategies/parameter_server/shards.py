"""The worker's shards of a parameter-server model: declaring them, pulling, slicing.

What ``ParameterServerStrategy`` does to move tensors between its local model and the
ps tasks, as functions of a connection and the variables it tracks: kept apart so the
strategy holds the order of calls (pull, step, push, settle) and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clusterflow.ps.api import Placement, PSConfig, Shard, VariableSpec, VersionTimeout
from clusterflow.ps.client import PSConnection, send
from clusterflow.ps.optimizer import OptimizerSpec
from clusterflow.ps.protocol import (
    STATE,
    CreateRequest,
    OptimizerRequest,
    PSState,
    PullRequest,
    PushReply,
    PushRequest,
    QuiesceRequest,
    VersionReply,
    WaitVersionRequest,
)
from clusterflow.ps.wire import Tensors
from clusterflow.rpc.codec import Framed
from clusterflow.strategies.parameter_server.staging import HostStaging
from clusterflow.strategies.variables import Recorded

Values = tuple[list[int], dict[str, torch.Tensor]]
"""Per ps task the version pulled, and every shard's value by shard name."""


@dataclass(slots=True)
class TrackedVar:
    """A local tensor whose value lives on the ps tasks, as ``shards``."""

    tensor: torch.Tensor
    spec: VariableSpec
    shards: tuple[Shard, ...]


@dataclass(frozen=True, slots=True)
class Push:
    """One replica's step, as it goes to every ps task (a message per task)."""

    worker: str
    versions: list[int]
    """Per ps task, the version the gradients were computed from."""
    grads: list[Tensors]
    buffers: list[Tensors]
    hyper: list[Any]
    keys: tuple[tuple[str, int, int], ...]

    def _request(
        self, index: int, version: int, dtype: str, deadline: float, *, commit: bool, sync: bool
    ) -> PushRequest:
        return PushRequest(
            worker=self.worker,
            version=version,
            grads=self.grads[index],
            buffers=self.buffers[index],
            hyper=self.hyper,
            commit=commit,
            keys=self.keys,
            want_values=not sync,
            values_dtype=dtype,
            timeout=deadline,
        )

    def sync(self, ps: PSConnection, step: int, dtype: str, deadline: float) -> list[PushReply]:
        """To every other shard first, then to ps 0 with ``commit``: ps 0 decides the step
        once the gradients are buffered everywhere. Replies in ps order."""

        def push(index: int) -> PushReply:
            request = self._request(index, step, dtype, deadline, commit=index == 0, sync=True)
            return ps.push(index, request)

        replies = ps.map(push, [i for i in range(ps.num_ps) if i != 0])
        return [push(0), *replies]

    def async_(self, ps: PSConnection, dtype: str, deadline: float) -> list[PushReply]:
        """To every shard at once; each applies on arrival and sends its values back."""

        def push(index: int) -> PushReply:
            version = self.versions[index]
            request = self._request(index, version, dtype, deadline, commit=False, sync=False)
            return ps.push(index, request)

        return ps.map(push, range(ps.num_ps))


def specs_of(items: Sequence[Recorded]) -> list[VariableSpec]:
    return [
        VariableSpec(
            name=item.name,
            shape=tuple(item.tensor.shape),
            dtype=str(item.tensor.dtype).removeprefix("torch."),
            trainable=item.trainable,
            device=item.device,
        )
        for item in items
    ]


def shard_of(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    return tensor if shard.whole else tensor[shard.start : shard.stop]


def declare(
    ps: PSConnection, placement: Placement, tracked: Sequence[TrackedVar], config: PSConfig
) -> None:
    """Creates every shard on its ps task with the local initial value (first one wins).

    A ps task that holds no shard (more ps tasks than variables) is created empty all
    the same: every push goes to every ps task, and an empty one answers it (its
    version and the split keys it settled) instead of refusing it.
    """
    by_name = {v.spec.name: v for v in tracked}

    def create(index: int) -> None:
        shards = placement.on_ps(index)
        decl: list[Mapping[str, Any]] = [
            {
                "name": s.name,
                "shape": list(s.shape),
                "dtype": by_name[s.variable].spec.dtype,
                "trainable": by_name[s.variable].spec.trainable,
            }
            for s in shards
        ]
        values = {s.name: shard_of(by_name[s.variable].tensor.detach(), s) for s in shards}
        send(ps, index, CreateRequest(config=config, variables=decl, values=values))

    ps.map(create, range(ps.num_ps))


def pull_all(
    ps: PSConnection, min_versions: list[int], *, sync: bool, dtype: str, deadline: float
) -> Values:
    """Pulls every shard; in sync mode, all at one version.

    ps 0 applies a step before it fans the step out, so a pull in between sees ps 0
    one version ahead of the others. Gradients from such mixed values must not join
    a step: lagging shards are pulled again up to the newest version seen (they
    reach it as soon as the fan-out lands, since no shard runs ahead of ps 0).
    """

    def pull(index: int, min_version: int) -> tuple[int, dict[str, torch.Tensor]]:
        request = PullRequest(min_version=min_version, dtype=dtype, timeout=deadline)
        reply = ps.pull(index, request)
        return reply.version, reply.values

    results = ps.map(lambda i: pull(i, min_versions[i]), range(ps.num_ps))
    if sync:
        newest = max(r[0] for r in results)
        for _ in range(3):
            lagging = [i for i, r in enumerate(results) if r[0] < newest]
            if not lagging:
                break
            repulled = ps.map(functools.partial(_pull_at, pull, newest), lagging)
            for i, again in zip(lagging, repulled, strict=True):
                results[i] = again
            newest = max(r[0] for r in results)
    values: dict[str, torch.Tensor] = {}
    for _, tensors in results:
        values.update(tensors)
    return [r[0] for r in results], values


def _pull_at(pull: Callable[[int, int], Any], version: int, index: int) -> Any:
    return pull(index, version)


def load_into(
    tracked: Iterable[TrackedVar],
    values: dict[str, Any],
    staging: HostStaging | None = None,
) -> None:
    """Copies pulled shard values into the local tensors (through ``staging``'s pinned
    buffers for tensors on a device, waiting once for all of them).

    A value may be a ``codec.Framed`` (``RemotePS`` asks for them): each of its frames
    is written straight from the received memory into its slice of the parameter, and
    each shard into its rows of the parameter, so a pulled byte is copied once between
    the socket and the model (joining the frames first, then the shards, were two more).
    """
    with torch.no_grad():
        for var in tracked:
            for shard in var.shards:
                value = values[shard.name]
                target = shard_of(var.tensor, shard)
                if staging is not None:
                    staging.to_device(shard.name, target, value)
                elif isinstance(value, Framed) and target.is_contiguous():
                    value.copy_into(target)
                else:
                    target.copy_(value.join() if isinstance(value, Framed) else value)
        if staging is not None:
            staging.wait()


def tracked_in(
    optimizer: torch.optim.Optimizer, by_tensor: dict[int, TrackedVar]
) -> list[tuple[int, TrackedVar]]:
    """(group index, variable) of each parameter of ``optimizer`` that is a ps variable."""
    return [
        (g, by_tensor[id(p)])
        for g, group in enumerate(optimizer.param_groups)
        for p in group["params"]
        if id(p) in by_tensor
    ]


def gradients(
    tracked: Iterable[TrackedVar],
    num_ps: int,
    wire_dtype: str,
    staging: HostStaging | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per ps task, the gradient of each shard it holds (cast to the wire dtype).

    With ``staging``, a gradient on a device is cast there (bf16 halves the copy too)
    and copied into a reused pinned host buffer; all copies are waited on once, here.
    """
    per_ps: list[dict[str, torch.Tensor]] = [{} for _ in range(num_ps)]
    if staging is not None:
        staging.begin_push()
    for var in tracked:
        grad = var.tensor.grad
        if grad is None or not var.spec.trainable:
            continue
        grad = grad.detach()
        if wire_dtype == "bfloat16" and grad.is_floating_point():
            grad = grad.to(torch.bfloat16)
        for shard in var.shards:
            part = shard_of(grad, shard)
            per_ps[shard.ps][shard.name] = (
                part if staging is None else staging.to_host(shard.name, part)
            )
    if staging is not None:
        staging.wait()
    return per_ps


def buffers(tracked: Iterable[TrackedVar], num_ps: int) -> list[dict[str, torch.Tensor]]:
    """Per ps task, the values of non-trainable variables (the chief's batch-norm stats).

    Copies: the next forward updates buffers in place while a background push may still
    be sending them.
    """
    per_ps: list[dict[str, torch.Tensor]] = [{} for _ in range(num_ps)]
    for var in tracked:
        if not var.spec.trainable:
            for shard in var.shards:
                per_ps[shard.ps][shard.name] = shard_of(var.tensor.detach(), shard).clone()
    return per_ps


def register_optimizer(
    ps: PSConnection, optimizer: torch.optim.Optimizer, tracked: Sequence[tuple[int, TrackedVar]]
) -> None:
    """Builds ``optimizer`` on every ps task over its shards of the ``(group, var)`` pairs."""
    group_of = {shard.name: g for g, var in tracked for shard in var.shards}
    request = OptimizerRequest(spec=OptimizerSpec.of(optimizer), group_of=group_of)
    ps.map(lambda i: send(ps, i, request), range(ps.num_ps))


def wait_for_version(ps: PSConnection, version: int, deadline: float) -> None:
    """Waits, in rounds shorter than the call deadline, until ps 0 reached ``version``
    (the chief's warm-up steps).

    Each round is bounded on both sides (the ps gives up waiting before the client
    does), so a dead ps fails the worker within one deadline, while a long warm-up
    just takes more rounds.

    Raises:
        RpcError, PSError: the ps failed otherwise than by a round running out.
    """
    request = WaitVersionRequest(version=version, timeout=deadline / 2)
    while True:
        try:
            send(ps, 0, request)
            return
        except VersionTimeout:
            # A round that ran out: raised here (CentralStorage, in process), or a ps's
            # answer, typed by its wire code. Anything else is a real failure.
            continue


# The consistent cut ----------------------------------------------------------------


def hold_all(ps: PSConnection, timeout: float = 60.0) -> list[int]:
    """Holds every ps task's updates (pushes wait, none in flight); their versions.

    ps 0 first: it decides sync steps and fans each out to the other shards, and its
    quiesce waits for that fan-out, so once it holds no shard can still move. The
    calls go one by one on the control connections, never through the pool: in sync
    mode the pool's threads may be waiting in a prefetch for a step that cannot
    finish until this checkpoint lets the held pushes through.
    """
    request = QuiesceRequest(timeout=timeout)
    return [VersionReply.from_wire(*send(ps, i, request)).version for i in range(ps.num_ps)]


def states(ps: PSConnection) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Every ps task's full state (variables, slots, version, applied split keys)."""
    return [send(ps, i, STATE) for i in range(ps.num_ps)]


def load_states(
    ps: PSConnection, loaded: Sequence[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]
) -> None:
    """Replaces every ps task's state with a checkpoint's."""
    ps.map(
        lambda i: send(ps, i, PSState(meta=dict(loaded[i][0]), tensors=dict(loaded[i][1]))),
        range(ps.num_ps),
    )
