"""How ``clusterflow tune`` reads its words: a study run, ``ls`` or ``describe``, with the
group's ``--storage`` before or after the subcommand, and bad input as one line, exit 2."""

from __future__ import annotations

import optuna  # a test dependency (the `test` extra): its absence is a failure, not a skip
import pytest

from clusterflow.cli.main import cli, main

pytestmark = pytest.mark.usefixtures("home")


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A study in a storage of its own (one for the module: making one takes a second)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('storage') / 'other.db'}"
    study = optuna.create_study(study_name="elsewhere", storage=url, direction="maximize")
    study.enqueue_trial({"x": 0.5})
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    study.tell(trial, 0.25)
    return url


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _parsed(*argv: str) -> tuple[list[str], dict[str, object]]:
    """What the group makes of ``tune ARGV``: (the subcommand and its words, its params)."""
    group = cli.commands["tune"]
    ctx = group.make_context("tune", list(argv))
    return [*ctx._protected_args, *ctx.args], dict(ctx.params)


def test_a_subcommands_help_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "tune", "ls", "-h")
    assert code == 0 and out.splitlines()[0] == "Usage: clusterflow tune ls [OPTIONS]"
    code, out, _ = _cli(capsys, "tune", "describe", "--help")
    assert code == 0 and out.splitlines()[0] == "Usage: clusterflow tune describe [OPTIONS] NAME"
    code, out, _ = _cli(capsys, "tune", "-h")
    assert code == 0
    assert (
        out.splitlines()[0]
        == "Usage: clusterflow tune [OPTIONS] -- COMMAND...  |  ls  |  describe NAME"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--storage", "{url}", "ls"],
        ["ls", "--storage", "{url}"],
        ["--storage={url}", "ls"],
        ["--storage", "{url}", "ls", "--storage", "{url}"],
    ],
)
def test_storage_before_or_after_ls(
    capsys: pytest.CaptureFixture[str], storage: str, argv: list[str]
) -> None:
    code, out, err = _cli(capsys, "tune", *(a.replace("{url}", storage) for a in argv))
    assert code == 0, err
    assert out.splitlines()[1].split()[:3] == ["elsewhere", "maximize", "1"], out


def test_storage_before_describe(capsys: pytest.CaptureFixture[str], storage: str) -> None:
    code, out, err = _cli(capsys, "tune", "--storage", storage, "describe", "elsewhere")
    assert code == 0, err
    assert "0 (best)" in out and "0.25" in out


def test_words_after_the_double_dash_are_the_trials_command() -> None:
    words, params = _parsed("--study", "ls", "--metric", "m", "--", "ls", "{x}")
    assert words == [] and params["study"] == "ls" and params["command"] == ("ls", "{x}")
    words, params = _parsed("--workers", "2", "--", "describe")
    assert words == [] and params["command"] == ("describe",) and params["workers"] == 2
    words, params = _parsed("--storage", "sqlite:///x.db", "describe", "s")
    assert words == ["describe", "s"] and params["storage"] == "sqlite:///x.db"
    words, params = _parsed("--resume", "ls")  # a flag takes no value: ls is the subcommand
    assert words == ["ls"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--trials", "3", "ls"], "error: --trials is for running a study, not for `tune ls`"),
        (["--workers", "2", "describe", "s"], "error: --workers is for running a study, not"),
        (["ls", "--bogus"], "error: No such option '--bogus'. (see `clusterflow tune ls -h`)"),
        (["describe"], "error: Missing argument 'NAME'."),
        (["--storage", "a.db", "ls", "--storage", "b.db"], "error: two storages given"),
    ],
)
def test_bad_subcommand_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    code, out, err = _cli(capsys, "tune", *argv)
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err


GIVEN = {
    "chief": ["--chief"],
    "ps": ["--ps", "1"],
    "workers": ["--workers", "2"],
    "evaluator": ["--evaluator"],
    "replicas_per_host": ["--replicas-per-host", "2"],
    "max_restarts": ["--max-restarts", "1"],
    "warm_restarts": ["--warm-restarts"],
    "checkpoint_dir": ["--checkpoint-dir", "/ckpt"],
    "stall_timeout": ["--stall-timeout", "5"],
    "ps_cmd": ["--ps-cmd", "python ps.py"],
    "untracked": ["--untracked", "evaluator"],
    "backend": ["--backend", "ray"],
    "address": ["--address", "127.0.0.1:6379"],
    "resources_": ["--resources", "worker:CPU=2"],
    "labels_": ["--label", "worker:zone=a"],
    "job_dir": ["--job-dir", "."],
    "memory": ["--memory", "4G"],
    "cache": ["--cache", "digits"],
    "grace": ["--grace", "3"],
}
"""Every cluster option of ``start`` (but --detach, --resume and -c), given to ``tune``."""


def test_every_start_option_reaches_each_trials_cluster() -> None:
    from clusterflow.cli.main import start
    from clusterflow.cli.tune import _NOT_FOR_TRIALS, _start_layer

    options = {str(p.name) for p in start.params} - _NOT_FOR_TRIALS - {"config_file"}
    assert options == set(GIVEN)  # a new start option: give it here, and map it in tune
    _, params = _parsed(*(word for words in GIVEN.values() for word in words), "--", "x")
    layer = _start_layer(params)
    assert len(layer) == len(GIVEN), sorted(layer)  # each became a setting of the cluster
    assert (layer["backend"], layer["resources"], layer["cache"]) == (
        "ray",
        {"worker": {"CPU": 2.0}},
        "digits",
    )
