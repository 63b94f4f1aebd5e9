"""All-reduce strategies: ``MultiWorkerMirroredStrategy`` and ``MirroredStrategy``.

One process per device (docs/architecture.md section 5); each process is one replica, holding
a full copy of the model. Gradients are all-reduced by ``DistributedDataParallel``
(bucketed, overlapped with the backward pass), over the group that
:mod:`clusterflow.collective` forms from the launcher's environment.

Use, as with ``tf.distribute``::

    strategy = MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = Net()                      # broadcast from rank 0, wrapped in DDP
    optimizer = torch.optim.Adam(model.parameters())

    def step(x, y):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)        # this replica's rows of the global batch
        loss.backward()                    # gradients all-reduced (mean) during backward
        optimizer.step()
        return loss.detach()

    for x, y in strategy.distribute(global_batches, global_batch_size=128):
        loss = strategy.reduce("mean", strategy.run(step, (x, y)))
    strategy.save_model(model, "model.pt")  # every replica calls it; the chief writes

Order: build the strategy, create the model in ``scope()`` (or call ``prepare``), create
the optimizer from ``model.parameters()``, then one ``run`` per step. Every replica must
make the same collective calls (``run`` with a backward, ``reduce``, ``save_model``,
``barrier``) in the same order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from clusterflow.cluster import TFConfig
from clusterflow.collective import (
    CommunicationOptions,
    Membership,
    MembershipError,
)
from clusterflow.strategies.all_reduce import CollectiveAllReduceStrategy
from clusterflow.strategies.api import (
    Strategy,
)
from clusterflow.strategies.resizing import (
    ElasticBatch,
    check_elastic_batch,
    join_if_added,
)
from clusterflow.strategies.resolver import (
    ClusterResolver,
    TFConfigClusterResolver,
    checked_resolver,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from clusterflow.collective.elastic import Generation

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy"]

_log = logging.getLogger(__name__)

_active_scope: Strategy | None = None
# Gradients as views into DDP's buckets: one copy fewer per step and per parameter.
_GRADIENT_AS_BUCKET_VIEW: Final = True


class MultiWorkerMirroredStrategy(CollectiveAllReduceStrategy):
    """One replica per task of the cluster's chief and worker jobs, across hosts.

    The cluster comes from ``cluster_resolver``, else ``TF_CONFIG``, else torchrun's
    variables; with none, a single replica (the same script runs alone). The group forms
    here: this blocks until every replica has started, at most
    ``communication_options.rendezvous_timeout_seconds``.

    In an elastic cluster (``clusterflow start --workers MIN:MAX``) trained through
    ``fit`` or a ``TrainingSession``, the group resizes live at step boundaries
    (``clusterflow scale``; ``strategies/resizing.py``). A worker added to a running
    cluster joins the group the others re-form and receives their state.

    Args:
        communication_options: backend, timeouts, bucket size and gradient compression.
        cluster_resolver: the cluster (default: ``TF_CONFIG``).
        elastic_batch: what a resize keeps: ``"global"`` (the default) the global batch
            (each replica's data-service batch becomes its share), ``"per_replica"``
            each replica's batch, with every learning rate scaled by
            ``world / initial world``.

    Raises:
        MembershipError: the launcher's variables and the cluster spec disagree (a
            ``WORLD_SIZE`` or ``RANK`` that is not the spec's), or this task is a ps.
        CollectiveError: the replicas did not all join in time (naming the missing).
        StrategyError: ``elastic_batch`` is neither policy.
    """

    def __init__(
        self,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver: ClusterResolver | None = None,
        *,
        elastic_batch: ElasticBatch = "global",
    ) -> None:
        resolver = checked_resolver(cluster_resolver, "MultiWorkerMirroredStrategy")
        if resolver is None and TFConfig.from_env() is not None:
            resolver = TFConfigClusterResolver()
        options = communication_options or CommunicationOptions()
        membership, store, joined = _replicas(resolver, options, elastic_batch)
        super().__init__(
            membership,
            communication_options=options,
            cluster_resolver=resolver,
            elastic_batch=elastic_batch,
            store=store,
            joined=joined,
        )


class MirroredStrategy(CollectiveAllReduceStrategy):
    """One replica per device of this host, each in its own process.

    TensorFlow's ``MirroredStrategy`` drives every local GPU from one process; here one
    process runs each device (as torchrun and DDP do), launched together by
    ``clusterflow start`` (or torchrun), and this strategy joins the processes of this
    host: ``LOCAL_RANK`` picks this process's device from ``devices``. A lone process is a
    single replica.

    Args:
        devices: the host's devices, one per process, in TensorFlow's syntax (``"/gpu:0"``)
            or torch's (``"cuda:0"``); default: this process's GPU, else the CPU.
        communication_options: backend, timeout, bucket size and gradient compression.
        elastic_batch: what a live resize keeps (see :class:`MultiWorkerMirroredStrategy`).

    Raises:
        MembershipError: the replicas span more than one host (use
            :class:`MultiWorkerMirroredStrategy`), or ``devices`` does not list one
            device per local process.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        communication_options: CommunicationOptions | None = None,
        *,
        elastic_batch: ElasticBatch = "global",
    ) -> None:
        config = TFConfig.from_env()
        resolver = TFConfigClusterResolver() if config is not None else None
        options = communication_options or CommunicationOptions()
        membership, store, joined = _replicas(resolver, options, elastic_batch)
        if membership.local_world_size != membership.world_size:
            raise MembershipError(
                f"MirroredStrategy mirrors the replicas of one host, but this cluster has "
                f"{membership.world_size} replicas and this host runs "
                f"{membership.local_world_size}; use MultiWorkerMirroredStrategy"
            )
        super().__init__(
            membership,
            communication_options=options,
            devices=devices,
            cluster_resolver=resolver,
            elastic_batch=elastic_batch,
            store=store,
            joined=joined,
        )


def _replicas(
    resolver: ClusterResolver | None, options: CommunicationOptions, elastic_batch: ElasticBatch
) -> tuple[Membership, TCPStore | None, Generation | None]:
    """Who the replicas are, for both strategies. A worker added by ``clusterflow
    scale`` joins the generation the others form (its ``TF_CONFIG`` and ``WORLD_SIZE``
    describe the cluster when it registered); any other reads its launcher's
    environment."""
    check_elastic_batch(elastic_batch)
    task = resolver.task if resolver else None
    membership, store, joined = join_if_added(os.environ, task, options)
    if membership is None:
        spec = resolver.cluster_spec() if resolver else None
        membership = Membership.from_env(os.environ, spec, task)
    return membership, store, joined
