"""The exit code of a command a signal ended (``cli/interrupts.py``), real signals to this
process with the CLI's handlers installed (restored after each test)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import click
import pytest

from clusterflow.cli import interrupts
from clusterflow.cli.interrupts import Terminated

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(interrupts, "_received", [])
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    interrupts.install()
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_signal_raises_where_the_main_thread_waits_and_names_its_exit_code(
    signum: int, code: int
) -> None:
    with pytest.raises(KeyboardInterrupt) as caught:
        os.kill(os.getpid(), signum)
        signal.sigtimedwait([], 0)  # a point where Python runs the handler, at the latest
    assert isinstance(caught.value, Terminated) == (signum != signal.SIGINT)
    assert interrupts.exit_code(caught.value) == code


def test_a_sigterm_rewrapped_as_a_plain_keyboard_interrupt_still_exits_143() -> None:
    """Ray's ray.get raises KeyboardInterrupt() for whatever the handler raised."""
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
    assert interrupts.exit_code(KeyboardInterrupt()) == 143


def test_clicks_abort_carries_the_signal_as_its_cause() -> None:
    """click wraps a KeyboardInterrupt in Abort (``raise Abort() from e``)."""
    try:
        try:
            interrupts.raise_for(signal.SIGTERM)
        except KeyboardInterrupt as exc:
            raise click.exceptions.Abort() from exc
    except click.exceptions.Abort as abort:
        assert interrupts.exit_code(abort.__cause__) == 143


def test_an_ignored_sigint_stays_ignored() -> None:
    """A command a shell started in the background ignores Ctrl-C, as before."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupts.install()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
