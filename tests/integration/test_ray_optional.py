"""Ray is optional: without it clusterflow imports, runs local clusters, and says how to
get Ray when asked for the Ray backend.

Ray is installed in the test environment (the Ray backend's tests need it), so these
tests hide it: the CLI runs in an interpreter where ``import ray`` fails, as it does
where Ray was never installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WITHOUT_RAY = (
    "import sys\n"
    "sys.modules['ray'] = None  # import ray now raises ImportError\n"
    "from clusterflow.cli.main import main\n"
    "main(sys.argv[1:])\n"
)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "RAY_"))}
    env["CLUSTERFLOW_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_local_clusters_run_without_ray(tmp_path: Path) -> None:
    done = cli(tmp_path, "start", "--workers", "1", "--", sys.executable, "-c", "print('hi')")
    assert done.returncode == 0, done.stderr
    assert "[worker:0] hi" in done.stdout
    listed = cli(tmp_path, "ps", "-a")
    assert listed.returncode == 0 and "succeeded" in listed.stdout, listed.stderr
    (cluster,) = (tmp_path / "clusters").iterdir()
    described = cli(tmp_path, "describe", cluster.name, "--json")
    assert json.loads(described.stdout)["backend"] == "local"


def test_the_ray_backend_without_ray_says_how_to_get_it(tmp_path: Path) -> None:
    out = cli(tmp_path, "start", "--backend", "ray", "--", sys.executable, "-c", "pass")
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: --backend ray needs Ray: pip install 'clusterflow[ray]'")
