"""Routes every task's output: prefixed to the terminal and ``output.log``, raw to its file.

One reader thread per task turns the task's pipe into lines, so a task that prints a
partial line never interleaves with another's inside one line.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from clusterflow.backends.api import REPLICA_TAG

log = logging.getLogger(__name__)


class OutputRouter:
    """Collects task output; ``echo`` also writes it to the terminal (foreground runs)."""

    def __init__(self, combined: Path, *, echo: bool) -> None:
        self._combined = combined.open("ab", buffering=0)
        self._echo = echo
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def follow(self, task: str, stream: IO[bytes], log_file: Path) -> Label:
        """Starts reading ``stream`` (the task's merged stdout and stderr) until EOF.

        Returns its label: a standby supervisor's output is renamed to the task it
        takes over (``Label.rename``) before its job prints anything.
        """
        label = Label(task, log_file)
        thread = threading.Thread(
            target=self._pump, args=(label, stream), name=f"output-{task}", daemon=True
        )
        thread.start()
        self._threads.append(thread)
        return label

    def line(self, text: str) -> None:
        """A line of the manager's own (a summary, an event) into the combined stream."""
        self._write(text.encode() + b"\n")

    def join(self, timeout: float = 5.0) -> None:
        """Waits for every pipe to reach EOF (all task processes gone)."""
        for thread in self._threads:
            thread.join(timeout)

    def close(self) -> None:
        with self._lock:
            self._combined.close()

    def _write(self, data: bytes) -> None:
        with self._lock:
            if not self._combined.closed:
                self._combined.write(data)
            if self._echo:
                _terminal_write(data)

    def _pump(self, label: Label, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                replica, line = _untag(line)
                if replica is None:
                    task = label.write(line)
                    self._write(f"[{task}] ".encode() + line)
                else:
                    task = label.write(b"[" + replica + b"] " + line)
                    self._write(f"[{task}/".encode() + replica + b"] " + line)
        except (OSError, ValueError) as exc:
            log.warning("output of %s lost: %s", label.task, exc)
        finally:
            label.close()
            stream.close()


class Label:
    """Which task a stream of output belongs to, and its log file; renamable."""

    def __init__(self, task: str, log_file: Path) -> None:
        self._lock = threading.Lock()
        self.task = task
        self._file: IO[bytes] = log_file.open("ab", buffering=0)

    def rename(self, task: str, log_file: Path) -> None:
        with self._lock:
            old, self._file = self._file, log_file.open("ab", buffering=0)
            self.task = task
        old.close()

    def write(self, data: bytes) -> str:
        """Appends ``data`` to the current task's log; returns the task's name."""
        with self._lock:
            self._file.write(data)
            return self.task

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _untag(line: bytes) -> tuple[bytes | None, bytes]:
    """Splits a replica's tag (``REPLICA_TAG`` index ``REPLICA_TAG``) off a line."""
    if not line.startswith(REPLICA_TAG):
        return None, line
    end = line.find(REPLICA_TAG, 1)
    replica = line[1:end] if end > 1 else b""
    if not replica.isdigit():
        return None, line
    return replica, line[end + 1 :]


def _terminal_write(data: bytes, write: Callable[[bytes], object] | None = None) -> None:
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except (OSError, ValueError):
        pass  # the terminal went away (a closed pipe): the files still get everything
