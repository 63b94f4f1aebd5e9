"""Bad input to every CLI command: one line on stderr, ``error: ...``, a non-zero exit.

A traceback is never an answer to a mistake a user can fix; neither is a message that
does not say which value was wrong. A group given no command (``clusterflow`` alone, the
first thing a new user types) is not a mistake: its help, as written, usage exit.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration  # every case runs the CLI as a process

PY = sys.executable
COMMANDS = ("start", "ps", "describe", "logs", "attach", "stop", "server", "secret")

SPEC = ("--job", "ps", "--task", "0", "--secret-file", "good.secret")
"""The rest of a valid `server` command line, given a spec file."""
PS0 = ("server", "--cluster-spec", "spec.json", "--job", "ps", "--task", "0")
"""A valid `server` command line but for its secret."""
SECRET = ("--secret-file", "good.secret")


def _write_inputs(cf: Clusterflow) -> None:
    """The files the cases below refer to, relative to the CLI's working folder."""
    w = cf.workdir
    (w / "bad.yaml").write_text("workers: [1,\n  ps: {\n")
    (w / "unknown-key.yaml").write_text("wrokers: 2\ncommand: python train.py\n")
    (w / "badtype.yaml").write_text("workers: many\ncommand: python train.py\n")
    (w / "list.yaml").write_text("- workers\n")
    (w / "good.secret").write_text("ab" * 32 + "\n")
    (w / "bad.secret").write_text("not hex\n")
    (w / "existing").write_text("keep me\n")
    (w / "malformed.json").write_text('{"ps": ["127.0.0.1:5000"')
    (w / "notamap.json").write_text('["127.0.0.1:5000"]')
    (w / "spec.json").write_text(json.dumps({"ps": ["127.0.0.1:5000"]}))
    (w / "badport.json").write_text(json.dumps({"ps": ["127.0.0.1:http"]}))
    (w / "dup.json").write_text(
        json.dumps({"ps": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5000"]})
    )
    (w / "elsewhere.json").write_text(json.dumps({"ps": ["192.0.2.1:5000"]}))


USAGE_CASES = [
    # start
    (["start"], "no job command"),
    (["start", "--workers", "2"], "no job command"),
    (["start", "--workers", "-1", "--", PY], "--workers must be a non-negative integer, got -1"),
    (
        ["start", "--workers", "abc", "--", PY],
        "--workers must be a non-negative integer, got 'abc'",
    ),
    (["start", "--workers", "5:2", "--", PY], "--workers 5:2: MAX must be at least MIN"),
    (["start", "--ps", "x", "--", PY], "'x' is not a valid integer"),
    (["start", "--workers", "0", "--", PY], "no task"),
    (
        ["start", "--replicas-per-host", "0", "--", PY],
        "--replicas-per-host must be a positive integer, got 0",
    ),
    (["start", "--untracked", "foo", "--", PY], "unknown job 'foo'"),
    (["start", "--untracked", "worker", "--", PY], "every job is untracked"),
    (["start", "--grace", "0", "--", PY], "--grace must be a positive number"),
    (["start", "-c", "missing.yaml", "--", PY], "cannot read cluster file 'missing.yaml'"),
    (["start", "-c", "bad.yaml"], "not valid YAML: line"),
    (["start", "-c", "unknown-key.yaml"], "unknown key 'wrokers'"),
    (["start", "-c", "badtype.yaml"], "got 'many'"),
    (["start", "-c", "list.yaml"], "must hold a mapping"),
    (["start", "--bogus", "--", PY], "No such option '--bogus'"),
    # ps
    (["ps", "--bogus"], "No such option '--bogus'"),
    (["ps", "extra"], "unexpected extra argument"),
    # describe / logs / attach / stop
    (["describe", "nosuch"], "no cluster 'nosuch'"),
    (["describe"], "Missing argument"),
    (["logs", "nosuch"], "no cluster 'nosuch'"),
    (["logs", "../x"], "invalid cluster id"),
    (["attach", "nosuch"], "no cluster 'nosuch'"),
    (["stop", "nosuch"], "no cluster 'nosuch'"),
    (["stop", "nosuch", "--grace", "soon"], "'soon' is not a valid float"),
    # server
    (["server", "--cluster-spec", "missing.json", *SPEC], "cannot read cluster spec"),
    (["server", "--cluster-spec", "malformed.json", *SPEC], "malformed.json' is not valid"),
    (["server", "--cluster-spec", "notamap.json", *SPEC], "must map job names to addresses"),
    ([*PS0[:3], "--job", "chief", "--task", "0", *SECRET], "unknown job 'chief'"),
    ([*PS0[:3], "--job", "ps", "--task", "3", *SECRET], "no task 3 in job 'ps'"),
    ([*PS0[:3], "--job", "ps", "--task", "x", *SECRET], "'x' is not a valid integer"),
    (["server", "--cluster-spec", "badport.json", *SPEC], "127.0.0.1:http"),
    (["server", "--cluster-spec", "dup.json", *SPEC], "127.0.0.1:5000"),
    ([*PS0], "no cluster secret"),
    (
        [*PS0, "--secret-file", "missing.secret"],
        "missing.secret",
    ),
    (
        [*PS0, "--secret-file", "bad.secret"],
        "not hex",
    ),
    (["server", "--cluster-spec", "elsewhere.json", *SPEC], "cannot serve ps:0 at 192.0.2.1:5000"),
    (["server", "--job", "ps", "--task", "0"], "Missing option '--cluster-spec'"),
    # secret
    (["secret", "existing"], "'existing' exists"),
    (["secret", "no/such/dir/secret"], "cannot write secret"),
    # the group
    (["frobnicate"], "No such command 'frobnicate'"),
    (["--bogus"], "No such option '--bogus'"),
]


def _assert_one_line_error(done: subprocess.CompletedProcess[str], expect: str) -> str:
    assert done.returncode != 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: "), done.stderr
    assert expect in lines[0], lines[0]
    return lines[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "expect"), USAGE_CASES, ids=[" ".join(a[:4]) for a, _ in USAGE_CASES]
)
def test_bad_input_is_one_error_line(cf: Clusterflow, args: list[str], expect: str) -> None:
    _write_inputs(cf)

    done = cf.run(*args)

    _assert_one_line_error(done, expect)
    assert done.returncode == 2
    assert (cf.workdir / "existing").read_text() == "keep me\n"
    assert not cf.ids(), "a refused start must not create a cluster"


SLEEP = (PY, "-c", "import time; time.sleep(60)")
"""A worker that ends only when stopped, so only the broken task can end the run."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "tasks", "program"),
    [
        (
            ["--ps", "1", "--ps-cmd", "nosuch-program-xyz --flag", "--", *SLEEP],
            ["ps:0"],
            "nosuch-program-xyz",
        ),
        # Both workers fail alike: the summary names whichever the manager saw first.
        (
            ["--workers", "2", "--", "/nonexistent/prog"],
            ["worker:0", "worker:1"],
            "/nonexistent/prog",
        ),
    ],
    ids=["ps-cmd", "command"],
)
def test_a_command_that_cannot_run_fails_the_run_naming_the_task(
    cf: Clusterflow, args: list[str], tasks: list[str], program: str
) -> None:
    done = cf.run("start", *args)

    line = _assert_one_line_error(done, "exited with code 127")
    named = re.search(r"failed: task (\S+) exited", line)
    assert named is not None and named.group(1) in tasks, line
    assert done.returncode == 127
    assert f"cannot run '{program}': No such file or directory" in line
    task = named.group(1)
    said = f"[{task}] clusterflow: {task}: cannot run '{program}': No such file or directory"
    assert said in done.stdout.splitlines()
    cluster_id = cf.only_id()
    assert cf.state(cluster_id)["status"] == "failed"
    assert not cf.live(cluster_id)


@pytest.mark.timeout(60)
def test_logs_and_attach_of_a_finished_cluster(cf: Clusterflow) -> None:
    done = cf.run("start", "--workers", "2", "--", PY, "-c", "print('hi [/x]')")
    assert done.returncode == 0, done.stderr
    cluster_id = cf.only_id()
    # A command is shown as given, never read as table markup ("[/x]" closes no tag).
    listed = cf.run("ps", "-a")
    assert listed.returncode == 0, listed.stderr
    assert "print('\"'\"'hi [/x]'\"'\"')" in listed.stdout

    nosuch = cf.run("logs", cluster_id, "--task", "nosuch:9")
    line = _assert_one_line_error(nosuch, "no task 'nosuch:9'")
    assert "worker:0, worker:1" in line
    _assert_one_line_error(cf.run("logs", cluster_id, "--task", "worker"), "'worker'")
    _assert_one_line_error(cf.run("attach", cluster_id), "not running (succeeded)")
    # And what does work on a finished cluster:
    assert cf.run("logs", cluster_id, "--task", "worker:1").stdout == "hi [/x]\n"
    assert cf.run("stop", cluster_id).stdout == f"{cluster_id}: not running (succeeded)\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [["--version"], ["-V"], ["-h"], ["--help"], *([c, "-h"] for c in COMMANDS)],
    ids=" ".join,
)
def test_version_and_help_exit_zero(cf: Clusterflow, args: list[str]) -> None:
    done = cf.run(*args)

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    if args[0] in ("--version", "-V"):
        assert done.stdout.startswith("clusterflow, version ")
    else:
        assert "Usage: clusterflow" in done.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "commands"),
    [
        ([], ("start", "stop", "cache")),
        (["cache"], ("create", "drop")),
        (["ray-agents"], ("start",)),
    ],
    ids=["clusterflow", "cache", "ray-agents"],
)
def test_a_group_without_a_command_shows_its_help_as_written(
    cf: Clusterflow, args: list[str], commands: tuple[str, ...]
) -> None:
    done = cf.run(*args)

    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"Usage: clusterflow {' '.join(args)}".rstrip()), lines
    assert "Commands:" in lines, lines  # the help's own layout, not one joined line
    listed = {line.split()[0] for line in lines[lines.index("Commands:") + 1 :] if line.strip()}
    assert set(commands) <= listed, lines
    assert not any(line.startswith("error:") for line in lines), lines
