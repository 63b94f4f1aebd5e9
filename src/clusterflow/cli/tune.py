"""``clusterflow tune``: run a study (each trial a cluster), list studies, describe one.

Parsing and printing only; the study's loop is ``clusterflow.tune.study``. Every option
of ``start`` (but ``--detach``, ``--resume`` and ``--fresh``) is copied from that
command, so a trial's cluster takes exactly what ``start`` takes.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import click

from clusterflow.cli import interrupts
from clusterflow.cli.context import CONTEXT
from clusterflow.cli.start_settings import start_flags, start_layers
from clusterflow.errors import ConfigError

_NOT_FOR_TRIALS = {"detach", "resume_id", "fresh", "command"}


class _TuneGroup(click.Group):
    """``tune [OPTIONS] -- COMMAND`` runs a study; ``tune [--storage URL] ls`` and
    ``tune [--storage URL] describe NAME`` look at studies.

    A subcommand is the first word that is neither an option nor an option's value, and
    only before ``--`` (after it, words are the trial's command, whatever they spell).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        at = self._subcommand_at(ctx, args)
        if at is None:
            return click.Command.parse_args(self, ctx, args)
        click.Command.parse_args(self, ctx, args[:at])
        ctx._protected_args, ctx.args = args[at : at + 1], args[at + 1 :]
        return ctx.args

    def _subcommand_at(self, ctx: click.Context, args: list[str]) -> int | None:
        takes_value: dict[str, bool] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                for name in (*param.opts, *param.secondary_opts):
                    takes_value[name] = not (param.is_flag or param.count)
        i = 0
        while i < len(args):
            word = args[i]
            if word == "--":
                return None
            if word.startswith("-") and word != "-":
                if "=" not in word and takes_value.get(word, False):
                    i += 1  # the option's value, whatever it spells
                i += 1
                continue
            return i if word in self.commands else None
        return None

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS] -- COMMAND...  |  ls  |  describe NAME"]


class _TrialCommand(click.Argument):
    """The trial's command: no usage piece, so a subcommand's usage line reads
    ``clusterflow tune ls [OPTIONS]`` (click puts the group's arguments into it)."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


def _only_storage(ctx: click.Context, subcommand: str) -> None:
    """A subcommand takes the group's ``--storage`` and no other of its options."""
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name or "")
        if param.name == "storage" or source in (None, click.core.ParameterSource.DEFAULT):
            continue
        flag = param.opts[0] if isinstance(param, click.Option) else str(param.name).upper()
        raise click.UsageError(f"{flag} is for running a study, not for `tune {subcommand}`")


def _start_layer(values: dict[str, Any], under: dict[str, Any] | None = None) -> dict[str, Any]:
    """``start``'s options as a RunConfig.merge layer (as ``start`` builds it), over the
    settings ``under`` (a resumed study's).

    Checked here, with the flags and the cluster file's keys named as the user wrote
    them (``--grace``, the file's ``workers``), before the study runs a trial.
    """
    from clusterflow.manager.config import RunConfig, Spelling

    flags = start_flags(values)
    (_, layer, given), (_, in_file, in_flags) = start_layers(flags, values.get("config_file"))
    layer.pop("command", None)
    RunConfig.merge(
        under or {},
        layer,
        given,
        {"command": ("true",)},  # the trials' command is checked by the study
        spellings=[Spelling(where="the study's settings"), in_file, in_flags],
    )
    return {**layer, **given}


def _at_cache(cluster: dict[str, Any]) -> dict[str, Any]:
    """``--cache NAME``: every trial's cluster placed at the cache, as ``start`` places one."""
    from clusterflow.cli.cache import cache_placement
    from clusterflow.manager.config import RunConfig

    placed = cache_placement(RunConfig.merge(cluster, {"command": ("true",)}))
    labels = {job: dict(selector) for job, selector in placed.labels.items()}
    return {**cluster, "env": dict(placed.env), "labels": labels}


def _run_study(values: dict[str, Any]) -> int:
    from clusterflow.tune.space import parse_params
    from clusterflow.tune.study import StudyRunner, TuneSettings, stored_settings

    study = values["study"]
    if not study:
        raise ConfigError("give --study NAME (or `tune ls` / `tune describe NAME`)")
    stored = stored_settings(study, values["storage"]) if values["resume"] else {}
    cluster = dict(stored.get("cluster") or {})
    cluster.pop("command", None)
    cluster.update(_start_layer(values, cluster))
    if cluster.get("cache"):
        cluster = _at_cache(cluster)

    def pick(name: str, default: Any) -> Any:
        given = values.get(name)
        return given if given not in (None, ()) else stored.get(name, default)

    settings = TuneSettings(
        study=study,
        metric=pick("metric", None) or "",
        params=parse_params(values["param"] or stored.get("params", [])),
        command=tuple(pick("command", ())),
        trials=pick("trials", 10),
        parallel=pick("parallel", 1),
        direction=pick("direction", "maximize"),
        sampler=pick("sampler", "tpe"),
        pruner=pick("pruner", "median"),
        storage=values["storage"],
        max_failures=pick("max_failures", 3),
        seed=values["seed"],
        cluster=cluster,
    )
    if not settings.metric:
        raise ConfigError("give --metric NAME: the figure the job reports")
    runner = StudyRunner(settings, echo=click.echo)
    if runner.parallel < settings.parallel:
        click.echo(
            f"running {runner.parallel} trials at once, not {settings.parallel}: {runner.why}"
        )

    def _interrupt(signum: int, frame: FrameType | None) -> None:
        if runner.stop_requested.is_set():  # the second: leave now (interrupts.py)
            interrupts.raise_for(signum)
        runner.stop_requested.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    code = runner.run()
    if runner.failure:
        click.echo(f"error: {runner.failure}", err=True)
    elif code == 130:
        click.echo(f"stopped; `clusterflow tune --study {study} --resume` continues", err=True)
    else:
        _print_best(runner.study)
    return code


def _print_best(study: Any) -> None:
    try:
        best = study.best_trial
    except ValueError:
        click.echo("no trial completed")
        return
    attrs = best.user_attrs
    click.echo(
        f"best: trial {best.number} value={best.value:g} params={best.params} "
        f"cluster={attrs.get('cluster_id')} checkpoint={attrs.get('checkpoint')}"
    )


def _storage(ctx: click.Context, own: str | None) -> str | None:
    """A subcommand's ``--storage``, else the one given before it (``tune --storage X ls``)."""
    given = ctx.parent.params.get("storage") if ctx.parent else None
    if own and given and own != given:
        raise click.UsageError(f"two storages given: {given!r} and {own!r}")
    return own or given


def _table(rows: list[dict[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not rows:
        click.echo("nothing yet")
        return
    table = Table(box=None, pad_edge=False)
    for column in rows[0]:
        table.add_column(column.upper(), no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row.values()))
    Console(width=None if sys.stdout.isatty() else 100_000).print(table)


def make_tune(start: click.Command) -> click.Group:
    """The ``tune`` group, with ``start``'s cluster options (but --detach, --resume)."""

    @click.group(
        cls=_TuneGroup,
        invoke_without_command=True,
        context_settings={**CONTEXT, "ignore_unknown_options": False},
    )
    @click.option("--study", help="The study's name (a new one, or one to continue).")
    @click.option("--trials", type=int, default=None, help="Trials to finish [default: 10].")
    @click.option("--parallel", type=int, default=None, help="Trials running at once [default: 1].")
    @click.option(
        "--param",
        multiple=True,
        help="NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or choice:A,B (repeatable).",
    )
    @click.option("--metric", help="The reported figure to optimize, e.g. val_accuracy.")
    @click.option(
        "--direction",
        type=click.Choice(["maximize", "minimize"]),
        default=None,
        help="Optimize up or down [default: maximize].",
    )
    @click.option("--sampler", default=None, help="tpe, gp, random or grid [default: tpe].")
    @click.option("--pruner", default=None, help="median, asha or none [default: median].")
    @click.option(
        "--storage", help="An Optuna storage URL [default: sqlite under $CLUSTERFLOW_HOME]."
    )
    @click.option(
        "--max-failures",
        type=int,
        default=None,
        help="Failed trials tolerated before the study stops [default: 3].",
    )
    @click.option("--seed", type=int, default=None, help="The sampler's seed.")
    @click.option(
        "--resume", is_flag=True, help="Continue the study with the settings it was run with."
    )
    @click.argument("command", nargs=-1, type=click.UNPROCESSED, cls=_TrialCommand)
    @click.pass_context
    def tune(ctx: click.Context, /, **values: Any) -> None:
        """Tune hyperparameters: each trial runs COMMAND (after `--`) as a cluster.

        \b
        Example:
          clusterflow tune --study digits --trials 20 --parallel 2 \\
              --param lr=loguniform:1e-4:1e-1 --metric val_accuracy \\
              --workers 2 -- python train.py --lr {lr}
        """
        if ctx.invoked_subcommand is None:
            sys.exit(_run_study(values))
        _only_storage(ctx, ctx.invoked_subcommand)

    for param in start.params:
        if param.name not in _NOT_FOR_TRIALS:
            tune.params.insert(len(tune.params) - 1, param)

    @tune.command(name="ls", context_settings=CONTEXT)
    @click.option("--storage", "storage_", help="An Optuna storage URL [default: the SQLite file].")
    @click.pass_context
    def ls_command(ctx: click.Context, storage_: str | None) -> None:
        """List studies: trials done / running / pruned / failed, best value."""
        from clusterflow.tune.view import studies

        _table(studies(_storage(ctx, storage_)))

    @tune.command(context_settings=CONTEXT)
    @click.argument("name")
    @click.option("--storage", "storage_", help="An Optuna storage URL [default: the SQLite file].")
    @click.pass_context
    def describe(ctx: click.Context, name: str, storage_: str | None) -> None:
        """Every trial of study NAME: params, value, status, cluster id, checkpoint."""
        from clusterflow.tune.view import trials

        _table(trials(name, _storage(ctx, storage_)))

    return tune
