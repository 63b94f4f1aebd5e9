"""The warm zygote a standby supervisor keeps: it runs a job's command in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterflow.backends.zygote import runnable

pytestmark = pytest.mark.integration

PY = sys.executable


@pytest.mark.parametrize(
    ("command", "ok"),
    [
        ([PY, "train.py", "--epochs", "3"], True),
        ([PY, "-u", "train.py"], True),
        ([PY, "-m", "pkg.train", "-x"], True),
        ([PY, "-c", "print(1)"], True),
        ([PY], False),
        ([PY, "-m"], False),
        ([PY, "-O", "train.py"], False),  # a flag it would not honour: start it as usual
        (["/bin/echo", "hi"], False),
        (["python-does-not-exist", "train.py"], False),
        ([], False),
    ],
)
def test_runnable_accepts_only_what_it_can_run_as_python_would(
    command: list[str], ok: bool
) -> None:
    assert runnable(command) is ok


def _zygote(tmp_path: Path, request: dict[str, object] | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    payload = "" if request is None else json.dumps(request) + "\n"
    return subprocess.run(
        [PY, "-m", "clusterflow.backends.zygote"],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=90,
        check=False,
    )


@pytest.mark.timeout(120)
def test_the_zygote_becomes_the_job_with_its_argv_env_cwd_and_exit_code(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "helper_mod.py").write_text("VALUE = 'imported from the script dir'\n")
    (work / "job.py").write_text(
        "import os, sys, torch, helper_mod\n"
        "print(sys.argv, os.environ['ONLY_IN_JOB'], os.getcwd(), helper_mod.VALUE)\n"
        "print('rand', torch.rand(1).item())\n"
        "sys.exit(7)\n"
    )
    request = {
        "argv": [PY, "-u", str(work / "job.py"), "--flag", "x"],
        "env": {"ONLY_IN_JOB": "yes", "PATH": os.environ["PATH"]},
        "cwd": str(work),
    }
    done = _zygote(tmp_path, request)
    assert done.returncode == 7, done.stderr
    first, second = done.stdout.splitlines()
    assert (
        first == f"{[str(work / 'job.py'), '--flag', 'x']} yes {work} imported from the script dir"
    )
    assert second.startswith("rand ")  # torch was imported before; it works as usual


@pytest.mark.timeout(120)
def test_eof_ends_an_unused_zygote_cleanly_and_c_code_runs(tmp_path: Path) -> None:
    assert _zygote(tmp_path, None).returncode == 0
    request = {
        "argv": [PY, "-c", "import sys; print('c', sys.argv[1:]); raise SystemExit(3)", "a"],
        "env": {},
        "cwd": str(tmp_path),
    }
    done = _zygote(tmp_path, request)
    assert (done.returncode, done.stdout) == (3, "c ['a']\n"), done.stderr
