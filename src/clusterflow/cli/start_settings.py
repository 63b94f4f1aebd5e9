"""The settings ``start`` (and ``tune``) read before a cluster starts: its options'
spellings, the cluster file, a resumed cluster's settings, as ``RunConfig.merge`` layers.

Apart from ``cli/main.py`` so that ``cli/tune.py``, which checks a study's ``start``
options the same way, imports them without importing the command line that imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from clusterflow.backends import kinds
from clusterflow.errors import ClusterflowError, ConfigError

__all__ = ["START_FLAGS", "load_cluster_file", "read_yaml", "start_flags", "start_layers"]


def _yaml_problem(exc: Exception) -> str:
    """A YAML error in one line: where, and what (PyYAML's own text spans several)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(problem)


def read_yaml(path: str, what: str) -> Any:
    """The YAML (or JSON) document in ``path``; a ConfigError naming it if unreadable."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path!r} is not text: {exc.reason}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path!r} is not valid YAML: {_yaml_problem(exc)}") from exc


START_FLAGS = {
    "chief": "--chief",
    "ps": "--ps",
    "workers": "--workers",
    "evaluator": "--evaluator",
    "replicas_per_host": "--replicas-per-host",
    "max_restarts": "--max-restarts",
    "warm_restarts": "--warm-restarts",
    "checkpoint_dir": "--checkpoint-dir",
    "stall_timeout_s": "--stall-timeout",
    "backend": "--backend",
    "address": "--address",
    "job_dir": "--job-dir",
    "memory": "--memory",
    "cache": "--cache",
    "command": "the command after --",
    "ps_command": "--ps-cmd",
    "untracked": "--untracked",
    "resources": "--resources",
    "labels": "--label",
    "grace_s": "--grace",
}
"""``start``'s (and ``tune``'s) option for each setting it gives: what an error names
when the bad value came from the command line (``--grace``, never the field ``grace_s``)."""


def start_flags(values: dict[str, Any]) -> dict[str, Any]:
    """``start``'s options, as click hands them over (its parameter names), as the
    settings they give (``RunConfig`` fields; ``None`` where not given).

    One table for ``start`` and for ``tune``, which takes the same options for its
    trials' clusters. The command is not among them: ``start``'s runs on every task,
    ``tune``'s is the trials'.
    """
    from clusterflow.manager.job_settings import parse_job_settings

    resources, labels = values.get("resources_") or (), values.get("labels_") or ()
    return {
        "chief": values.get("chief"),
        "ps": values.get("ps"),
        "workers": values.get("workers"),
        "evaluator": values.get("evaluator"),
        "replicas_per_host": values.get("replicas_per_host"),
        "max_restarts": values.get("max_restarts"),
        "warm_restarts": values.get("warm_restarts") or None,
        "checkpoint_dir": values.get("checkpoint_dir"),
        "stall_timeout_s": values.get("stall_timeout"),
        "backend": values.get("backend"),
        "address": values.get("address"),
        "job_dir": values.get("job_dir"),
        "memory": values.get("memory"),
        "cache": values.get("cache"),
        "ps_command": values.get("ps_cmd") or None,
        "untracked": values.get("untracked"),
        "resources": parse_job_settings(resources, "resources") if resources else None,
        "labels": parse_job_settings(labels, "labels") if labels else None,
        "grace_s": values.get("grace"),
    }


def start_layers(
    flags: dict[str, Any],
    config_file: str | None,
    resumed: str | None = None,
    *,
    fresh: bool = False,
    new_dir: str | None = None,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """``RunConfig.merge``'s layers for ``start``'s options, and how each names its
    settings: a resumed cluster's settings (``fresh``, ``new_dir``: see
    ``resumed_settings``), the cluster file's keys (naming the file), then the flags
    given."""
    from clusterflow.manager.config import Spelling

    layers = [
        resumed_settings(resumed, fresh=fresh, new_dir=new_dir) if resumed else {},
        load_cluster_file(config_file) if config_file else {},
        {k: v for k, v in flags.items() if v is not None},
    ]
    spellings = [
        Spelling(where=f"the settings of cluster {resumed}"),
        Spelling(where=f"cluster file {config_file!r}"),
        Spelling(START_FLAGS),
    ]
    return layers, spellings


def load_cluster_file(path: str) -> dict[str, Any]:
    data = read_yaml(path, "cluster file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path!r} must hold a mapping, not {type(data).__name__}")
    from clusterflow.manager.config import FILE_KEYS

    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise ConfigError(
            f"cluster file {path!r}: unknown key {unknown[0]!r}; "
            f"known: {', '.join(sorted(FILE_KEYS))}"
        )
    return data


def resumed_settings(cluster_id: str, *, fresh: bool, new_dir: str | None) -> dict[str, Any]:
    """A finished cluster's settings, writing checkpoints where it wrote them.

    A resume that would restore nothing is refused rather than started over without a
    word: with no committed checkpoint, ``--fresh`` must say that starting over is
    meant (the new cluster then writes checkpoints in its own folder); with one,
    ``--fresh`` is refused unless ``--checkpoint-dir`` names another place, since the
    tasks would restore it anyway.
    """
    from clusterflow.manager import registry
    from clusterflow.manager.restore import newest_committed

    old = registry.find(cluster_id)
    if registry.effective_status(old.read_state()) not in registry.TERMINAL:
        raise ConfigError(f"cluster {old.id} is still running: stop it before resuming it")
    settings = old.read_config()
    settings.pop("grace_s", None)  # --grace always has a value: the option decides
    url = settings.get("checkpoint_dir") or str(old.path / "checkpoints")
    kind = kinds.find(settings.get("backend") or kinds.LOCAL.name)
    manager_elsewhere = kind is not None and kind.manager_in_ray
    if manager_elsewhere and "://" not in url and not Path(url).exists():
        # On its manager's node, which this machine may not see: the tasks look there.
        click.echo(f"clusterflow: resuming cluster {old.id} from what {url} holds", err=True)
        return {**settings, "checkpoint_dir": url}
    try:
        newest = newest_committed(url)
    except (ClusterflowError, OSError) as exc:
        raise ConfigError(
            f"cannot read the checkpoints of cluster {old.id} at {url}: {exc}"
        ) from exc
    if newest is None:
        if not fresh:
            raise ConfigError(
                f"cluster {old.id} committed no checkpoint in {url}, so there is nothing to "
                "resume; add --fresh to start its settings over from step 0"
            )
        click.echo(f"clusterflow: cluster {old.id} left no checkpoint; starting over", err=True)
        return settings  # its own checkpoint_dir if it named one; else the new cluster's
    if fresh and not new_dir:
        raise ConfigError(
            f"--fresh: cluster {old.id} has a checkpoint at step {newest.step} in {url}, "
            "which its tasks would restore; drop --fresh to resume from it, or give "
            "--checkpoint-dir to start over elsewhere"
        )
    if not fresh:
        click.echo(
            f"clusterflow: resuming cluster {old.id} from step {newest.step} ({newest.directory})",
            err=True,
        )
    return {**settings, "checkpoint_dir": url}
