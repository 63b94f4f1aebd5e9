"""How ``benchmarks.scale`` finds the Python that has TensorFlow (its PSS rows' peer)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# benchmarks/ is a top-level folder of the repository, not part of the installed package.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.scale import tf_peer  # noqa: E402


def test_a_named_python_is_taken_and_a_missing_one_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(tf_peer.ENV_PYTHON, raising=False)
    assert tf_peer.find_python(sys.executable) == sys.executable
    missing = str(tmp_path / "python3")
    with pytest.raises(SystemExit, match=r"--tf-python: '.*python3' is not an executable"):
        tf_peer.find_python(missing)
    monkeypatch.setenv(tf_peer.ENV_PYTHON, missing)
    with pytest.raises(SystemExit, match=tf_peer.ENV_PYTHON):
        tf_peer.find_python(None)


def test_without_tensorflow_here_or_named_the_rows_are_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(tf_peer.ENV_PYTHON, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorflow" else real(name, *a),
    )
    with pytest.raises(tf_peer.TensorFlowMissing, match="--tf-python"):
        tf_peer.find_python(None)


def test_the_hosts_roles_need_only_the_standard_library_and_tensorflow() -> None:
    # TensorFlow's own venv has no clusterflow, psutil or torch: the module must load
    # there without them (the driver imports them inside its functions).
    code = (
        "import sys\n"
        "for name in ('torch', 'psutil', 'clusterflow', 'benchmarks.common', "
        "'benchmarks.scale.hosts'):\n"
        "    sys.modules[name] = None\n"
        "from benchmarks.scale import tf_peer\n"
        "tf_peer.main()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "nonsense"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("usage: python -m benchmarks.scale.tf_peer")
