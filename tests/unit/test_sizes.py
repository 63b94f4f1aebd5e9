"""One reader of sizes (``clusterflow._sizes``) for the manager's settings and the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterflow._sizes import parse_size
from clusterflow.cli.main import main
from clusterflow.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 << 20),
        ("1.5GiB", int(1.5 * (1 << 30))),
        ("4g", 4 << 30),
        ("2KB", 2048),
        ("1T", 1 << 40),
        ("100", 100),
        (" 0 ", 0),
    ],
)
def test_a_size_reads_as_binary_bytes(text: str, expected: int) -> None:
    assert parse_size(text, "--memory") == expected


@pytest.mark.parametrize("text", ["lots", "", "-1G", "nan", "NaNG", "inf", "4X", "G"])
def test_a_bad_size_is_one_line_naming_the_flag_and_the_value(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size(text, "--memory-per-node")
    message = str(caught.value)
    assert message.startswith("--memory-per-node: ")
    assert repr(text) in message and "\n" not in message


def test_cache_create_refuses_a_bad_size_in_one_line_before_it_reads_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CLUSTERFLOW_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "cache",
                "create",
                "c",
                "--from",
                str(tmp_path / "none.parquet"),
                "--partitions",
                "2",
                "--memory-per-node",
                "nan",
            ]
        )
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.splitlines() == [
        "error: --memory-per-node: 'nan' is not a size such as 4G, 512M or 1073741824"
    ]
    assert not list(tmp_path.rglob("cache.json"))
