"""``clusterflow``: start, watch and stop clusters; run a task's server by hand.

Parsing and printing only: every action lives in ``clusterflow.manager`` (or below).
Errors the user can fix print one line, ``error: ...``, and exit 2; no traceback.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import click

from clusterflow import __version__
from clusterflow.backends import forkserver, kinds
from clusterflow.cli import follow, interrupts, show
from clusterflow.cli.cache import cache_group, cache_placement
from clusterflow.cli.context import CONTEXT
from clusterflow.cli.ray_agents import ray_agents
from clusterflow.cli.secret import secret
from clusterflow.cli.start_settings import read_yaml, start_flags, start_layers
from clusterflow.cli.tune import make_tune
from clusterflow.cli.ui import ui
from clusterflow.errors import ClusterflowError, ConfigError

if TYPE_CHECKING:
    from clusterflow.manager.state import ClusterState

USAGE_EXIT = 2


def _fail(message: str, code: int = USAGE_EXIT) -> NoReturn:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def _one_line(message: str) -> str:
    """Errors are one line (scripts grep them); a multi-line message is joined up."""
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="clusterflow")
def cli() -> None:
    """Distributed training clusters of chief, ps, worker and evaluator tasks."""


class PublicChoice(click.Choice):  # type: ignore[type-arg]
    """A choice whose help and errors list only its public values; ``hidden`` ones are
    accepted too. ``--backend hosts`` (emulated hosts, ``clusterflow.testing``) is the
    test harness's, not a user's, so ``--help`` and docs/cli.md leave it out."""

    def __init__(self, public: list[str], hidden: list[str]) -> None:
        super().__init__(public)
        self.hidden = hidden

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.hidden:
            return value
        return super().convert(value, param, ctx)


class WorkersParam(click.ParamType):  # type: ignore[type-arg]
    """``--workers``: ``N`` as a number; ``MIN:MAX`` (and anything else) as typed, for
    ``RunConfig.merge`` to read or refuse, naming ``--workers`` (``parse_workers``)."""

    name = "N|MIN:MAX"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        return value


# start ---------------------------------------------------------------------------------


@cli.command(context_settings={**CONTEXT, "ignore_unknown_options": False})
@click.option("--chief", is_flag=True, default=None, help="Add a chief task (else worker 0 leads).")
@click.option("--ps", type=int, default=None, help="Number of parameter-server tasks.")
@click.option(
    "--workers",
    type=WorkersParam(),
    default=None,
    help="Number of worker tasks, or MIN:MAX to let `clusterflow scale` resize them [default: 1].",
)
@click.option("--evaluator", is_flag=True, default=None, help="Add an evaluator task.")
@click.option(
    "--replicas-per-host",
    type=int,
    default=None,
    help="Processes per chief/worker task, one per device [default: 1].",
)
@click.option("-c", "--config", "config_file", help="A cluster.yaml with the same settings.")
@click.option(
    "--max-restarts",
    type=int,
    default=None,
    help="Recoveries (respawn a worker, or restart all from the last checkpoint) [default: 0].",
)
@click.option(
    "--warm-restarts",
    is_flag=True,
    default=None,
    help="Keep a warm standby per task (torch imported) so a whole restart starts none cold.",
)
@click.option(
    "--checkpoint-dir",
    help="Where consistent checkpoints go: a path or fsspec URL [default: the cluster's folder].",
)
@click.option(
    "--stall-timeout",
    type=float,
    default=None,
    help="Seconds a task's reported step may stand still before it counts as hung.",
)
@click.option(
    "--resume",
    "resume_id",
    help="Continue a stopped or failed cluster from its last checkpoint (same settings).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="With --resume: the cluster left no checkpoint; start its settings over from step 0.",
)
@click.option("--ps-cmd", help="Command of ps tasks (default: the built-in server).")
@click.option("--untracked", help="Jobs not waited for, comma-separated [default: ps].")
@click.option("--detach", is_flag=True, help="Run in the background; print the cluster id.")
@click.option(
    "--backend",
    type=PublicChoice(list(kinds.PUBLIC), hidden=list(kinds.HIDDEN)),
    default=None,
    help="Where tasks run: local processes or a Ray cluster [default: local].",
)
@click.option("--address", help="The Ray cluster's HOST:PORT [default: RAY_ADDRESS, or local].")
@click.option(
    "--resources",
    "resources_",
    multiple=True,
    help="Per job on Ray: JOB:NAME=VALUE,... e.g. worker:GPU=1,CPU=8,memory=4G (repeatable).",
)
@click.option(
    "--label",
    "labels_",
    multiple=True,
    help="Per job on Ray: node labels its tasks need, JOB:KEY=VALUE,... (repeatable).",
)
@click.option("--job-dir", help="A folder or .zip shipped to every Ray node; jobs run in it.")
@click.option("--cache", help="An in-memory cache (`clusterflow cache`): workers go to its nodes.")
@click.option(
    "--memory",
    help="Memory per task on Ray where --resources names none: auto (measured) or a size.",
)
@click.option(
    "--grace", type=float, default=10.0, show_default=True, help="Seconds from SIGTERM to SIGKILL."
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def start(
    chief: bool | None,
    ps: int | None,
    workers: int | None,
    evaluator: bool | None,
    replicas_per_host: int | None,
    config_file: str | None,
    max_restarts: int | None,
    warm_restarts: bool | None,
    checkpoint_dir: str | None,
    stall_timeout: float | None,
    resume_id: str | None,
    fresh: bool,
    ps_cmd: str | None,
    untracked: str | None,
    detach: bool,
    backend: str | None,
    address: str | None,
    resources_: tuple[str, ...],
    labels_: tuple[str, ...],
    job_dir: str | None,
    memory: str | None,
    cache: str | None,
    grace: float,
    command: tuple[str, ...],
) -> None:
    """Start a local cluster running COMMAND (after `--`) on each task.

    \b
    Example:
      clusterflow start --ps 1 --workers 2 -- python train.py --epochs 3
    """
    from clusterflow.manager import registry
    from clusterflow.manager.config import RunConfig
    from clusterflow.rpc import Credentials

    flags = {**start_flags(click.get_current_context().params), "command": command or None}
    if fresh and not resume_id:
        raise ConfigError("--fresh goes with --resume ID (a new cluster starts fresh anyway)")
    layers, spellings = start_layers(
        flags, config_file, resume_id, fresh=fresh, new_dir=checkpoint_dir
    )
    config = RunConfig.merge(*layers, spellings=spellings)
    config = cache_placement(config) if config.cache else config  # cli/cache.py
    kind = kinds.named(config.backend)
    if kind.name != kinds.LOCAL.name or detach:
        forkserver.stop()  # its tasks are not this process's to fork (backends/local.py)
    if not kind.manager_in_ray:  # what its tasks need here, checked before anything starts
        kind.launcher().check(config)

    cluster = registry.create(forkserver.cluster_id() if kind.name == kinds.LOCAL.name else None)
    Credentials.generate().to_file(cluster.secret_file)
    registry.write_json_atomic(cluster.config_file, config.to_dict())
    if kind.manager_in_ray:
        from clusterflow.cli import ray_start

        sys.exit(ray_start.run(cluster, config, detach=detach))
    if detach:
        _start_detached(cluster)
        return
    sys.exit(_run_foreground(cluster, config))


def _run_foreground(cluster: Any, config: Any) -> int:
    from clusterflow.manager import Controller
    from clusterflow.manager.handle import task_backend

    config, backend = task_backend(config)
    controller = Controller(cluster, config, backend, echo=True)

    def _interrupt(signum: int, frame: FrameType | None) -> None:
        controller.request_stop()

    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    # A closed terminal stops the cluster in order too; left at its default, SIGHUP
    # would kill this manager and orphan the tasks (they run in their own sessions).
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        code = controller.run()
    finally:
        forkserver.stop()
    if controller.failure:
        click.echo(f"error: {_one_line(controller.failure)}", err=True)
    return code


def _start_detached(cluster: Any) -> None:
    from clusterflow.manager import registry
    from clusterflow.manager.handle import LocalHandle

    proc = LocalHandle.start(cluster).proc
    assert proc is not None
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        status = cluster.read_state().status
        if status in ("running", *registry.TERMINAL):
            break
        if proc.poll() is not None:
            _fail(
                f"the manager of cluster {cluster.id} exited with code {proc.returncode}; "
                f"see {cluster.path / 'manager.log'}",
                1,
            )
        time.sleep(0.05)
    click.echo(cluster.id)


# ps / describe -------------------------------------------------------------------------


@cli.command(name="ps", context_settings=CONTEXT)
@click.option("-a", "--all", "show_all", is_flag=True, help="Include finished clusters.")
def ps_command(show_all: bool) -> None:
    """List clusters: id, status, tasks, uptime, command."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from clusterflow.manager import registry

    table = Table(box=None, pad_edge=False)
    for column in ("ID", "STATUS", "TASKS", "UPTIME", "STEP", "SAMPLES/S", "COMMAND"):
        # One line per cluster, so scripts can read the table; a terminal too narrow
        # for a command cuts it short (`describe` shows it whole).
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    for cluster in registry.all_clusters():
        try:
            state = _read(cluster)
        except ClusterflowError as exc:
            cells = [cluster.id, "unreadable", str(exc), "-", "-", "-", "-"]
        else:
            status = registry.effective_status(state)
            if status == registry.UNREACHABLE:
                click.echo(f"warning: cluster {cluster.id}: {state.summary}", err=True)
            if not show_all and status in registry.TERMINAL:
                continue
            command = shlex.join(state.command)
            step, rate = show.figures(state)
            cells = [
                cluster.id,
                status,
                show.task_summary(state),
                show.uptime(state),
                step,
                rate,
                command,
            ]
        table.add_row(*(Text(cell) for cell in cells))  # Text: no markup in a command
    # Off a terminal nothing is cut: the width only bounds the table.
    Console(width=None if sys.stdout.isatty() else 100_000).print(table)


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_id")
@click.option("--json", "as_json", is_flag=True, help="Print the raw state as JSON.")
def describe(cluster_id: str, as_json: bool) -> None:
    """Show a cluster's spec, command, tasks and events."""
    from clusterflow.manager import registry

    cluster = registry.find(cluster_id)
    state = _read(cluster)
    if as_json:
        click.echo(json.dumps(state.to_dict(), indent=2))
        return
    click.echo(f"id:       {cluster.id}")
    click.echo(f"status:   {registry.effective_status(state)}")
    click.echo(f"command:  {shlex.join(state.command)}")
    click.echo(f"uptime:   {show.uptime(state)}")
    if state.summary:
        click.echo(f"summary:  {state.summary} (exit code {state.exit_code})")
    click.echo(f"state:    {cluster.path}")
    if state.checkpoint_dir:
        click.echo(f"checkpoints: {show.checkpoint_line(state.checkpoint_dir)}")
    if state.max_restarts:
        click.echo(f"restarts: {state.restarts} of {state.max_restarts}")
    click.echo(f"spec (v{state.spec_version}): {json.dumps(state.spec)}")
    if state.workers_range:
        low, high = state.workers_range
        click.echo(f"workers:  {state.workers()} (elastic, {low}:{high})")
    if state.membership:
        click.echo("membership:")
        for m in state.membership:
            when = time.strftime("%H:%M:%S", time.localtime(m.time))
            step = "-" if m.step is None else m.step
            click.echo(
                f"  {when} {m.task:<14} {m.change:<7} spec v{m.spec_version:<4} "
                f"step {step:<8} workers {m.workers}"
            )
    click.echo("tasks:")
    for t in state.tasks:
        code = t.exit_code
        click.echo(
            f"  {t.task:<14} {t.status:<10} {t.address or '-':<22} "
            f"pid {t.pid or '-':<8} exit {'-' if code is None else code}"
            f"{show.task_figures(t)}{show.task_placement(t)}"
        )
    click.echo("events:")
    for event in cluster.read_events():
        when = time.strftime("%H:%M:%S", time.localtime(event.pop("time", 0)))
        kind = event.pop("event", "?")
        details = " ".join(f"{k}={json.dumps(v)}" for k, v in event.items())
        click.echo(f"  {when} {kind} {details}")


# logs / attach -------------------------------------------------------------------------


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_id")
@click.option("--task", "task_name", help="Only this task's output, e.g. worker:1.")
@click.option(
    "-f", "--follow", "follow_", is_flag=True, help="Keep printing until the cluster ends."
)
def logs(cluster_id: str, task_name: str | None, follow_: bool) -> None:
    """Print a cluster's output (all tasks, prefixed) or one task's."""
    from clusterflow.cluster import TaskId
    from clusterflow.manager import registry

    cluster = registry.find(cluster_id)
    state = _read(cluster)
    if state.status == registry.UNREACHABLE:  # what the mirror holds is still worth printing
        click.echo(f"warning: cluster {cluster.id}: {state.summary}", err=True)
    if task_name:
        task = TaskId.parse(task_name)
        known = [t.task for t in state.tasks]
        if known and str(task) not in known:
            raise ConfigError(
                f"cluster {cluster.id} has no task {task_name!r}; "
                f"tasks: {', '.join(map(str, known))}"
            )
        path = cluster.task_log(str(task))
    else:
        path = cluster.output_file
    following = follow_ and state.status != registry.UNREACHABLE
    follow.print_file(path, lambda: _finished(cluster) if following else True)


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_id")
def attach(cluster_id: str) -> None:
    """Re-join a running cluster's output stream until it ends (Ctrl-C detaches)."""
    from clusterflow.manager import registry

    cluster = registry.find(cluster_id)
    state = _read(cluster)
    status = registry.effective_status(state)
    if status == registry.UNREACHABLE:
        raise ConfigError(f"cluster {cluster.id}: {state.summary}")
    if status in registry.TERMINAL or status == "stale":
        raise ConfigError(f"cluster {cluster.id} is not running ({status}); see `clusterflow logs`")
    try:
        follow.print_file(cluster.output_file, lambda: _finished(cluster))
    except KeyboardInterrupt as exc:  # detaches; the cluster runs on
        sys.exit(interrupts.exit_code(exc))
    code = cluster.read_state().exit_code
    sys.exit(1 if code is None else code)


def _read(cluster: Any) -> ClusterState:
    """The cluster's state; one whose manager runs elsewhere (on Ray) has its local folder
    brought up to date from it first, within deadlines, and reads ``unreachable`` when
    that Ray cannot be reached (``ray_host.read``); a local cluster's folder is the
    manager's own (``manager/handle.py``)."""
    from clusterflow.manager import handle

    return handle.read(cluster)


def _finished(cluster: Any) -> bool:
    """Whether following the cluster's output is over: it ended, its manager is gone, or
    its Ray cannot be reached (nothing more can come; said once on stderr)."""
    from clusterflow.manager import registry

    state = _read(cluster)
    status = registry.effective_status(state)
    if status == registry.UNREACHABLE:
        click.echo(f"warning: cluster {cluster.id}: {state.summary}", err=True)
    return status in (*registry.TERMINAL, "stale", registry.UNREACHABLE)


# stop ----------------------------------------------------------------------------------


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_id")
@click.option(
    "--grace", type=float, default=10.0, show_default=True, help="Seconds before forcing."
)
def stop(cluster_id: str, grace: float) -> None:
    """Stop a cluster: SIGTERM to every task, SIGKILL after the grace period."""
    from clusterflow.manager import handle, registry

    cluster = registry.find(cluster_id)
    click.echo(f"{cluster.id}: {handle.stop(cluster, grace)}")


# scale ---------------------------------------------------------------------------------


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_id")
@click.option("--workers", type=int, help="The worker tasks the cluster should run.")
@click.option("--ps", type=int, help="Refused: the ps tasks keep their number.")
def scale(cluster_id: str, workers: int | None, ps: int | None) -> None:
    """Grow or shrink the worker job of a running elastic cluster (--workers MIN:MAX)."""
    from clusterflow.manager import registry
    from clusterflow.manager.elastic import scale_cluster

    if ps is not None:
        raise ConfigError(
            "scale --ps: the ps tasks keep their number (their shards hold the variables); "
            "only --workers resizes"
        )
    if workers is None:
        raise ConfigError("scale needs --workers N")
    cluster = registry.find(cluster_id)
    _read(cluster)  # a Ray cluster's mirror learns its manager's address
    reply = scale_cluster(cluster, workers)
    moved = [
        f"{word} {', '.join(names)}"
        for word, names in (("added", reply.joined), ("removed", reply.left))
        if names
    ]
    change = f" ({'; '.join(moved)})" if moved else " (unchanged)"
    how = "; every task restarted at the new size" if reply.restarted else ""
    click.echo(
        f"{cluster.id}: {reply.workers} workers at spec version {reply.spec_version}{change}{how}"
    )


# server / secret -----------------------------------------------------------------------


@cli.command(context_settings=CONTEXT)
@click.option(
    "--cluster-spec", "spec_file", required=True, help="JSON or YAML: {job: [host:port, ...]}."
)
@click.option("--job", required=True, help="This task's job name.")
@click.option("--task", "task_index", required=True, type=int, help="This task's index in its job.")
@click.option("--secret-file", help="The cluster's secret (see `clusterflow secret`).")
@click.option("--auth", type=click.Choice(["plain", "curve"]), help="Force an auth mode.")
def server(
    spec_file: str, job: str, task_index: int, secret_file: str | None, auth: str | None
) -> None:
    """Run one task's server by hand (manual mode, on any machine)."""
    from clusterflow.rpc import Credentials
    from clusterflow.server import Server

    data = read_yaml(spec_file, "cluster spec")
    if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
        data = data["cluster"]  # a whole TF_CONFIG is fine too
    if not isinstance(data, dict):
        raise ConfigError(f"cluster spec {spec_file!r} must map job names to addresses")
    mode: Any = auth
    if secret_file:
        credentials = Credentials.from_file(secret_file, mode)
    else:
        found = Credentials.from_env()
        if found is None:
            raise ConfigError(
                "no cluster secret: pass --secret-file (create one with `clusterflow secret FILE`)"
            )
        credentials = Credentials(found.secret, mode or found.mode)
    srv = Server(data, job, task_index, credentials=credentials)

    def _stop(signum: int, frame: FrameType | None) -> None:
        srv.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    click.echo(f"serving /job:{job}/task:{task_index} at {srv.target} ({srv.auth_mode} auth)")
    srv.join()


cli.add_command(make_tune(start))  # `clusterflow tune` (cli/tune.py): start's options, per trial
cli.add_command(cache_group)  # `clusterflow cache` (cli/cache.py)
cli.add_command(ui)  # `clusterflow ui` (cli/ui.py): the dashboard
cli.add_command(secret)  # `clusterflow secret` (cli/secret.py)
cli.add_command(ray_agents)  # `clusterflow ray-agents` (cli/ray_agents.py)


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors, exit 2 for usage, never a traceback for bad input."""
    interrupts.install()
    try:
        code = cli.main(args=argv, prog_name="clusterflow", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        # `clusterflow` or a group (`cache`, `ray-agents`) with no command: its help,
        # as written (not joined into one line), on stderr with the usage exit, as click
        # itself does.
        exc.show()
        sys.exit(USAGE_EXIT)
    except click.UsageError as exc:
        path = exc.ctx.command_path if exc.ctx else "clusterflow"
        _fail(f"{exc.format_message()} (see `{path} -h`)")
    except click.exceptions.Abort as exc:  # click's wrapping of a KeyboardInterrupt
        sys.exit(interrupts.exit_code(exc.__cause__ or exc.__context__))
    except click.ClickException as exc:
        _fail(exc.format_message())
    except ClusterflowError as exc:
        _fail(str(exc))
    except KeyboardInterrupt as exc:
        sys.exit(interrupts.exit_code(exc))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
