"""What the manager and the processes it starts agree on outside any message body.

Two tables: every environment variable a task receives (the supervisor's, the job
command's, a replica's), and the manager's RPC method names. Every module that sets or
reads one of them takes its name from here, so a name is spelled once
(``tests/unit/test_contract.py`` fails on a ``CLUSTERFLOW_*`` or ``manager.*`` literal
anywhere else in ``src/``). docs/architecture.md section 3 describes who sets what when.

Torchrun's variables (``Torchrun.RANK``, ...), ``TF_CONFIG`` and ``CUDA_VISIBLE_DEVICES``
are other projects' contracts; the manager and supervisors set them, and they are
spelled here too (the test fails on one spelled elsewhere: ``FOREIGN_NAMES``) so that
the table holds the whole environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

# The supervisor's environment (set by the manager when it launches a supervisor) ----------

ENV_MANAGER: Final = "CLUSTERFLOW_MANAGER"
ENV_SECRET_FILE: Final = "CLUSTERFLOW_SECRET_FILE"
ENV_SECRET: Final = "CLUSTERFLOW_SECRET"
ENV_AUTH: Final = "CLUSTERFLOW_AUTH"
ENV_TASK: Final = "CLUSTERFLOW_TASK"
ENV_CLUSTER_ID: Final = "CLUSTERFLOW_CLUSTER_ID"
ENV_BIND_HOST: Final = "CLUSTERFLOW_BIND_HOST"
ENV_HEARTBEAT_S: Final = "CLUSTERFLOW_HEARTBEAT_S"
ENV_REGISTER_TIMEOUT: Final = "CLUSTERFLOW_REGISTER_TIMEOUT"
ENV_MANAGER_TIMEOUT: Final = "CLUSTERFLOW_MANAGER_TIMEOUT"
ENV_STANDBY: Final = "CLUSTERFLOW_STANDBY"
ENV_ZYGOTE_READY_FD: Final = "CLUSTERFLOW_ZYGOTE_READY_FD"
ENV_FORKSERVER: Final = "CLUSTERFLOW_FORKSERVER"
ENV_WARM_FORK: Final = "CLUSTERFLOW_WARM_FORK"
ENV_PIPELINE_SHM: Final = "CLUSTERFLOW_PIPELINE_SHM"
ENV_HOME: Final = "CLUSTERFLOW_HOME"
ENV_UI_TOKEN: Final = "CLUSTERFLOW_UI_TOKEN"
ENV_HOSTS: Final = "CLUSTERFLOW_HOSTS"
ENV_RAY_JOIN_TIMEOUT: Final = "CLUSTERFLOW_RAY_JOIN_TIMEOUT"

# The job command's environment (from the manager's registration reply) --------------------

ENV_LISTEN_FD: Final = "CLUSTERFLOW_LISTEN_FD"
ENV_JOB: Final = "CLUSTERFLOW_JOB"
ENV_TASK_INDEX: Final = "CLUSTERFLOW_TASK_INDEX"
ENV_SPEC_VERSION: Final = "CLUSTERFLOW_SPEC_VERSION"
ENV_STATE_DIR: Final = "CLUSTERFLOW_STATE_DIR"
ENV_CHECKPOINT_DIR: Final = "CLUSTERFLOW_CHECKPOINT_DIR"
ENV_RESTORE: Final = "CLUSTERFLOW_RESTORE"
ENV_ATTEMPT: Final = "CLUSTERFLOW_ATTEMPT"
ENV_INCARNATION: Final = "CLUSTERFLOW_INCARNATION"
ENV_REPLICA: Final = "CLUSTERFLOW_REPLICA"
ENV_DISPATCHER: Final = "CLUSTERFLOW_DISPATCHER"
ENV_TRIAL_PARAMS: Final = "CLUSTERFLOW_TRIAL_PARAMS"
ENV_TRIAL_REPORT: Final = "CLUSTERFLOW_TRIAL_REPORT"
ENV_TRIAL_REPORTER: Final = "CLUSTERFLOW_TRIAL_REPORTER"
ENV_CACHE: Final = "CLUSTERFLOW_CACHE"
ENV_NODE: Final = "CLUSTERFLOW_NODE"
GLOO_IFNAME: Final = "GLOO_SOCKET_IFNAME"
"""torch's gloo binds and advertises the address of the host name unless told an
interface; where the host name resolves to loopback, peers on other nodes cannot reach
it. The Ray backend names the interface of the node's address (``backends/ray_actor.py``)."""

# Other projects' variables: spelled here once too -----------------------------------------

TF_CONFIG: Final = "TF_CONFIG"
"""TensorFlow's cluster spec and this task, as JSON (``cluster/tf_config.py``)."""
TF_GRPC_REUSE_PORT: Final = "TF_GRPC_REUSE_PORT"
CUDA_VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
"""The GPUs a process may see: set per replica by the supervisor, per trial by tune."""
PYTHONUNBUFFERED: Final = "PYTHONUNBUFFERED"


class Torchrun:
    """torchrun's variables, which the manager sets so an unmodified torchrun script runs
    (``manager/job_env.py``) and ``collective/membership.py`` reads."""

    RANK: Final = "RANK"
    WORLD_SIZE: Final = "WORLD_SIZE"
    LOCAL_RANK: Final = "LOCAL_RANK"
    LOCAL_WORLD_SIZE: Final = "LOCAL_WORLD_SIZE"
    GROUP_RANK: Final = "GROUP_RANK"
    GROUP_WORLD_SIZE: Final = "GROUP_WORLD_SIZE"
    ROLE_RANK: Final = "ROLE_RANK"
    ROLE_WORLD_SIZE: Final = "ROLE_WORLD_SIZE"
    MASTER_ADDR: Final = "MASTER_ADDR"
    MASTER_PORT: Final = "MASTER_PORT"
    USE_AGENT_STORE: Final = "TORCHELASTIC_USE_AGENT_STORE"
    RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"
    MAX_RESTARTS: Final = "TORCHELASTIC_MAX_RESTARTS"


FOREIGN_NAMES: Final = frozenset(
    {TF_CONFIG, TF_GRPC_REUSE_PORT, CUDA_VISIBLE_DEVICES, PYTHONUNBUFFERED, GLOO_IFNAME}
    | {v for k, v in vars(Torchrun).items() if k.isupper()}
)
"""The variables of other projects that tasks receive; ``tests/unit/test_contract.py``
fails on one of them spelled as a literal anywhere else in ``src/``."""

Receiver = Literal["supervisor", "job", "replica", "user"]


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable of a task's environment."""

    receiver: Receiver
    """Who is given it: the supervisor (and, inherited, its job), the job command, each
    replica process of a task, or nobody (a user sets it)."""
    meaning: str


TASK_ENVIRONMENT: Final[Mapping[str, EnvVar]] = MappingProxyType(
    {
        ENV_MANAGER: EnvVar("supervisor", "the manager's host:port (its RPC server)"),
        ENV_SECRET_FILE: EnvVar("supervisor", "the cluster's secret, mode 0600"),
        ENV_SECRET: EnvVar("user", "the secret itself, instead of a file (manual mode)"),
        ENV_AUTH: EnvVar("user", "plain or curve: force an authentication mode"),
        ENV_TASK: EnvVar("supervisor", "job:index of this task"),
        ENV_CLUSTER_ID: EnvVar("supervisor", "the cluster id: how stop finds leftovers"),
        ENV_BIND_HOST: EnvVar("supervisor", "the interface the task's port is bound on"),
        ENV_HEARTBEAT_S: EnvVar("supervisor", "seconds between heartbeats"),
        ENV_REGISTER_TIMEOUT: EnvVar("supervisor", "how long the barrier may hold"),
        ENV_MANAGER_TIMEOUT: EnvVar("user", "seconds without the manager before a job stops"),
        ENV_STANDBY: EnvVar("supervisor", "1: a warm standby, waiting for a task"),
        ENV_ZYGOTE_READY_FD: EnvVar("supervisor", "the pipe a zygote says it is warm on"),
        ENV_FORKSERVER: EnvVar("supervisor", "the warm fork server's socket and pid: NAME:PID"),
        ENV_WARM_FORK: EnvVar("user", "0: no warm fork server; every job starts its own Python"),
        ENV_PIPELINE_SHM: EnvVar("user", "0: a pipeline's stages on one host send through gloo"),
        ENV_HOME: EnvVar("user", "the registry of clusters (default ~/.clusterflow)"),
        ENV_UI_TOKEN: EnvVar("user", "`clusterflow ui`: its token, instead of a fresh one"),
        ENV_HOSTS: EnvVar("user", "`--backend hosts`: the emulated hosts' placement file"),
        ENV_RAY_JOIN_TIMEOUT: EnvVar("user", "seconds ray.init may take (backends/ray_driver.py)"),
        ENV_LISTEN_FD: EnvVar("job", "the reserved, bound socket of the task's port"),
        ENV_JOB: EnvVar("job", "this task's job name"),
        ENV_TASK_INDEX: EnvVar("job", "this task's index in its job"),
        ENV_SPEC_VERSION: EnvVar("job", "the version of the spec in TF_CONFIG"),
        ENV_STATE_DIR: EnvVar("job", "the cluster's folder under CLUSTERFLOW_HOME"),
        ENV_CHECKPOINT_DIR: EnvVar("job", "where checkpoints go (a path or fsspec URL)"),
        ENV_RESTORE: EnvVar("job", "the step of the checkpoint every task restores"),
        ENV_ATTEMPT: EnvVar("job", "how often the whole cluster was restarted"),
        ENV_INCARNATION: EnvVar("job", "this launch of the task; ps and dispatcher fence older"),
        ENV_REPLICA: EnvVar("replica", "this process's replica index in its task"),
        ENV_DISPATCHER: EnvVar("user", "a data service dispatcher other than the manager"),
        ENV_TRIAL_PARAMS: EnvVar("job", "a tuning trial's parameters, as JSON"),
        ENV_TRIAL_REPORT: EnvVar("job", "the file, in the manager's folder, of a trial's figures"),
        ENV_TRIAL_REPORTER: EnvVar("job", "the one task of a trial whose figures count"),
        ENV_CACHE: EnvVar("job", "the cache of `start --cache`: cache:// reads it"),
        ENV_NODE: EnvVar("job", "the node a task runs on, as cache maps name it (Ray)"),
        TF_CONFIG: EnvVar("job", "the cluster spec and this task, TensorFlow's JSON"),
        TF_GRPC_REUSE_PORT: EnvVar("job", "1: TensorFlow binds beside the reserved port"),
        Torchrun.RANK: EnvVar("replica", "torchrun: this replica's global rank"),
        Torchrun.WORLD_SIZE: EnvVar("replica", "torchrun: how many replicas"),
        Torchrun.LOCAL_RANK: EnvVar("replica", "torchrun: the rank on this host (the device)"),
        Torchrun.LOCAL_WORLD_SIZE: EnvVar("replica", "torchrun: replicas on this host"),
        Torchrun.GROUP_RANK: EnvVar("replica", "torchrun: this host's index"),
        Torchrun.GROUP_WORLD_SIZE: EnvVar("replica", "torchrun: how many hosts"),
        Torchrun.ROLE_RANK: EnvVar("replica", "torchrun: the rank among replicas of one role"),
        Torchrun.ROLE_WORLD_SIZE: EnvVar("replica", "torchrun: replicas of that role"),
        Torchrun.MASTER_ADDR: EnvVar("job", "torchrun: the store's host"),
        Torchrun.MASTER_PORT: EnvVar("job", "torchrun: the store's port (the hosted store)"),
        Torchrun.USE_AGENT_STORE: EnvVar("job", "True: the store is hosted already"),
        Torchrun.RESTART_COUNT: EnvVar("job", "times this task was relaunched"),
        Torchrun.MAX_RESTARTS: EnvVar("job", "the run's bound on restarts"),
        PYTHONUNBUFFERED: EnvVar("supervisor", "1: output reaches the log line by line"),
        GLOO_IFNAME: EnvVar("job", "Ray: the interface of the node's address, for gloo"),
        CUDA_VISIBLE_DEVICES: EnvVar("replica", "the GPUs a replica (or a tune trial) may see"),
    }
)
"""Every variable a task may receive or read, with who receives it and what it means."""


TENSORBOARD_FILE: Final = "tensorboard"
"""A file in the cluster's folder (``CLUSTERFLOW_STATE_DIR``) that the chief's ``Summary``
hook writes: the absolute path of the run's TensorBoard folder, which only the job knows.
``clusterflow ui`` shows it."""


class ManagerMethod:
    """The manager's RPC methods, as supervisors, jobs and the CLI call them."""

    REGISTER: Final = "manager.register"
    """A supervisor joins the barrier; answered with the spec, env and command."""
    HEARTBEAT: Final = "manager.heartbeat"
    """A supervisor is alive; the answer says only that the manager is too."""
    EXITED: Final = "manager.exited"
    """A supervisor could not run its command, or it ended: why, in one line."""
    STOP: Final = "manager.stop"
    """``clusterflow stop``: stop the cluster, with a grace period."""
    STATUS: Final = "manager.status"
    """The cluster's state as ``state.json`` holds it."""
    DECLARE: Final = "manager.declare"
    """A job says whether its task may be respawned alone."""
    CHECKPOINTS: Final = "manager.checkpoints"
    """The chief says where its checkpoints live, when not in the cluster's folder: the
    manager restores from there (docs/failure-semantics.md)."""
    STANDBY: Final = "manager.standby"
    """A standby supervisor waits (bounded rounds) for a task to take over."""
    SPEC: Final = "manager.spec"
    """The newest cluster spec and its version."""
    SCALE: Final = "manager.scale"
    """``clusterflow scale``: grow or shrink the worker job of an elastic cluster
    (body: ``server/manager_messages.py`` ``ScaleRequest``, reply ``ScaleReply``); answered
    once the change took effect."""
    REPORT: Final = "task.report"
    """A job's live figures: step, loss, samples/s."""
    TRIAL_REPORT: Final = "trial.report"
    """A tuning trial's figures at a step: the manager appends them to its folder's
    report file, which the tuner reads (on Ray, from the manager's mirror)."""


MANAGER_METHODS: Final = frozenset(
    value for name, value in vars(ManagerMethod).items() if name.isupper()
)
"""Every method the manager serves besides the data service's ``data.*``."""
