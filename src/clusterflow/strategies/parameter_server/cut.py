"""The parameter-server strategy's part of a consistent checkpoint (``train/cut.py``).

Apart from the strategy because it is its own concept: who holds the ps still while the
chief writes, what a cut holds, and the one rule of restoring, that a lone respawn never
writes into a live parameter server (docs/failure-semantics.md). ``ParameterServerStrategy``
mixes it in ahead of ``Strategy``, whose ``SoloParticipant`` defaults it replaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clusterflow.checkpoint import CheckpointError
from clusterflow.checkpoint.names import ps_part
from clusterflow.ps.client import send
from clusterflow.ps.protocol import RESUME
from clusterflow.strategies.api import CutRole, Part, ReadPart
from clusterflow.strategies.parameter_server.shards import hold_all, load_states, states

if TYPE_CHECKING:
    from concurrent.futures import Future

    from clusterflow.ps.api import PSConfig
    from clusterflow.ps.client import PSConnection
    from clusterflow.strategies.parameter_server.shards import Values
    from clusterflow.strategies.parameter_server.sparse import SparseSide


class PSCut:
    """``CheckpointParticipant`` for ``ParameterServerStrategy``: the state it reads is
    the strategy's (declared below), and so are the three methods it calls."""

    _ps: PSConnection
    config: PSConfig
    _sparse: SparseSide
    _cut_versions: list[int]
    _next: Future[Values] | None
    _staged: Values | None

    if TYPE_CHECKING:

        @property
        def is_chief(self) -> bool: ...

        @property
        def worker_index(self) -> int: ...

        def flush(self) -> None: ...

        def _load_values(self) -> None: ...

        def ps_stats(self) -> list[dict[str, Any]]: ...

        def pull_values(self) -> None: ...

    @property
    def num_ps(self) -> int:
        return self._ps.num_ps

    def cut_role(self) -> CutRole:
        # Only the chief writes: a ps worker holds no state of the model, and its data
        # position is the dispatcher's leases (a common step for the workers' RNG would
        # need a barrier that async training does not have).
        return CutRole("parameter_server", rank=self.worker_index, replicas=1, holds_model=True)

    def quiesce(self) -> int:
        """Holds every ps task's updates (pushes wait, none in flight); the cut stands at
        ps 0's version, in sync mode the global step. See ``shards.hold_all``.

        Sync: first waits for this replica's last step to commit, as its next ``run``
        would. A chief that saves right after step N would otherwise hold the ps at
        N - 1 with the other replicas' last pushes waiting behind the hold, and a run
        whose last step was a save step ended with a checkpoint one step short."""
        self.flush()
        if self.config.mode == "sync" and self._next is not None:
            self._load_values()
        self._cut_versions = hold_all(self._ps)
        return self._cut_versions[0]

    def parts(self) -> list[Part]:
        """Every ps task's state: variables, slots, version, applied split keys."""
        parts = [(ps_part(i), meta, tensors) for i, (meta, tensors) in enumerate(states(self._ps))]
        return parts + self._sparse.parts()

    def cut_meta(self) -> dict[str, Any]:
        c = self.config
        meta = {"mode": c.mode, "num_ps": self._ps.num_ps, "versions": self._cut_versions}
        return meta | self._sparse.cut_meta()

    def resume(self) -> None:
        """Lets held updates through again (after :meth:`quiesce`)."""
        for index in range(self._ps.num_ps):
            send(self._ps, index, RESUME)

    def restore(self, meta: dict[str, Any], read: ReadPart, *, named: bool) -> None:
        """The ps tasks restore their shards as they start; a ps in this process
        (CentralStorageStrategy) or a cluster without the manager is loaded here.

        Only the chief loads, only when the manager did not name the checkpoint (then
        the ps tasks restored it themselves), and only into parameter servers that have
        applied nothing yet. A live ps is never written: a chief respawned alone (the
        leading worker of a cluster without a ``chief`` job) would otherwise roll back
        every update applied since the checkpoint, while the data service, rightly,
        does not hand those records out again (docs/failure-semantics.md).
        """
        num_ps = int(meta.get("num_ps", 0))
        if num_ps != self._ps.num_ps:
            raise CheckpointError(
                f"the checkpoint holds {num_ps} ps shard(s); this cluster has {self._ps.num_ps}"
            )
        if self.is_chief and not named and self._ps_fresh():
            load_states(self._ps, [read(ps_part(i)) for i in range(num_ps)])
            self._next = self._staged = None
        self._sparse.restore(meta, read)
        self.pull_values()

    def _ps_fresh(self) -> bool:
        """Whether every ps task has applied nothing (version 0): fresh processes."""
        return not any(int(s.get("version", 0)) for s in self.ps_stats())
