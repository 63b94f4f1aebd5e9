"""Joining Ray has deadlines (``ray_driver.join``): an address where no Ray answers is one
line naming it, never a wait of Ray's own (about ten minutes, deaf to Ctrl-C).

No Ray cluster here: refused and silent addresses are sockets on 127.0.0.2 (loopback,
and not one Ray rewrites to the machine's address as it does 127.0.0.1). Where
``ray.init`` itself must hang, a stand-in blocks until the test ends: a real one stuck
on its thread would stay in this process; tests/integration/test_hangs.py runs the real
one in a CLI process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterflow.backends import ray_driver
from clusterflow.backends.ray_driver import RayUnreachable
from clusterflow.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
ray = pytest.importorskip("ray", reason="joining Ray needs Ray")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process that never joined (the module keeps what failed)."""
    monkeypatch.setattr(ray_driver, "_stuck", [])
    monkeypatch.setattr(ray_driver, "_failed", {})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_driver.ENV_JOIN_TIMEOUT, raising=False)
    assert not ray.is_initialized()


@pytest.fixture
def refused() -> Iterator[str]:
    """An address whose port is held (bound, not listening): connecting is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    yield f"127.0.0.2:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def silent() -> Iterator[str]:
    """An address that accepts connections and never says a word (not a Ray)."""
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    sock.listen(16)
    yield f"127.0.0.2:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def hung_init(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """``ray.init`` as it behaves at an address that answers but is no Ray: it never
    returns (until the test ends). Yields the settings of every call."""
    calls: list[dict[str, Any]] = []
    release = threading.Event()

    def init(**settings: Any) -> None:
        calls.append(settings)
        release.wait()
        raise ConnectionError("released at the end of the test")

    monkeypatch.setattr(ray, "init", init)
    yield calls
    release.set()


def test_a_refused_address_is_one_line_naming_it(refused: str, hung_init: list[Any]) -> None:
    with pytest.raises(RayUnreachable) as caught:
        ray_driver.join(refused)
    assert str(caught.value) == (
        f"cannot join the Ray cluster at {refused}: nothing listens there (connection refused)"
    )
    assert caught.value.address == refused
    assert hung_init == []  # ray.init was never asked


def test_a_refused_address_fails_again_at_once_without_probing(
    refused: str, hung_init: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ps` over several clusters of one lost host waits for it once."""
    with pytest.raises(RayUnreachable) as first:
        ray_driver.join(refused)

    def no_probe(*args: Any) -> None:
        raise AssertionError("probed again")

    monkeypatch.setattr(ray_driver, "probe", no_probe)
    with pytest.raises(RayUnreachable) as second:
        ray_driver.join(refused)
    assert second.value is first.value


def test_auto_names_the_address_and_the_stale_file_it_read(
    refused: str, hung_init: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's `ray_current_cluster`, left behind by a stopped cluster, is what `auto` reads
    where no Ray runs on this machine (Ray looks for a running GCS first: another test's
    or checkout's Ray on the machine must not decide this one)."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr("ray._private.services.find_gcs_addresses", lambda: [])
    (tmp_path / "ray").mkdir()
    stale = tmp_path / "ray" / "ray_current_cluster"
    stale.write_text(refused + "\n")
    with pytest.raises(RayUnreachable) as caught:
        ray_driver.join("auto")
    assert str(caught.value) == (
        f"cannot join the Ray cluster at {refused} (auto: read from {stale}, which a "
        "stopped Ray leaves behind): nothing listens there (connection refused)"
    )
    assert hung_init == []


def test_auto_with_no_ray_at_all_is_unreachable_in_rays_words(
    tmp_path: Path, hung_init: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr("ray._private.services.find_gcs_addresses", lambda: [])
    with pytest.raises(RayUnreachable, match=r"^cannot join the Ray cluster at auto: Could not"):
        ray_driver.join(None)


def test_an_address_that_answers_but_not_as_ray_ends_at_the_deadline(
    silent: str, hung_init: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_driver.ENV_JOIN_TIMEOUT, "0.5")
    with pytest.raises(RayUnreachable) as caught:
        ray_driver.join(silent)
    assert str(caught.value) == (
        f"cannot join the Ray cluster at {silent}: it accepts connections but did not answer "
        f"as Ray within 0.5s (if it is only slow, raise {ray_driver.ENV_JOIN_TIMEOUT})"
    )
    assert [c["address"] for c in hung_init] == [silent]
    assert hung_init[0]["namespace"] == ray_driver.NAMESPACE


def test_a_join_that_outlived_its_deadline_is_never_tried_again_beside_it(
    silent: str, hung_init: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ray.init still runs on its thread: a second one would share its state."""
    monkeypatch.setenv(ray_driver.ENV_JOIN_TIMEOUT, "0.5")
    with pytest.raises(RayUnreachable) as first:
        ray_driver.join(silent)
    with pytest.raises(RayUnreachable) as second:
        ray_driver.join(silent)
    assert second.value is first.value
    assert len(hung_init) == 1


def test_what_ray_init_raises_is_one_line_naming_the_address(
    silent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def init(**settings: Any) -> None:
        raise RuntimeError("Version mismatch: the cluster runs Ray 2.9")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConfigError) as caught:
        ray_driver.join(silent)
    assert not isinstance(caught.value, RayUnreachable)
    assert str(caught.value) == (
        f"cannot join the Ray cluster at {silent}: Version mismatch: the cluster runs Ray 2.9"
    )


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_join_timeout_is_one_line_naming_it(
    value: str, silent: str, hung_init: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_driver.ENV_JOIN_TIMEOUT, value)
    with pytest.raises(ConfigError) as caught:
        ray_driver.join(silent)
    assert str(caught.value) == (
        f"{ray_driver.ENV_JOIN_TIMEOUT}={value!r} is not a positive number of seconds"
    )
    assert hung_init == []
