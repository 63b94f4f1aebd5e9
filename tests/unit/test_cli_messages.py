"""A bad value's message names what the user wrote, in one line, with exit code 2.

The same check (``RunConfig``) judges a value whether it came from a flag, a cluster
file or a library call, so its messages once named whichever spelling the check's
author had in mind: ``start --grace -5`` said ``grace_s``, a cluster file's ``workers:
two`` said ``--workers``. ``RunConfig.merge`` now spells each setting as the layer it
came from does (``cli/main.py`` ``start_layers``); a library caller of ``RunConfig``
reads the field's name. The data service's "cannot tell the format" names the remedy of
the context the path was given in (``format=`` exists only on ``ArrowSource``).
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from clusterflow.cli.main import cli, main
from clusterflow.cli.start_settings import START_FLAGS
from clusterflow.manager.config import FILE_KEYS

pytestmark = pytest.mark.timeout(60)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``clusterflow ARGS``' error line; fails unless it exits 2 with exactly one line."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


FLAG_CASES = [
    (["--grace", "-5"], "--grace must be a positive number, got -5.0"),
    (["--grace", "0"], "--grace must be a positive number, got 0.0"),
    (["--stall-timeout", "0"], "--stall-timeout must be a positive number, got 0.0"),
    (["--max-restarts", "-1"], "--max-restarts must be a non-negative integer, got -1"),
    (["--workers", "-1"], "--workers must be a non-negative integer, got -1"),
    (["--workers", "5:2"], "--workers 5:2: MAX must be at least MIN"),
    (["--workers", "0:3"], "--workers 0:3: MIN must be at least 1"),
    (["--workers", "a:b"], "--workers must be N or MIN:MAX with whole numbers, got 'a:b'"),
    (["--workers", "two"], "--workers must be a non-negative integer, got 'two'"),
    (["--ps", "-1"], "--ps must be a non-negative integer, got -1"),
    (["--replicas-per-host", "0"], "--replicas-per-host must be a positive integer, got 0"),
    (["--untracked", "foo"], "--untracked names unknown job 'foo'"),
    (["--checkpoint-dir", " "], "--checkpoint-dir must be a path or URL, got ' '"),
    (["--address", "h:1"], "--address needs --backend ray"),
    (["--job-dir", "x"], "--job-dir needs --backend ray"),
    (["--label", "worker:a=b"], "--label needs --backend ray"),
    (["--backend", "ray", "--memory", "4X"], "--memory must be auto or a size such as 4G"),
    (["--backend", "ray", "--label", "boss:a=b"], "--label names unknown job 'boss'"),
]


@pytest.mark.parametrize(("flags", "message"), FLAG_CASES, ids=[c[1][:30] for c in FLAG_CASES])
def test_a_bad_flag_is_named_as_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins ``START_FLAGS`` and the flags layer's spelling: ``--grace -5`` says
    ``--grace`` (it said ``grace_s``), and each RunConfig check named through a flag."""
    line = run_cli(["start", *flags, "--", "true"], capsys)
    assert message in line, line
    assert "_s " not in line and "grace_s" not in line


@pytest.mark.parametrize("command", ["start", "tune"])
def test_grace_is_named_as_typed_by_start_and_by_tune(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins tune's check of start's options (``cli/tune.py`` ``_start_layer``): it names
    ``--grace`` too, before a study is made."""
    extra = (
        ["--study", "s", "--metric", "m", "--param", "lr=uniform:0:1"] if command == "tune" else []
    )
    line = run_cli([command, *extra, "--grace", "-5", "--", "true"], capsys)
    assert line == "error: --grace must be a positive number, got -5.0"


FILE_CASES = [
    ("workers: two", "workers must be a non-negative integer, got 'two'"),
    ("workers: {min: 5, max: 2}", "workers 5:2: MAX must be at least MIN"),
    ("workers: '0:3'", "workers 0:3: MIN must be at least 1"),
    ("ps: -1", "ps must be a non-negative integer, got -1"),
    ("chief: maybe", "chief must be true or false, got 'maybe'"),
    ("stall_timeout_s: 0", "stall_timeout_s must be a positive number, got 0"),
    ("max_restarts: lots", "max_restarts must be a non-negative integer, got 'lots'"),
    ("untracked: 3", "untracked must be a list or a comma-separated string, got 3"),
    ("env: [A]", "env must be a mapping, got ['A']"),
    ("address: h:1", "address needs backend ray"),
    ("placement_timeout_s: -1", "placement_timeout_s must be a positive number, got -1"),
    (
        "backend: ray\nresources: {worker: {memory: 4X}}",
        "resources of job worker: memory '4X' is not a size",
    ),
]


@pytest.mark.parametrize(("text", "message"), FILE_CASES, ids=[c[0][:20] for c in FILE_CASES])
def test_a_bad_key_of_a_cluster_file_is_named_as_the_key_of_that_file(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins the file layer's spelling: ``workers: two`` names the key ``workers`` and the
    file (it said ``--workers``, an option the user never typed)."""
    (tmp_path / "c.yaml").write_text(text + "\n")
    line = run_cli(["start", "-c", "c.yaml", "--", "true"], capsys)
    assert line == f"error: cluster file 'c.yaml': {message}" or (
        line.startswith("error: cluster file 'c.yaml': ") and message in line
    ), line
    assert " --" not in line, line


def test_a_file_key_beside_a_flag_names_each_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins the choice of spelling per setting: the file's ``address`` and the command
    line's ``--backend`` in one message."""
    (tmp_path / "c.yaml").write_text("address: h:1\n")
    line = run_cli(["start", "-c", "c.yaml", "--backend", "local", "--", "true"], capsys)
    assert line == (
        "error: cluster file 'c.yaml': address needs --backend ray (local tasks share this machine)"
    )


def test_every_flag_spelling_is_an_option_of_start() -> None:
    """Pins ``START_FLAGS`` to the CLI: each spelling (but the job's command) is one of
    start's options, and every file key a flag sets has one."""
    start = cli.commands["start"]  # type: ignore[attr-defined]
    options = {o for p in start.params if isinstance(p, click.Option) for o in p.opts}
    named = {flag for key, flag in START_FLAGS.items() if key != "command"}
    assert named <= options, named - options
    assert set(START_FLAGS) - {"grace_s"} <= FILE_KEYS


# The data service's formats -------------------------------------------------------------


def test_an_unknown_format_names_the_remedy_of_each_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins ``UnknownFormatError.with_remedy`` at its two callers: ``ArrowSource`` offers
    its ``format=``; a path given as a source offers ``ArrowSource(path, format=...)``;
    ``clusterflow cache create --from``, which has no format option, asks for file
    names it can tell (it said ``pass format=``)."""
    from clusterflow.data import ArrowSource, UnknownFormatError, distributed_dataset

    (tmp_path / "x.dat").write_text("a,b\n1,2\n")
    with pytest.raises(UnknownFormatError, match="pass format= one of parquet, ipc, csv"):
        ArrowSource("x.dat")
    with pytest.raises(UnknownFormatError, match=r"pass ArrowSource\('x.dat', format=\.\.\.\)"):
        distributed_dataset("x.dat", batch_size=2)
    line = run_cli(["cache", "create", "m", "--from", "x.dat", "--partitions", "1"], capsys)
    assert "no name ends in .parquet" in line and "name them so" in line, line
    assert "format=" not in line, line


def test_a_task_count_over_the_limit_names_the_counts_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pins the task-count limit's spelling: the file's ``workers`` and the flag's
    ``--replicas-per-host`` (it named three flags whatever the user wrote)."""
    (tmp_path / "c.yaml").write_text("workers: 5000\n")
    line = run_cli(["start", "-c", "c.yaml", "--replicas-per-host", "4", "--", "true"], capsys)
    assert line == (
        "error: cluster file 'c.yaml': ps 0, workers 5000 and --replicas-per-host 4 ask for "
        "20008 task processes; at most 10000 are allowed"
    )
