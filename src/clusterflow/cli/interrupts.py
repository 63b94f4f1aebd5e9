"""How a clusterflow command ends on Ctrl-C, SIGTERM or SIGHUP: at once, whatever it waits on.

Ctrl-C raises ``KeyboardInterrupt`` where the main thread is; SIGTERM and SIGHUP raise
``Terminated`` (a ``KeyboardInterrupt``) the same way, so one ``except`` or ``finally``
serves all three, and a command ends with ``exit_code``: 130 for Ctrl-C, 128 + the
signal's number for the others, as a shell reports a command a signal ended. Every wait
of the CLI is one where Python runs signal handlers (a sleep, an ``Event.wait``, a
``ray.get`` with a deadline): ``ray.init``, the one call that was not, runs on a thread
of its own (``backends/ray_driver.py``).

Commands that stop something in order on a signal (a foreground ``start``, ``tune``,
``server``) set their own handlers over these.
"""

from __future__ import annotations

import signal
from types import FrameType

INTERRUPT_EXIT = 130
"""What a command ended by Ctrl-C exits with (128 + SIGINT)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP came (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []
"""The signals the handlers took, in order: Ray's ``ray.get`` turns any exception a
handler raised into a plain ``KeyboardInterrupt`` (``check_status``), so the exit code
is read from here too."""


def raise_for(signum: int) -> None:
    """Raises what ``signum`` raises in a command: ``KeyboardInterrupt`` or ``Terminated``."""
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise_for(signum)


def install() -> None:
    """From now on SIGTERM and SIGHUP raise ``Terminated`` in the main thread, and SIGINT
    ``KeyboardInterrupt`` as before (unless it is ignored: a command started in the
    background by a shell keeps ignoring it)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise)


def exit_code(exc: BaseException | None) -> int:
    """The exit code of a command ended by ``exc`` (or by what caused it)."""
    while exc is not None:
        if isinstance(exc, Terminated):
            return 128 + exc.signum
        if isinstance(exc, KeyboardInterrupt):
            break
        exc = exc.__cause__ or exc.__context__
    return 128 + _received[-1] if _received else INTERRUPT_EXIT
