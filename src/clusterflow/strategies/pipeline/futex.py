"""Linux futexes on a word of shared memory, for ``shm_link``'s wake-ups.

Why not a socket: waking a stage through a one-byte packet cost about 17 us of the
sender's CPU per message on the 2-core machine, paid whether or not the peer slept;
``FUTEX_WAKE`` on a word nobody waits on is a hash lookup in the kernel (a few us with
the ``ctypes`` call). The waiter gives the value it saw, and the kernel sleeps only if
the word still holds it, so a bump between the waiter's check and its sleep is never
lost: the rule every futex-based lock and condition relies on.

Shared (not ``FUTEX_PRIVATE_FLAG``) futexes: the two ends are different processes
mapping the same pages. x86-64 only, as the link (``shm_link.usable``).
"""

from __future__ import annotations

import ctypes
import errno

__all__ = ["wait", "wake"]

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleeps while the 32-bit word at ``address`` holds ``seen``, at most ``timeout_s``
    (returns early on a wake-up, a signal, or a word that already changed)."""
    timeout = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    if (
        _syscall(
            _SYS_FUTEX,
            ctypes.c_void_p(address),
            _FUTEX_WAIT,
            ctypes.c_uint32(seen & 0xFFFFFFFF),
            ctypes.byref(timeout),
            None,
            0,
        )
        == -1
    ):
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait: {errno.errorcode.get(code, code)}")


def wake(address: int) -> None:
    """Wakes every waiter on the word at ``address``."""
    if _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 2**31 - 1, None, None, 0) == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"futex wake: {errno.errorcode.get(code, code)}")
