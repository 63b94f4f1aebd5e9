"""Untrusted files and hostile values (docs/failure-semantics.md, "Hostile values").

* A checkpoint folder with a planted pickle, or a tampered safetensors file, is never
  executed or loaded: even when the attacker rewrote the manifest to match, reading
  ends in one ``CheckpointError`` line, and the pickle's payload never runs.
* A cluster file, a cluster spec or ``TF_CONFIG`` with huge task counts, ports out of
  range or shell metacharacters in an address: one line on stderr, exit code 2.
* ``plain`` auth on anything but loopback is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from clusterflow.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointStorage, PartInfo
from clusterflow.cli.main import main as cli_main
from clusterflow.errors import ConfigError
from clusterflow.ps.__main__ import main as ps_main
from clusterflow.rpc import Credentials, RpcServer
from clusterflow.train.cut import Checkpointer, load_module

if TYPE_CHECKING:
    from conftest import Clusterflow


class _Payload:
    """A pickle that, if anything ever unpickled it, would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _two_checkpoints(directory: Path) -> CheckpointStorage:
    model = _model()
    checkpointer = Checkpointer(model=model, directory=str(directory))
    checkpointer.save(1)
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpointer.save(2)
    return CheckpointStorage(str(directory))


def _forge(storage: CheckpointStorage, step: int, part: str, data: bytes) -> None:
    """Plants ``data`` as ``part`` of ``step`` and rewrites the manifest to vouch for it."""
    manifest = storage.at(step)
    assert manifest is not None
    folder = Path(storage.directory(step))
    info = manifest.parts[part]
    planted = f"{part}.planted{Path(info.file).suffix}"
    (folder / planted).write_bytes(data)
    forged = PartInfo(
        name=part,
        file=planted,
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        kind=info.kind,
    )
    rewritten = dataclasses.replace(manifest, parts={**manifest.parts, part: forged})
    (folder / MANIFEST_FILE).write_text(rewritten.to_json())


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_a_planted_pickle_is_never_unpickled(tmp_path: Path) -> None:
    storage = _two_checkpoints(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    folder = Path(storage.directory(2))
    # Beside the parts, under the names a careless loader would try.
    for name in ("model.pt", "model.pkl", "model.bin", "optimizer.pt"):
        (folder / name).write_bytes(payload)
    assert load_module(str(tmp_path / "ckpt"), _model) is not None  # stray files ignored
    torch.save({"w": _Payload(marker)}, folder / "torch.pt")

    # Under a part's name, with a manifest rewritten to match its size and sha256.
    _forge(storage, 2, "model", payload)
    with pytest.raises(CheckpointError, match="not a valid safetensors file") as info:
        load_module(str(tmp_path / "ckpt"), _model)
    assert "model" in _one_line(info.value)
    assert not marker.exists()


def test_a_tampered_safetensors_file_is_not_loaded(tmp_path: Path) -> None:
    storage = _two_checkpoints(tmp_path / "ckpt")
    manifest = storage.at(2)
    assert manifest is not None
    path = Path(storage.directory(2)) / manifest.parts["model"].file
    good = path.read_bytes()

    # Edited in place: its sha256 no longer matches, so step 1 is the newest intact one.
    edited = bytearray(good)
    edited[-1] ^= 0xFF
    path.write_bytes(bytes(edited))
    latest = storage.latest()
    assert latest is not None and latest.step == 1
    with pytest.raises(CheckpointError, match="sha256") as info:
        storage.read_tensors(manifest, "model")
    _one_line(info.value)
    path.write_bytes(good)

    # Vouched for by a rewritten manifest: safetensors still refuses the lies inside.
    (length,) = struct.unpack_from("<Q", good)
    header = json.loads(good[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 2**62]
    lying_header = json.dumps(header).encode()
    lies = [
        struct.pack("<Q", 2**62) + good[8:],  # a header longer than the file
        struct.pack("<Q", len(lying_header)) + lying_header + good[8 + length :],
        good[: len(good) // 2],  # torn
    ]
    for data in lies:
        _forge(storage, 2, "model", data)
        with pytest.raises(CheckpointError) as info:
            load_module(str(tmp_path / "ckpt"), _model)
        _one_line(info.value)


def _exit_code_and_stderr(
    entry: Callable[[], object], capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    """Runs a CLI entry point in this process (as its process would): exit code, stderr."""
    try:
        code = entry()
    except SystemExit as stop:
        code = stop.code
    return int(code or 0), capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("what", "spec"),
    [
        ("port out of range", {"worker": ["127.0.0.1:70000"]}),
        ("port of 5000 digits", {"worker": ["127.0.0.1:" + "9" * 5000]}),
        ("negative port", {"worker": ["127.0.0.1:-1"]}),
        ("shell in the host", {"worker": ["$(touch {marker}):2222"]}),
        ("shell in the port", {"worker": ["127.0.0.1:1;touch {marker}"]}),
        ("backticks", {"worker": ["`touch {marker}`:2222"]}),
        ("huge task count", {"worker": [f"10.0.{i // 250}.{i % 250}:1" for i in range(10_001)]}),
        ("huge task index", {"worker": {str(2**40): "127.0.0.1:2222"}}),
    ],
)
def test_hostile_cluster_specs_get_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    what: str,
    spec: dict[str, object],
) -> None:
    marker = tmp_path / "pwned"
    text = json.dumps(spec).replace("{marker}", str(marker))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(text)
    secret = tmp_path / "secret"
    Credentials.generate().to_file(secret)
    argv = ["server", "--cluster-spec", str(spec_file), "--job", "worker", "--task", "0"]
    code, lines = _exit_code_and_stderr(
        lambda: cli_main([*argv, "--secret-file", str(secret)]), capsys
    )
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (what, lines)

    # The same values through TF_CONFIG, as a ps task (python -m clusterflow.ps) reads them.
    index = int(next(iter(spec["worker"]))) if isinstance(spec["worker"], dict) else 0
    tf_config = {"cluster": json.loads(text), "task": {"type": "worker", "index": index}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    monkeypatch.setenv("CLUSTERFLOW_SECRET_FILE", str(secret))
    code, lines = _exit_code_and_stderr(ps_main, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (what, lines)
    assert not marker.exists()


@pytest.mark.parametrize(
    "settings",
    ["workers: 100000000", "ps: 20000\nworkers: 1", "workers: 5000\nreplicas_per_host: 4"],
)
def test_huge_task_counts_in_a_cluster_file_get_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    settings: str,
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path / "home"))
    config = tmp_path / "cluster.yaml"
    config.write_text(settings + "\n")
    argv = ["start", "-c", str(config), "--", sys.executable, "-c", "pass"]
    code, lines = _exit_code_and_stderr(lambda: cli_main(argv), capsys)
    assert code == 2 and len(lines) == 1 and "at most 10000" in lines[0], lines
    assert not (tmp_path / "home" / "clusters").exists() or not any(
        (tmp_path / "home" / "clusters").iterdir()
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "10.255.255.1", "*"])
def test_plain_auth_beyond_loopback_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=r"plain auth on .* is refused"):
        RpcServer(Credentials.generate("plain"), host=host, port=0)


def test_plain_auth_on_loopback_and_curve_anywhere_still_bind() -> None:
    for creds, host in (
        (Credentials.generate("plain"), "127.0.0.1"),
        (Credentials.generate(), "0.0.0.0"),
    ):
        server = RpcServer(creds, host=host, port=0)
        try:
            assert server.auth_mode == ("plain" if host == "127.0.0.1" else "curve")
        finally:
            server.stop()


def test_the_cli_refuses_plain_auth_beyond_loopback(cf: Clusterflow, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"worker": ["0.0.0.0:2222"]}))
    secret = tmp_path / "secret"
    Credentials.generate().to_file(secret)
    done = cf.run(
        "server", "--cluster-spec", str(spec), "--job", "worker", "--task", "0",
        "--secret-file", str(secret), "--auth", "plain",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-500:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "plain auth on '0.0.0.0' is refused" in lines[0], lines
