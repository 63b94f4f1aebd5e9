"""The Ray backend: places a cluster's tasks on a Ray cluster and launches each one there.

Every task runs as a Ray actor hosting its supervisor (``ray_actor``: ``SupervisorHost``
on the node, ``RayProcess`` the manager's handle); this module decides where and with
what: one placement group for the whole cluster at its start (``ray_placement``), a
group per grow of an elastic cluster (``reserve``, released as its workers leave),
each job's memory request sized from what it used and grown after a kill for memory,
and the environment a task gets on its node.

The manager is the actors' owner: if it dies, Ray ends them, and their supervisors stop
their jobs once the manager stops answering (``CLUSTERFLOW_MANAGER_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from clusterflow.backends.api import TaskLaunch
from clusterflow.backends.memory_watch import within_run
from clusterflow.backends.ray_actor import (
    NODE_LOCAL,
    OwnActor,
    RayProcess,
    actor_class,
    largest_node_memory,
)
from clusterflow.backends.ray_placement import TaskRequest
from clusterflow.cluster import TaskId
from clusterflow.cluster.contract import ENV_SECRET_FILE, ENV_STANDBY
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id (``ray.util.placement_group``)."""

OOM_GROWTH = 1.5
"""How much more memory a job asks for after one of its tasks was killed for memory."""


class RayBackend:
    """Starts each task's supervisor in its bundle of the cluster's placement group.

    When the whole cluster is relaunched (a restart from the last checkpoint), each job
    asks anew: a job one of whose tasks was killed for outgrowing its memory asks for
    1.5 times as much (bounded by the largest node); a job sized automatically asks for
    the peak its tasks reached so far in this run x ``HEADROOM``
    (``memory_sizing.within_run``); and the placement group is made anew when a size
    changed, since a group's bundles cannot change. A task respawned alone, beside tasks
    still running, goes back into its bundle as it was (sized at the last whole
    placement). A standby holds no bundle; the task it takes over is held to the size
    ``within_run`` gives at that moment.

    Args:
        requests: one per task, in the placement group's bundle order.
        group: the cluster's placement group (``ray_placement.reserve``).
        name: the group's name (for a group made anew).
        placement_timeout_s: how long a group made anew may take to be placed.
    """

    name = "ray"

    def __init__(
        self,
        requests: Sequence[TaskRequest],
        group: Any,
        *,
        name: str = "",
        placement_timeout_s: float = 60.0,
    ) -> None:
        self._requests = {r.task: r for r in requests}
        self._order = [r.task for r in requests]
        self._bundles = {r.task: i for i, r in enumerate(requests)}
        self._group = group
        self._group_name = name
        self._placement_timeout_s = placement_timeout_s
        self._grown: set[int] = set()
        """Processes (by id) whose OOM kill already made their job's memory grow."""
        self._grown_jobs: set[str] = set()
        """Jobs whose memory a kill for memory grew (never asked for less after)."""
        self._grown_groups: dict[TaskId, Any] = {}
        """A task a grow added: the placement group of its change (``reserve``)."""
        self._unplaced: dict[TaskId, tuple[Any, int]] = {}
        """Bundles a grow reserved whose task is not launched yet: (group, index)."""
        self._left: set[TaskId] = set()
        """Tasks of the start that left (a shrink): their bundles of the cluster's group
        stay held (a group's bundles cannot be released one by one) for a later grow."""
        self._changes = 0
        self._launches = 0
        """Launches through agents so far: each one's key on its agent is unique."""
        self._lock = threading.Lock()
        self._processes: dict[str, RayProcess] = {}
        """The current process of each task (standbys are not a task's until they take one)."""
        self._all: list[RayProcess] = []

    def launch(self, launch: TaskLaunch) -> RayProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._take_reserved(launch.task)
        request = self._requests.get(launch.task)
        if request is None:
            raise ConfigError(f"task {launch.task} has no place in this cluster")
        secret_file = launch.env.get(ENV_SECRET_FILE)
        if not secret_file:
            raise ConfigError(f"{launch.task}: launched without {ENV_SECRET_FILE}")
        with open(secret_file) as f:
            secret = f.read()
        # What the manager added to its own environment is the task's; the rest of the
        # manager's environment belongs to its node, and the actor's node has its own.
        env = {
            k: v for k, v in launch.env.items() if os.environ.get(k) != v and k not in NODE_LOCAL
        }
        standby = launch.env.get(ENV_STANDBY) == "1"
        if not standby:
            self._resize_for_relaunch()
            request = self._requests[launch.task]
        if standby:
            # A standby waits idle beside the running tasks, whose bundles are all taken:
            # it holds nothing, on a node the job's labels select, until it takes a task;
            # on a node none of the job's tasks runs on when there is one, so that a node
            # that dies does not take the standby with the task it is to replace.
            labels = dict(request.labels)
            options: dict[str, Any] = {"num_cpus": 0, "label_selector": labels}
            busy = self._nodes_of(launch.task.job)
            if busy:
                elsewhere = f"!in({','.join(sorted(busy))})"
                options["label_selector"] = {**labels, NODE_ID_LABEL: elsewhere}
                options["fallback_strategy"] = [{"label_selector": labels}]
        else:
            bundle = request.bundle()
            options = {
                "num_cpus": bundle.get("CPU", 0.0),
                "num_gpus": bundle.get("GPU", 0.0),
                "memory": bundle.get("memory") or None,
                "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self._grown_groups.get(launch.task, self._group),
                    placement_group_bundle_index=self._bundles[launch.task],
                ),
            }
        if standby:
            # It holds no bundle, but is held to what the task it takes over would ask
            # for now (``adopt`` sets it again when it takes one).
            request = self._sized(request)
        limit = request.bundle().get("memory")
        host: Any
        if not standby and self._by_agent(request):
            from clusterflow.backends.ray_agent import AgentSlot

            # The group reserved the bundle; the node's agent starts the supervisor there.
            with self._lock:
                self._launches += 1
                key = f"{self._group_name}/{launch.task}/{self._launches}"
            host = AgentSlot(
                key,
                options["scheduling_strategy"].placement_group,
                options["scheduling_strategy"].placement_group_bundle_index,
                (str(launch.task), env, secret, limit, request.bundle()),
            )
        else:
            host = OwnActor(
                actor_class()
                .options(name=None, **options)
                .remote(str(launch.task), env, secret, limit)
            )
        process = RayProcess(launch.task, host, request)
        with self._lock:
            self._all.append(process)
            if not standby:
                self._processes[str(launch.task)] = process
        return process

    def _by_agent(self, request: TaskRequest) -> bool:
        """Whether a node's agent hosts the task (``ray_agent``): agents are enabled on
        this Ray cluster, the task asks for no GPU (Ray assigns GPUs only to processes
        it starts) and the run has no runtime environment (``--job-dir``: Ray unpacks
        it only for the run's own workers)."""
        if request.bundle().get("GPU") or self._runtime_env():
            return False
        from clusterflow.backends import ray_agent

        return ray_agent.enabled()

    @staticmethod
    def _runtime_env() -> bool:
        import ray

        with contextlib.suppress(Exception):
            return bool(dict(ray.get_runtime_context().runtime_env or {}))
        return True

    def job_peak(self, job: str) -> float:
        """The largest peak memory any task of ``job`` reached so far in this run."""
        with self._lock:
            processes = list(self._all)
        return float(max((p.memory_peak for p in processes if p.task.job == job), default=0))

    def _sized(self, request: TaskRequest, largest: float = 0.0) -> TaskRequest:
        """``request`` with an automatic memory sized by this run's peak so far."""
        asked = request.resources.get("memory")
        if request.memory_named or not asked:
            return request
        job = request.task.job
        memory = within_run(
            float(asked),
            self.job_peak(job),
            before=request.memory_before,
            grown=job in self._grown_jobs,
            largest=largest,
        )
        return replace(request, resources={**request.resources, "memory": memory})

    def _resize_for_relaunch(self) -> None:
        """Before a relaunch of every task: each job's memory asked anew (see the class)."""
        from ray.util.placement_group import remove_placement_group

        from clusterflow.backends.ray_placement import reserve

        with self._lock:
            processes = list(self._processes.values())
        if not processes or any(p.poll() is None for p in processes):
            return  # the first launch, or a relaunch already under way
        killed = [p for p in processes if p.oom and id(p) not in self._grown]
        largest = largest_node_memory()
        # The start's tasks only: a grow's tasks keep the group of their change.
        grown = {t: self._sized(self._requests[t], largest) for t in self._order}
        for process in killed:
            self._grown.add(id(process))
            self._grown_jobs.add(process.task.job)
            had = process.memory_asked or float(process.memory_peak)
            more = min(had * OOM_GROWTH, largest) if largest else had * OOM_GROWTH
            for task, other in grown.items():
                if task.job == process.task.job:
                    grown[task] = replace(other, resources={**other.resources, "memory": more})
            log.warning(
                "%s was killed for memory (%d bytes asked); job %s now asks %d",
                process.task, had, process.task.job, more,
            )  # fmt: skip
        if all(grown[t] == self._requests[t] for t in grown):
            return
        for task, request in grown.items():
            if request != self._requests[task]:
                log.info("%s asks %s now", task, request.describe(["memory"]))
        remove_placement_group(self._group)
        self._group = reserve(
            [grown[t] for t in self._order], self._group_name, self._placement_timeout_s
        )
        self._requests = {**self._requests, **grown}

    def reserve(self, tasks: Sequence[TaskId]) -> None:
        """Places the tasks a grow adds, before any is launched: one placement group for
        the change (gang-scheduled: all of them or none), never one sized for MAX held
        from the start. A task of the start that left in a shrink takes its bundle of the
        cluster's group again instead. Blocks until Ray placed them, at most the
        placement timeout.

        Raises:
            PlacementError: they cannot be placed (no node has the room, or it was not
                free in time); nothing is held then, and the cluster is untouched.
        """
        from clusterflow.backends.ray_placement import reserve

        if not tasks:
            return
        with self._lock:
            template = next(r for t, r in self._requests.items() if t.job == tasks[0].job)
            fresh = [t for t in tasks if t not in self._left]
            self._left -= set(tasks)
        if not fresh:
            return
        requests = [replace(self._sized(template), task=t) for t in fresh]
        self._changes += 1
        name = f"{self._group_name}-grow-{self._changes}"
        group = reserve(requests, name, self._placement_timeout_s)  # raises: nothing held
        with self._lock:
            for index, request in enumerate(requests):
                self._requests[request.task] = request
                self._unplaced[request.task] = (group, index)
        log.info("%s placed for %s", name, ", ".join(map(str, fresh)))

    def _take_reserved(self, task: TaskId) -> None:
        """A grow's task is launched: it runs in the bundle ``reserve`` placed for it."""
        with self._lock:
            found = self._unplaced.pop(task, None)
            if found is None and task not in self._requests:
                # Named otherwise when reserved (a worker lost in between): same job, same room.
                other = next((t for t in self._unplaced if t.job == task.job), None)
                if other is not None:
                    found = self._unplaced.pop(other)
                    self._requests[task] = replace(self._requests.pop(other), task=task)
            if found is not None:
                self._grown_groups[task], self._bundles[task] = found

    def release(self, task: TaskId) -> None:
        """``task`` left the cluster (a shrink, or lost above MIN), after it stopped: its
        actor ends, and the placement group of the grow that added it is removed once
        none of that change's tasks is left. A task of the start keeps its bundle of the
        cluster's group for a later grow (``reserve``)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            process = self._processes.pop(str(task), None)
            group = self._grown_groups.pop(task, None) or self._unplaced.pop(task, (None, 0))[0]
            if group is None:
                self._left.add(task)
            else:
                self._requests.pop(task, None)
                self._bundles.pop(task, None)
            still = [*self._grown_groups.values(), *(g for g, _ in self._unplaced.values())]
        if process is not None:
            process.end()
        if group is not None and all(g is not group for g in still):
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            log.info("the placement group of %s's grow was released", task)

    def job_env(self, task: TaskId) -> dict[str, str]:
        return {}  # Ray sets each actor's CUDA_VISIBLE_DEVICES itself

    def _nodes_of(self, job: str) -> set[str]:
        """The nodes the job's current tasks run on (those placed so far)."""
        with self._lock:
            processes = [p for t, p in self._processes.items() if TaskId.parse(t).job == job]
        return {str(p.placement["node_id"]) for p in processes if p.placement is not None}

    def adopt(self, process: Any, task: TaskId) -> None:
        """A standby took ``task`` over: its node is the task's now (``placements``), and
        it is held to the memory the task would ask for now (``_sized``)."""
        with self._lock:
            self._processes[str(task)] = process
        request = self._requests.get(task)
        if request is not None and isinstance(process, RayProcess):
            process.hold_to(self._sized(request))

    def placements(self) -> dict[str, dict[str, Any]]:
        """Each task's node and resources, as its current actor reported them."""
        with self._lock:
            processes = dict(self._processes)
        out = {}
        for task, process in processes.items():
            where = process.placement
            if where is not None:
                where.pop("pid", None)
                out[task] = where
        return out

    def close(self) -> None:
        """Ends every actor still there and releases the cluster's placement groups (the
        start's and each grow's)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            processes, self._all = self._all, []
        for process in processes:
            process.end()
        deadline = time.monotonic() + 10.0
        for process in processes:
            process.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            groups = [self._group, *self._grown_groups.values()]
            groups += [g for g, _ in self._unplaced.values()]
            self._grown_groups.clear()
            self._unplaced.clear()
        for group in {id(g): g for g in groups}.values():
            with contextlib.suppress(Exception):
                remove_placement_group(group)
