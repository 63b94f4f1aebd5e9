"""Checkpoint storage: parts round-trip, commits across processes, torn ones never load."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from clusterflow.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointStorage,
    Manifest,
    PartInfo,
)
from clusterflow.errors import ClusterflowError

LOGGER = "clusterflow.checkpoint.storage"


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Every behaviour on a local folder and on an fsspec filesystem without fsync."""
    if request.param == "local":
        yield str(tmp_path / "ckpts")
        return
    import fsspec  # type: ignore[import-untyped]

    name = f"ckpt-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def commit_step(
    storage: CheckpointStorage, step: int, value: float = 0.0, cursor: object = None
) -> Manifest:
    writer = storage.writer(step)
    parts = [
        writer.write_tensors("model", {"w": torch.full((3, 4), value)}, {"step": step}),
        writer.write_json("data", {"cursor": cursor if cursor is not None else step}),
    ]
    return writer.commit(parts, {"kind": "test"})


def part_path(storage: CheckpointStorage, manifest: Manifest, name: str) -> str:
    return f"{manifest.directory}/{manifest.parts[name].file}"


def read_bytes(path: str) -> bytes:
    import fsspec

    with fsspec.open(path, "rb") as f:
        data: bytes = f.read()
    return data


def write_bytes(path: str, data: bytes) -> None:
    import fsspec

    with fsspec.open(path, "wb") as f:
        f.write(data)


def remove(path: str) -> None:
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(path)
    fs.rm_file(inner)


# Round trips ---------------------------------------------------------------------------


def test_tensor_part_round_trips_every_dtype_view_and_meta(url: str) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "f32": torch.randn(5, 3),
        "f64": torch.randn(2, dtype=torch.float64),
        "f16": torch.randn(7, dtype=torch.float16),
        "bf16": torch.randn(3, 3, dtype=torch.bfloat16),
        "i64": torch.tensor([-(2**40), 3]),
        "i32": torch.tensor([1, -2], dtype=torch.int32),
        "i16": torch.tensor([7], dtype=torch.int16),
        "i8": torch.tensor([-8], dtype=torch.int8),
        "u8": torch.tensor([255], dtype=torch.uint8),
        "u16": torch.tensor([65535], dtype=torch.uint16),
        "u32": torch.tensor([2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(2, dtype=torch.complex64),
        "f8e4m3": torch.randn(4).to(torch.float8_e4m3fn),
        "f8e5m2": torch.randn(4).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.5),
        "transposed": base.t(),  # non-contiguous view
        "strided": base[:, ::2],
        "tied_a": base,  # shares its storage with the views above
        "tied_b": base,
        "overlap": base.view(-1)[3:10],
        "empty": torch.empty(0, 3),
        "empty_view": base[2:2],
        "grad": torch.ones(2, requires_grad=True),
        "conj": torch.tensor([1 + 2j], dtype=torch.complex64).conj(),
        "model/layer.0/weight": torch.ones(1),  # state_dict keys may hold '/' and '.'
    }
    meta = {"version": 7, "optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "leases": ["a"]}
    storage = CheckpointStorage(url)
    writer = storage.writer(5)
    info = writer.write_tensors("ps-0", tensors, meta)
    assert info.kind == "tensors" and info.name == "ps-0" and info.file.endswith(".safetensors")
    manifest = writer.commit([info])

    got_meta, got = storage.read_tensors(manifest, "ps-0")
    assert got_meta == meta
    assert set(got) == set(tensors)
    for key, want in tensors.items():
        have = got[key]
        assert have.dtype == want.dtype and have.shape == want.shape, key
        if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), key
        elif want.dtype in (torch.uint16, torch.uint32, torch.uint64):
            assert have.tolist() == want.tolist(), key
        else:
            assert torch.equal(have, want.detach().resolve_conj()), key
    got["f32"].add_(1)  # loaded tensors own writable memory
    assert got["tied_a"].data_ptr() != got["tied_b"].data_ptr()


def test_tensor_parts_are_plain_safetensors_files(tmp_path: Path) -> None:
    from safetensors import safe_open

    storage = CheckpointStorage(tmp_path)
    writer = storage.writer(1)
    tensors = {"a": torch.randn(3, 2), "b": torch.arange(5), "h": torch.ones(2, dtype=torch.half)}
    info = writer.write_tensors("model", tensors, {"k": "v"})
    with safe_open(str(tmp_path / "ckpt-000000000001" / info.file), framework="pt") as f:
        assert json.loads(f.metadata()["clusterflow.meta"]) == {"k": "v"}
        for key, want in tensors.items():
            assert torch.equal(f.get_tensor(key), want)


def test_json_part_round_trips_and_needs_no_torch_to_read(url: str) -> None:
    storage = CheckpointStorage(url)
    writer = storage.writer(3)
    cursor = {"epoch": 2, "acked": [[0, 10], [20, 30]], "name": "train ü", "none": None}
    info = writer.write_json("data", cursor)
    assert info.kind == "json" and info.file.endswith(".json")
    manifest = writer.commit([info], {"num_ps": 0})
    assert storage.read_json(manifest, "data") == cursor
    with pytest.raises(CheckpointError, match="holds json, not tensors"):
        storage.read_tensors(manifest, "data")
    with pytest.raises(CheckpointError, match=r"has no part 'nope'.*\['data'\]"):
        storage.read_json(manifest, "nope")


def test_manifest_round_trips_and_rejects_edits() -> None:
    part = PartInfo("data", "data.abc.json", "0" * 64, 12, "json")
    manifest = Manifest(
        step=4, created=1.25, parts={"data": part}, meta={"a": [1, 2.5]}, directory="x"
    )
    text = manifest.to_json()
    assert Manifest.from_json(text, directory="x") == manifest
    edited = json.loads(text)
    edited["meta"]["a"] = [1, 2.6]
    with pytest.raises(CheckpointError, match="body_sha256"):
        Manifest.from_json(json.dumps(edited))
    del edited["meta"]
    with pytest.raises(CheckpointError, match="keys"):
        Manifest.from_json(json.dumps(edited))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Manifest.from_json(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="duplicate key"):
        Manifest.from_json('{"step": 1, "step": 2}')
    with pytest.raises(CheckpointError, match="sha256"):
        PartInfo("data", "data.abc.json", "xyz", 12, "json")
    with pytest.raises(CheckpointError, match="bad file name"):
        PartInfo("data", "../escape.json", "0" * 64, 12, "json")
    with pytest.raises(CheckpointError, match="bad file name"):
        PartInfo("data", "data.abc.json", "0" * 64, 12, "tensors")


# Commits across processes ----------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from clusterflow.checkpoint import CheckpointStorage
    url, step, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    writer = CheckpointStorage(url).writer(step)
    if kind == "json":
        writer.write_json("data", {"cursor": 41})
        assert "torch" not in sys.modules, "a JSON part must not need torch"
    else:
        import torch
        writer.write_tensors("worker-1", {"rng": torch.arange(6).reshape(2, 3).t()}, {"rank": 1})
    """
)


def test_commit_collects_parts_written_by_other_processes(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpts")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, "9", kind], stderr=subprocess.PIPE, text=True
        )
        for kind in ("json", "tensors")
    ]
    storage = CheckpointStorage(url)
    writer = storage.writer(9)
    own = writer.write_tensors("worker-0", {"rng": torch.zeros(2)}, {"rank": 0})
    for child in children:
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
    parts = [own, *writer.collect(["worker-1", "data"])]
    manifest = writer.commit(parts, {"replicas": 2})

    assert storage.latest() == manifest
    assert sorted(manifest.parts) == ["data", "worker-0", "worker-1"]
    assert storage.read_json(manifest, "data") == {"cursor": 41}
    meta, tensors = storage.read_tensors(manifest, "worker-1")
    assert meta == {"rank": 1}
    assert torch.equal(tensors["rng"], torch.arange(6).reshape(2, 3).t())


def test_collect_names_every_missing_part(url: str) -> None:
    writer = CheckpointStorage(url).writer(2)
    writer.write_json("data", 1)
    with pytest.raises(CheckpointError, match=r"lacks parts \['worker-1', 'worker-2'\]"):
        writer.collect(["data", "worker-1", "worker-2"])


def test_commit_refuses_a_part_whose_file_is_missing(url: str) -> None:
    storage = CheckpointStorage(url)
    writer = storage.writer(2)
    info = writer.write_json("data", 1)
    remove(f"{writer.directory}/{info.file}")
    with pytest.raises(CheckpointError, match=r"part 'data' .* is missing"):
        writer.commit([info])
    assert storage.committed() == []


# Finding the newest intact checkpoint ----------------------------------------------------


def test_latest_picks_the_newest_committed(url: str) -> None:
    storage = CheckpointStorage(url, keep=5)
    assert storage.latest() is None
    for step in (10, 20, 30):
        commit_step(storage, step, value=step)
    storage.writer(40).write_json("data", 0)  # written, never committed
    assert [m.step for m in storage.committed()] == [10, 20, 30]
    latest = storage.latest()
    assert latest is not None and latest.step == 30
    _, tensors = storage.read_tensors(latest, "model")
    assert torch.equal(tensors["w"], torch.full((3, 4), 30.0))
    assert storage.read_json(latest, "data") == {"cursor": 30}


def test_truncated_manifest_falls_back_with_a_warning(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    storage = CheckpointStorage(url)
    commit_step(storage, 1)
    newest = commit_step(storage, 2)
    path = f"{newest.directory}/{MANIFEST_FILE}"
    write_bytes(path, read_bytes(path)[:-40])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latest = storage.latest()
    assert latest is not None and latest.step == 1
    assert any(
        r.levelno == logging.WARNING and newest.directory in r.getMessage() for r in caplog.records
    )


def test_a_manifest_that_still_parses_but_was_cut_or_edited_is_skipped(url: str) -> None:
    storage = CheckpointStorage(url)
    commit_step(storage, 1)
    newest = commit_step(storage, 2)
    path = f"{newest.directory}/{MANIFEST_FILE}"
    body = json.loads(read_bytes(path))
    body["parts"].pop("data")  # a "complete" JSON that lost a part
    write_bytes(path, json.dumps(body).encode())
    assert [m.step for m in storage.committed()] == [1]


@pytest.mark.parametrize("offset", [0, 5, 30, -20, -1])  # length, header, data
def test_a_flipped_byte_in_a_tensor_part_is_never_loaded(
    url: str, offset: int, caplog: pytest.LogCaptureFixture
) -> None:
    storage = CheckpointStorage(url)
    commit_step(storage, 1, value=1.0)
    newest = commit_step(storage, 2, value=2.0)
    path = part_path(storage, newest, "model")
    data = bytearray(read_bytes(path))
    data[offset] ^= 0x01
    write_bytes(path, bytes(data))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latest = storage.latest()
    assert latest is not None and latest.step == 1
    assert any("sha256" in r.getMessage() for r in caplog.records)
    # Without verification the size still matches, but reading checks the bytes anyway.
    assert storage.latest(verify=False) == newest
    with pytest.raises(CheckpointError, match="fails its sha256 check"):
        storage.read_tensors(newest, "model")
    _, tensors = storage.read_tensors(latest, "model")
    assert torch.equal(tensors["w"], torch.full((3, 4), 1.0))


def test_a_missing_or_truncated_part_falls_back(url: str) -> None:
    storage = CheckpointStorage(url, keep=5)
    commit_step(storage, 1)
    second = commit_step(storage, 2)
    third = commit_step(storage, 3)
    remove(part_path(storage, third, "data"))
    path = part_path(storage, second, "model")
    write_bytes(path, read_bytes(path)[:-1])
    latest = storage.latest(verify=False)
    assert latest is not None and latest.step == 1
    with pytest.raises(CheckpointError, match=r"'data' .* is missing"):
        storage.read_json(third, "data")
    with pytest.raises(CheckpointError, match="manifest says"):
        storage.read_tensors(second, "model")


def test_a_manifest_from_another_storage_is_refused(tmp_path: Path) -> None:
    first = commit_step(CheckpointStorage(tmp_path / "a"), 1)
    with pytest.raises(CheckpointError, match=r"not .* of this storage"):
        CheckpointStorage(tmp_path / "b").read_json(first, "data")


# Retention ---------------------------------------------------------------------------------


def test_retention_keeps_the_last_two_and_spares_newer_uncommitted(url: str) -> None:
    storage = CheckpointStorage(url, keep=2)
    storage.writer(1).write_json("data", "abandoned")  # older, never committed
    commit_step(storage, 2)
    commit_step(storage, 3)
    storage.writer(5).write_json("data", "in progress")  # another process, ahead
    commit_step(storage, 4)
    assert [m.step for m in storage.committed()] == [3, 4]
    assert storage.steps() == [3, 4, 5]
    manifest = storage.writer(5).commit(storage.writer(5).collect(["data"]))
    assert storage.read_json(manifest, "data") == "in progress"
    assert storage.steps() == [4, 5]


def test_pruned_folders_leave_the_listing_at_once_and_trash_is_emptied(tmp_path: Path) -> None:
    storage = CheckpointStorage(tmp_path, keep=1)
    (tmp_path / ".trash-ckpt-000000000000.dead").mkdir(parents=True)  # a killed pruner's
    commit_step(storage, 1)
    commit_step(storage, 2)
    assert storage.steps() == [2]
    assert not any(p.name.startswith(".trash-ckpt-000000000000") for p in tmp_path.iterdir())


def test_rewriting_a_committed_step_replaces_it_whole(url: str) -> None:
    storage = CheckpointStorage(url, keep=3)
    old = commit_step(storage, 7, value=1.0, cursor="old")
    # Until the new manifest is committed the old checkpoint stays readable and intact.
    writer = storage.writer(7)
    new_parts = [writer.write_tensors("model", {"w": torch.full((3, 4), 2.0)})]
    assert storage.latest() == old
    assert storage.read_json(old, "data") == {"cursor": "old"}
    new_parts.append(writer.write_json("data", {"cursor": "new"}))
    new = writer.commit(new_parts)
    assert storage.latest() == new
    assert storage.read_json(new, "data") == {"cursor": "new"}
    commit_step(storage, 8)  # the next commit deletes the replaced files of step 7
    assert {p.file for p in old.parts.values()}.isdisjoint(
        os.path.basename(p) for p in _listing(new.directory)
    )


def test_committing_an_older_step_retires_newer_ones(url: str) -> None:
    storage = CheckpointStorage(url, keep=3)
    commit_step(storage, 1)
    commit_step(storage, 5)  # then the cluster restarted from step 1
    commit_step(storage, 3)
    latest = storage.latest(verify=False)
    assert latest is not None and latest.step == 3
    assert [m.step for m in storage.committed()] == [1, 3]


def _listing(directory: str) -> list[str]:
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(directory)
    return list(fs.ls(inner, detail=False))


# Bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_below_one_is_refused(tmp_path: Path, keep: object) -> None:
    with pytest.raises(CheckpointError, match=f"keep must be .*got {keep!r}") as info:
        CheckpointStorage(tmp_path, keep=keep)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ClusterflowError)


@pytest.mark.parametrize("name", ["", "a/b", "../x", "bad name", "new\nline", "é", "x" * 201])
def test_bad_part_names_are_refused_in_one_line(url: str, name: str) -> None:
    writer = CheckpointStorage(url).writer(1)
    for call in (
        lambda: writer.write_json(name, 1),
        lambda: writer.write_tensors(name, {"a": torch.ones(1)}),
        lambda: writer.collect([name]),
    ):
        with pytest.raises(CheckpointError, match="bad part name") as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"])
def test_bad_steps_are_refused(url: str, step: object) -> None:
    with pytest.raises(CheckpointError, match="non-negative integer") as info:
        CheckpointStorage(url).writer(step)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_bad_values_are_refused_naming_them(url: str) -> None:
    writer = CheckpointStorage(url).writer(1)
    with pytest.raises(CheckpointError, match="'t' is a list"):
        writer.write_tensors("m", {"t": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match=r"unsupported dtype torch\.complex128"):
        writer.write_tensors("m", {"c": torch.ones(1, dtype=torch.complex128)})
    with pytest.raises(CheckpointError, match="meta is not JSON-serializable"):
        writer.write_tensors("m", {"a": torch.ones(1)}, {"x": object()})
    with pytest.raises(CheckpointError, match="'j' is not JSON-serializable"):
        writer.write_json("j", {1, 2})
    with pytest.raises(CheckpointError, match="commit meta"):
        writer.commit([], {"x": object()})
    info = writer.write_json("j", 1)
    with pytest.raises(CheckpointError, match="two different parts"):
        writer.commit([info, writer.write_json("j", 2)])


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys, clusterflow.checkpoint as c; "
        "c.CheckpointStorage('memory://x').committed(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
