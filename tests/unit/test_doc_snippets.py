"""Every code block of README.md and docs/*.md works as written.

* Every Python block compiles, and every ``clusterflow`` name it uses exists as a fresh
  process finds it (``import``, ``from ... import``, ``cf.x.y``; a subpackage reached as
  an attribute must be exported, not there because something imported it already), and
  every call of one of them passes arguments its signature takes.
* Every Python block runs: alone, here (one process, each block in its own folder and
  namespace); as a cluster's job, in ``tests/integration/test_doc_snippets_in_cluster.py``; or it
  carries ``<!-- not run: REASON -->`` (doc_snippets.py says how a page marks which).
* Every ``clusterflow COMMAND [SUBCOMMAND] --option`` a shell block shows is an option
  that COMMAND's ``--help`` lists (hidden options do not count).
* Every YAML block is a cluster file ``clusterflow start -c`` accepts, or is marked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from doc_snippets import (
    SNIPPETS,
    Block,
    all_blocks,
    name_problems,
    prepare,
    python_blocks,
    runs_alone,
)

from clusterflow.cli.main import cli
from clusterflow.cli.start_settings import load_cluster_file

pytestmark = pytest.mark.timeout(300)

CLUSTER_VARIABLES = (
    "TF_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
SHELL = frozenset({"sh", "bash", "shell", "console", ""})
_COMMAND = re.compile(r"(?:^|(?<=[\s(]))clusterflow[ \t]+([a-z][\w-]*)(.*)$")
_CUTS = (" -- ", " #", "|", "&&", ";", ">")


def environment(home: Path) -> dict[str, str]:
    """This environment without a surrounding cluster's variables, with its own home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in CLUSTER_VARIABLES and not k.startswith("CLUSTERFLOW_")
    }
    env["CLUSTERFLOW_HOME"] = str(home)
    return env


# Coverage ------------------------------------------------------------------------------


def test_every_python_block_is_marked_rightly() -> None:
    """Pins the markers: a ``snippet`` marker (on a Python block) names a ``SNIPPETS``
    entry (each used once), whose swaps all occur in its block and are announced in the
    marker; a ``not run`` marker, on any block, gives a reason."""
    problems = []
    used: list[str] = []
    for block in all_blocks():
        if block.marker == "not run" and len(block.note.split()) < 3:
            problems.append(f"{block.where}: `not run` needs a reason, got {block.note!r}")
        if block.marker == "snippet" and block.language != "python":
            problems.append(f"{block.where}: a `snippet` marker on a {block.language} block")
    for block in python_blocks():
        if block.marker == "snippet":
            name = block.snippet_id
            if name not in SNIPPETS:
                problems.append(f"{block.where}: marker {block.note!r} names no SNIPPETS entry")
                continue
            used.append(name)
            run = SNIPPETS[name]
            for old, _ in run.replace:
                if old not in block.text:
                    problems.append(f"{block.where}: {name} swaps {old!r}, not in the block")
            if run.replace and not block.says_resized:
                problems.append(
                    f"{block.where}: the suite changes this block ({name}): say how in the "
                    "marker, `<!-- snippet: ID (what the suite changes) -->`"
                )
    problems += [f"SNIPPETS[{n!r}] is used by no block" for n in sorted(set(SNIPPETS) - set(used))]
    problems += [
        f"SNIPPETS[{n!r}] is used twice" for n in sorted({n for n in used if used.count(n) > 1})
    ]
    assert not problems, "\n".join(problems)


def test_every_yaml_block_is_a_cluster_file_start_accepts(tmp_path: Path) -> None:
    """Pins the cluster file of docs/cli.md to the loader: every key it shows is one
    ``start -c`` accepts, and the whole file (with a command) makes a valid config, or
    the block says why it is not a cluster file."""
    from clusterflow.manager.config import RunConfig

    checked = 0
    for block in all_blocks():
        if block.language != "yaml" or block.marker == "not run":
            continue
        path = tmp_path / "cluster.yaml"
        path.write_text(block.text, encoding="utf-8")
        settings = load_cluster_file(str(path))
        RunConfig.merge(settings, {"command": ("python", "train.py")})  # Ray is not reached
        checked += 1
    assert checked, "no cluster file on any page"


# Names --------------------------------------------------------------------------------


def test_every_python_block_compiles() -> None:
    """Pins the syntax of every Python block."""
    problems = []
    for block in python_blocks():
        try:
            compile(block.text, block.where, "exec")
        except SyntaxError as exc:
            problems.append(f"{block.page}:{block.line + (exc.lineno or 1) - 1}: {exc.msg}")
    assert not problems, "\n".join(problems)


def test_every_clusterflow_name_a_block_uses_exists() -> None:
    """Pins every public name the docs use: `cf.data.distributed_dataset`,
    `cf.strategies.serve_worker` (both absent from `clusterflow`'s exports once, so the
    pages' snippets failed on import), every `from clusterflow... import`, and the
    keywords each documented call passes."""
    problems = [p for block in python_blocks() for p in name_problems(block)]
    assert not problems, "\n".join(problems)


def test_a_name_there_only_by_an_earlier_import_is_refused() -> None:
    """The check itself: a subpackage that ``clusterflow`` does not export is refused
    even when this process imported it already (it then is an attribute by side effect,
    which a user's fresh process would not have)."""
    import clusterflow.checkpoint  # noqa: F401  (sets clusterflow.checkpoint as a side effect)

    block = Block("x.md", 1, "python", "import clusterflow as cf\ncf.checkpoint", None, "")
    assert [p for p in name_problems(block) if "does not export 'checkpoint'" in p]
    wrong = Block("x.md", 1, "python", "cf.PipelineStrategy(shedule='1f1b')", None, "")
    assert [p for p in name_problems(wrong) if "shedule" in p]


# Running ------------------------------------------------------------------------------

_RUNNER = """
import json, os, sys, traceback
failed = []
for where, folder, code in json.loads(sys.stdin.read()):
    os.chdir(folder)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(where + "\\n" + traceback.format_exc())
if failed:
    sys.exit("\\n".join(failed))
"""


def test_every_block_that_runs_alone_runs(tmp_path: Path) -> None:
    """Pins every block without a cluster: each runs (with its ``SNIPPETS`` setup) in one
    fresh interpreter, in a folder of its own, without a surrounding cluster's
    variables; the first failure of any fails the test, naming the block."""
    alone = [b for b in python_blocks() if runs_alone(b)]
    assert len(alone) >= 8, [b.where for b in alone]
    jobs = []
    for i, block in enumerate(alone):
        folder = tmp_path / f"block{i}"
        prepare(block, folder)
        jobs.append((block.where, str(folder), block.program()))
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        env=environment(tmp_path / "home"),
        cwd=tmp_path,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]


# Shell blocks ---------------------------------------------------------------------------


def help_options(command: click.Command) -> set[str]:
    """The options ``command --help`` lists: every spelling of every visible option."""
    names = {"-h", "--help"}
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def shell_commands() -> list[tuple[str, list[str]]]:
    """``(where, words after clusterflow)`` of every command line in a shell block,
    without the job's command (after `` -- ``), comments and quoted values' contents."""
    out = []
    for block in all_blocks():
        if block.language not in SHELL:
            continue
        text = block.text.replace("\\\n", " ")
        for offset, line in enumerate(text.splitlines()):
            match = _COMMAND.search(line)
            if not match:
                continue
            rest = match.group(1) + match.group(2)
            for cut in _CUTS:
                rest = rest.split(cut)[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            out.append((f"{block.page}:{block.line + offset}", words))
    return out


def test_every_option_a_shell_block_shows_is_in_its_commands_help() -> None:
    """Pins every ``clusterflow ...`` line of every shell block to the CLI: its command
    (and a group's subcommand, ``cache create``) exists and ``--help`` lists each option
    it passes."""
    problems = []
    lines = shell_commands()
    assert len(lines) >= 30, len(lines)
    for where, words in lines:
        command: click.Command = cli
        path = ["clusterflow"]
        for word in words:
            if word.startswith("-"):
                option = word.split("=")[0]
                if option not in help_options(command):
                    problems.append(f"{where}: `{' '.join(path)} --help` lists no {option}")
            elif isinstance(command, click.Group) and word in command.commands:
                command = command.commands[word]
                path.append(word)
            elif command is cli:
                problems.append(f"{where}: no command clusterflow {word}")
                break
    assert not problems, "\n".join(problems)
