"""``ClusterCoordinator``: the chief schedules functions on the workers (TensorFlow 2's form).

Every task runs the same script. Worker tasks serve; the chief builds the strategy and
the model, and schedules steps::

    resolver = TFConfigClusterResolver()
    if resolver.task_type == "worker":
        serve_worker()                      # blocks until the coordinator closes
        sys.exit(0)
    strategy = ParameterServerStrategy(resolver)
    with strategy.scope():
        model = Net()                       # variables go to the ps tasks
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()                    # gradients pushed to the ps, applied there
        optimizer.zero_grad()
        return loss.item()

    with ClusterCoordinator(strategy) as coordinator:
        losses = [coordinator.schedule(step, args=batch) for batch in batches]
        coordinator.join()
        print([loss.fetch() for loss in losses])
        coordinator.pull_variables()        # the chief's model now holds the trained values

``schedule`` returns a ``RemoteValue`` at once. A function whose arguments hold
``RemoteValue`` s waits until every one of them is ready (a dependency counter per
function: TensorFlow's executor's dataflow rule) and then gets their values in their
place. Ready functions wait in one queue, in the order they became ready; one thread
per worker sends them, each taking the oldest as its worker frees up, so functions
start in the order they were scheduled.

A worker that fails (no answer within ``worker_timeout_s``, or gone) is probed until it
answers again; the function it was running goes back to the queue and runs on
another worker: at-least-once, as in TensorFlow, so a function may run twice when its
worker dies. An error raised by the function itself is not retried; it surfaces in
``RemoteValue.fetch()`` and in ``join()``.

The function and its arguments are pickled with cloudpickle and travel only over the
cluster's authenticated RPC channel. A function is pickled once, at its first
``schedule``, and sent once per worker; later calls send its content hash and the
arguments. The strategy's variables inside it travel as references, bound on the
worker to its own strategy (see ``worker``).

The pieces, in import order: ``api`` (what the user holds: ``RemoteValue``, the
errors, the counts), ``graph`` (the dataflow rule, pure), ``protocol`` (the
``worker.*`` wire contract, one definition for both ends), ``worker`` (the worker's
side: ``serve_worker``), ``pickling`` (what the chief sends), ``dispatch`` (one worker
as the chief sees it), ``scheduler`` (``ClusterCoordinator``).
"""

from __future__ import annotations

from clusterflow.strategies.coordinator.api import (
    CoordinatorClosed,
    CoordinatorError,
    CoordinatorStats,
    CoordinatorTimeout,
    DependencyError,
    FunctionError,
    RemoteValue,
    SerializationError,
    WorkerFailure,
)
from clusterflow.strategies.coordinator.scheduler import ClusterCoordinator
from clusterflow.strategies.coordinator.worker import serve_worker

__all__ = [
    "ClusterCoordinator",
    "CoordinatorClosed",
    "CoordinatorError",
    "CoordinatorStats",
    "CoordinatorTimeout",
    "DependencyError",
    "FunctionError",
    "RemoteValue",
    "SerializationError",
    "WorkerFailure",
    "serve_worker",
]
