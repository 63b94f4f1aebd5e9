"""A study's loop: Optuna asks, each trial runs as a clusterflow cluster, Optuna is told.

One thread drives up to ``parallel`` trial clusters at once (no more than the machine,
or the Ray cluster, holds: ``tune.placement``). Each is started exactly as
``clusterflow start --detach`` starts one on its backend (a folder in the registry, a
secret, its ``RunConfig``, then a local manager process or a manager actor on Ray:
``manager/handle.py``), so ``clusterflow ps`` lists it, under an id that begins with the
study's name. The loop reads each trial's report file
(``clusterflow.cluster.trial``), feeds the values to Optuna's pruner and stops a
pruned cluster at once. A stop request (Ctrl-C) stops every running trial and puts its
parameters back in the study's queue, so running again continues with no trial lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterflow._checks import seconds, whole
from clusterflow.backends import kinds
from clusterflow.cluster.contract import CUDA_VISIBLE_DEVICES
from clusterflow.cluster.trial import (
    ENV_TRIAL_PARAMS,
    ENV_TRIAL_REPORT,
    ENV_TRIAL_REPORTER,
    REPORT_FILE,
    read_reports,
)
from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.manager import handle, registry
from clusterflow.manager.config import RunConfig
from clusterflow.manager.handle import ClusterHandle
from clusterflow.manager.restore import committed_or_none
from clusterflow.tune.placement import gpus_per_trial, trials_at_once
from clusterflow.tune.space import Param, check_command, distribution, fill_command, grid

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "gp", "random", "grid")
PRUNERS = ("median", "asha", "none")
DIRECTIONS = ("maximize", "minimize")
INTERRUPTED = "interrupted"
_HOST = socket.gethostname()


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneSettings:
    study: str
    metric: str
    params: Sequence[Param]
    command: Sequence[str]
    trials: int = 10
    parallel: int = 1
    direction: str = "maximize"
    sampler: str = "tpe"
    pruner: str = "median"
    storage: str | None = None
    max_failures: int = 3
    seed: int | None = None
    cluster: Mapping[str, Any] = field(default_factory=dict)
    """``start``'s settings for every trial's cluster (RunConfig.merge layers' form)."""
    poll_s: float = 0.1
    stop_grace_s: float = 2.0

    def check(self) -> None:
        if not self.study or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.study):
            raise ConfigError(f"--study {self.study!r}: use letters, digits, '.', '_' or '-'")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"unknown sampler {self.sampler!r} (one of {', '.join(SAMPLERS)})")
        if self.pruner not in PRUNERS:
            raise ConfigError(f"unknown pruner {self.pruner!r} (one of {', '.join(PRUNERS)})")
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"unknown direction {self.direction!r} (maximize or minimize)")
        whole("--trials", self.trials, least=1)
        whole("--parallel", self.parallel, least=1)
        whole("--max-failures", self.max_failures)
        seconds("poll_s", self.poll_s)
        seconds("stop_grace_s", self.stop_grace_s)
        if not self.params:
            raise ConfigError("give at least one --param NAME=KIND:...")
        if not self.command:
            raise ConfigError("give the trial's command after `--`")
        check_command(self.command, self.params)


@dataclass(slots=True)
class _Running:
    trial: Any
    launched: ClusterHandle
    gpus: list[str] = field(default_factory=list)
    read: int = 0
    steps: set[int] = field(default_factory=set)
    last: dict[str, float] = field(default_factory=dict)


def settings_record(s: TuneSettings) -> dict[str, Any]:
    """What ``--resume`` needs to run the study again, stored with the study (JSON)."""
    return {
        "metric": s.metric,
        "params": [p.to_spec() for p in s.params],
        "command": list(s.command),
        "trials": s.trials,
        "parallel": s.parallel,
        "direction": s.direction,
        "sampler": s.sampler,
        "pruner": s.pruner,
        "max_failures": s.max_failures,
        "cluster": RunConfig.merge(dict(s.cluster), {"command": tuple(s.command)}).to_dict(),
    }


def stored_settings(study: str, storage: str | None) -> dict[str, Any]:
    """The settings a study was last run with (``--resume``)."""
    optuna = _optuna()
    try:
        loaded = optuna.load_study(study_name=study, storage=storage or default_storage())
    except KeyError:
        raise ConfigError(f"no study {study!r} to resume (see `clusterflow tune ls`)") from None
    return dict(loaded.user_attrs.get("clusterflow") or {})


def default_storage() -> str:
    """The embedded SQLite file every study lives in by default."""
    return f"sqlite:///{registry.home() / 'studies.db'}"


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("tuning needs Optuna: pip install 'clusterflow[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _sampler(optuna: Any, s: TuneSettings) -> Any:
    if s.sampler == "tpe":
        # Random start-up trials: Optuna's 10, or a third of a smaller study, so TPE
        # guides most of a short study too.
        startup = min(10, max(2, s.trials // 3))
        return optuna.samplers.TPESampler(n_startup_trials=startup, seed=s.seed)
    if s.sampler == "gp":
        return optuna.samplers.GPSampler(seed=s.seed)
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    return optuna.samplers.GridSampler(grid(s.params), seed=s.seed)


def _pruner(optuna: Any, s: TuneSettings) -> Any:
    if s.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    if s.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def _cluster_id(study: str, number: int) -> str:
    return f"{study}-t{number}-{secrets.token_hex(2)}"


class StudyRunner:
    """Runs one study to ``trials`` finished trials (see the module's docstring)."""

    def __init__(self, settings: TuneSettings, echo: Callable[[str], None] | None = None) -> None:
        settings.check()
        self.s = settings
        self.echo = echo or log.info
        self.stop_requested = threading.Event()
        self.failure: str | None = None
        self._optuna = _optuna()
        self.storage = settings.storage or default_storage()
        # Trials' memory is kept by the command before {name} is filled in (and the job),
        # so each trial on Ray asks for what the earlier trials measured (memory_sizing).
        command = {"command": tuple(settings.command), "memory_key": shlex.join(settings.command)}
        self.base = RunConfig.merge(dict(settings.cluster), command)
        fit = trials_at_once(self.base, settings.parallel)
        self.parallel, self.why = fit.trials, fit.why
        self.free_gpus = self._gpu_pool()
        self.study = self._open_study()
        self.distributions = {p.name: distribution(p) for p in settings.params}

    def _open_study(self) -> Any:
        optuna = self._optuna
        try:
            study = optuna.create_study(
                study_name=self.s.study,
                storage=self.storage,
                sampler=_sampler(optuna, self.s),
                pruner=_pruner(optuna, self.s),
                direction=self.s.direction,
                load_if_exists=True,
            )
        except ValueError as exc:
            raise ConfigError(f"study {self.s.study!r}: {exc}") from None
        if study.direction.name.lower() != self.s.direction:
            raise ConfigError(
                f"study {self.s.study!r} was made to {study.direction.name.lower()}, "
                f"not {self.s.direction}"
            )
        study.set_user_attr("clusterflow", settings_record(self.s))
        return study

    # counting -----------------------------------------------------------------------

    def _counts(self) -> tuple[int, int]:
        """(trials finished, failures) so far, interrupted trials not counted."""
        state = self._optuna.trial.TrialState
        done = failed = 0
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get(INTERRUPTED):
                continue
            if t.state in (state.COMPLETE, state.PRUNED):
                done += 1
            elif t.state == state.FAIL:
                done += 1
                failed += 1
        return done, failed

    def _requeue_orphans(self) -> None:
        """Trials left RUNNING by a tuner of this host that died go back to the queue,
        marked interrupted. A live tuner's trials (another on this host, or any on
        another machine sharing the storage) are left alone."""
        state = self._optuna.trial.TrialState
        for t in self.study.get_trials(deepcopy=False, states=(state.RUNNING,)):
            host, _, pid = str(t.user_attrs.get("tuner", ":")).rpartition(":")
            if host != _HOST or (pid.isdigit() and registry.process_alive(int(pid), None)):
                continue
            cluster_id = t.user_attrs.get("cluster_id")
            if cluster_id and (registry.home() / "clusters" / cluster_id).is_dir():
                with contextlib.suppress(ClusterflowError):  # its Ray may be gone
                    handle.stop(registry.find(cluster_id), self.s.stop_grace_s)
            self.study.enqueue_trial(t.params, skip_if_exists=False)
            self._optuna.Trial(self.study, t._trial_id).set_user_attr(INTERRUPTED, True)
            self.study.tell(t.number, state=state.FAIL)

    # the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Runs until the study has its trials; 0, 1 (too many failures) or 130 (stopped)."""
        self._requeue_orphans()
        running: list[_Running] = []
        try:
            while True:
                done, failed = self._counts()
                if failed > self.s.max_failures:
                    self.failure = (
                        f"{failed} trials failed (more than --max-failures {self.s.max_failures})"
                    )
                    return 1
                if self.failure:
                    return 2
                if self.stop_requested.is_set():
                    return 130
                if done >= self.s.trials and not running:
                    return 0
                while len(running) < self.parallel and done + len(running) < self.s.trials:
                    running.append(self._start_trial())
                for r in list(running):
                    if self._poll(r):
                        running.remove(r)
                time.sleep(self.s.poll_s)
        except KeyboardInterrupt:
            self.stop_requested.set()
            return 130
        finally:
            for r in running:
                self._interrupt(r)

    def _gpu_pool(self) -> list[str]:
        """The GPUs local trials are given, a disjoint share each (none on Ray, where Ray
        assigns them, nor without GPUs: see ``tune.placement``)."""
        if kinds.named(self.base.backend).placed_by_ray or not gpus_per_trial(self.base):
            return []
        from clusterflow.tune.placement import visible_gpus

        return visible_gpus()

    def _start_trial(self) -> _Running:
        trial = self.study.ask(self.distributions)
        trial.set_user_attr("tuner", f"{_HOST}:{os.getpid()}")
        values = dict(trial.params)
        cluster = registry.create(_cluster_id(self.s.study, trial.number))
        env = {
            **dict(self.base.env),
            ENV_TRIAL_PARAMS: json.dumps(values),
            ENV_TRIAL_REPORT: REPORT_FILE,  # in the manager's folder (manager/trial_reports)
            ENV_TRIAL_REPORTER: "chief:0" if self.base.chief else "worker:0",
        }
        share = gpus_per_trial(self.base)
        gpus: list[str] = []
        if self.free_gpus and share:
            gpus, self.free_gpus = self.free_gpus[:share], self.free_gpus[share:]
        config = RunConfig.merge(
            self.base.to_dict(), {"command": fill_command(self.s.command, values), "env": env}
        )
        from clusterflow.rpc import Credentials

        Credentials.generate().to_file(cluster.secret_file)
        registry.write_json_atomic(cluster.config_file, config.to_dict())
        trial.set_user_attr("cluster_id", cluster.id)
        # The trial's manager sees its GPUs as a machine's manager sees the machine's: it
        # splits them between its tasks, which never see another trial's.
        launched = handle.start(
            cluster, config, {CUDA_VISIBLE_DEVICES: ",".join(gpus)} if gpus else {}
        )
        shown = f" on GPUs {','.join(gpus)}" if gpus else ""
        self.echo(f"trial {trial.number} started: cluster {cluster.id}{shown} {values}")
        return _Running(trial, launched, gpus)

    def _read(self, r: _Running) -> bool:
        """Feeds new reports to Optuna; True if the pruner says stop."""
        reports = read_reports(r.launched.cluster.path / REPORT_FILE)
        new, r.read = reports[r.read :], len(reports)
        fed = False
        for step, figures in new:
            r.last.update(figures)
            if self.s.metric in figures and step not in r.steps:
                r.steps.add(step)
                r.trial.report(figures[self.s.metric], step)
                fed = True
        return fed and bool(r.trial.should_prune())

    def _poll(self, r: _Running) -> bool:
        """One look at a running trial; True once it is finished and told."""
        state_enum = self._optuna.trial.TrialState
        if self._read(r):
            r.launched.stop(self.s.stop_grace_s)
            self._tell(r, state_enum.PRUNED, "pruned")
            return True
        state = r.launched.ended()
        if state is None:
            return False
        self._read(r)
        if state.status != "succeeded":
            self._tell(r, state_enum.FAIL, state.summary or state.status)
            return True
        if self.s.metric not in r.last:
            said = ", ".join(sorted(r.last)) or "nothing"
            message = (
                f"metric {self.s.metric!r} was never reported by trial {r.trial.number} "
                f"(it reported: {said})"
            )
            self._tell(r, state_enum.FAIL, message)
            if not any(t.value is not None for t in self.study.get_trials(deepcopy=False)):
                self.failure = message
            return True
        self._tell(r, state_enum.COMPLETE, state.summary or "succeeded", r.last[self.s.metric])
        return True

    def _tell(self, r: _Running, state: Any, summary: str, value: float | None = None) -> None:
        self.free_gpus += r.gpus  # its cluster is gone: its GPUs go to the next trial
        r.gpus = []
        cluster_state = r.launched.cluster.read_state()
        own = r.launched.cluster.path / "checkpoints"
        checkpoint = cluster_state.checkpoint_dir or str(own)
        r.trial.set_user_attr("summary", summary)
        # Named only when it holds a committed checkpoint (what load_module can open):
        # a trial that saved nothing, or was pruned before its first save, has none.
        if committed_or_none(checkpoint) is not None:
            r.trial.set_user_attr("checkpoint", checkpoint)
        if value is not None:
            self.study.tell(r.trial, value)
        else:
            self.study.tell(r.trial, state=state)
        shown = f"{self.s.metric}={value:g}" if value is not None else summary
        self.echo(f"trial {r.trial.number} {state.name.lower()}: {shown}")

    def _interrupt(self, r: _Running) -> None:
        """Stops a running trial's cluster and queues its parameters for the next run."""
        r.launched.stop(self.s.stop_grace_s)
        r.trial.set_user_attr(INTERRUPTED, True)
        self.study.enqueue_trial(dict(r.trial.params), skip_if_exists=False)
        self._tell(r, self._optuna.trial.TrialState.FAIL, "interrupted: will run again on resume")


def run(settings: TuneSettings, echo: Callable[[str], None] | None = None) -> int:
    """Runs a study (see :class:`StudyRunner`); returns its exit code."""
    return StudyRunner(settings, echo).run()
