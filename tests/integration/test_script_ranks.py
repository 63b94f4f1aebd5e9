"""The harness that runs a script as every rank (``script_ranks.py``) leaves nothing
behind: a rank that hangs past the deadline fails the run, named with what it printed,
and what it started dies with it (a grandchild once outlived a failed run, asleep in a
futex, docs/testing.md)."""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from script_ranks import run_script_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HANGS = """
import os, signal, subprocess, sys
out = sys.argv[1]
if os.environ["RANK"] == "1":
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    with open(out + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(out + ".tmp", out)
    print("rank 1 started its child", flush=True)
    signal.pause()
print("rank 0 done", flush=True)
"""


def _ends_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` has ended (or ends within ``timeout_s``). A SIGKILL takes
    effect once the process is next scheduled, so its end is waited for, on a pidfd
    that becomes readable when it exits (a zombie counts as ended)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # gone and reaped
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_rank_past_the_deadline_fails_the_run_and_what_it_started_dies(tmp_path: Path) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError) as failed:
        run_script_ranks(script, [str(pid_file)], world=2, timeout_s=4)
    text = str(failed.value)
    assert "ranks [1] still running after 4s" in text
    assert "rank 1 started its child" in text  # what it printed before it hung
    child = int(pid_file.read_text())
    assert _ends_within(child, 30), f"rank 1's child {child} outlived the run"


def test_every_ranks_output_comes_back_when_all_exit_0(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text(
        'import os\nprint("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])\n'
    )
    logs = run_script_ranks(script, [], world=3, timeout_s=60)
    assert [log.strip() for log in logs] == [f"rank {rank} of 3" for rank in range(3)]


def test_a_rank_that_fails_is_named_with_its_output(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(
        'import os, sys\nif os.environ["RANK"] == "1":\n    sys.exit("rank 1 gives up")'
    )
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*rank 1 gives up"):
        run_script_ranks(script, [], world=2, timeout_s=60)
