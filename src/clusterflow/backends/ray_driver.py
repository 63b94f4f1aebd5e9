"""Joining a Ray cluster as a driver: the CLI, the manager's host and the cache's commands.

Joining has a deadline. Ray's own ``ray.init`` waits on an address where no Ray answers
(a typo, or the ``ray_current_cluster`` file a stopped cluster leaves behind, which
``auto`` reads) for about ten minutes, repeating ``Failed to get cluster ID from GCS
server``; in the main thread it runs Python's signal handlers only between those waits
(the first one here after about 40 s), so Ctrl-C and SIGTERM seemed to do nothing. So
``join`` first connects to the address itself (refused, or silent for
``PROBE_TIMEOUT_S``: one line naming it, at once), then runs ``ray.init`` on a daemon
thread and waits for it at most ``CLUSTERFLOW_RAY_JOIN_TIMEOUT`` seconds, the main
thread free to take signals. A ``ray.init`` that outlived its deadline still runs on
its thread, so this process never calls it again (a second one beside it would share
its half-made state): every later join fails at once with the same line.

Ray's driver prints the cluster's error messages (a node marked dead, a worker killed) to
``sys.stdout`` from a background thread, whatever ``log_to_driver`` says (ray 2.60,
``ray._private.worker.listen_error_messages``). clusterflow's CLI writes data there:
``describe --json`` printed while a node died came out as JSON followed by Ray's line,
which no reader parses. Those messages go to this module's log instead (stderr), so a
command's stdout holds only what the command says.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from clusterflow.cluster.contract import ENV_RAY_JOIN_TIMEOUT
from clusterflow.errors import ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "clusterflow"
"""The Ray namespace of every actor clusterflow creates (managers, supervisors, caches)."""
ENV_JOIN_TIMEOUT = ENV_RAY_JOIN_TIMEOUT
"""Seconds ``ray.init`` may take once the address accepts connections."""
JOIN_TIMEOUT_S = 60.0
"""The default of ``CLUSTERFLOW_RAY_JOIN_TIMEOUT``: a joining driver uploads its
``--job-dir`` within it, so it is not a few seconds; a dead address fails long before,
at the probe."""
PROBE_TIMEOUT_S = 5.0
"""How long the address may take to accept a TCP connection (a lost host never does)."""
REPROBE_S = 30.0
"""How long an address that failed its probe fails again at once: ``ps`` over several
clusters of one lost host waits once, and a dashboard still sees Ray come back."""


class RayUnreachable(ConfigError):
    """No Ray cluster answers at the address; the message is one line naming it."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address
        """The address as the user gave it (``auto`` included)."""


_join_lock = threading.Lock()
_failed: dict[str, tuple[float, RayUnreachable]] = {}
"""Addresses that failed their probe: when, and the error (see ``REPROBE_S``)."""
_stuck: list[RayUnreachable] = []
"""The error of a ``ray.init`` that outlived its deadline in this process (see the module
doc): every later join raises it again."""


def join(address: str | None, *, runtime_env: dict[str, Any] | None = None) -> None:
    """Joins the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else ``auto``) once.

    Waits at most ``PROBE_TIMEOUT_S`` for the address to accept a connection, then at most
    ``CLUSTERFLOW_RAY_JOIN_TIMEOUT`` seconds for ``ray.init``; the calling thread takes
    signals meanwhile (Ctrl-C raises ``KeyboardInterrupt`` here). Thread-safe: callers
    in several threads (the dashboard's) join once.

    Raises:
        RayUnreachable: nothing answers at the address as a Ray cluster, within those
            deadlines (or an earlier join of this process did not end in its own).
        ConfigError: Ray is not installed, the address is malformed, or Ray refused it.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'clusterflow[ray]'") from None
    given = address or os.environ.get("RAY_ADDRESS") or "auto"
    with _join_lock:
        if ray.is_initialized():
            return
        if _stuck:
            raise _stuck[0]
        timeout_s = join_timeout()
        target, named = resolve(given)
        if target is not None:
            when, error = _failed.get(target, (-REPROBE_S, None))
            if error is not None and time.monotonic() - when < REPROBE_S:
                raise error
            try:
                probe(target, named, given)
            except RayUnreachable as exc:
                _failed[target] = (time.monotonic(), exc)
                raise
        _errors_to_log()  # before init: its listener thread may print at once
        settings = {
            "address": given,
            "namespace": NAMESPACE,
            "runtime_env": runtime_env or None,
            "logging_level": logging.WARNING,
            "log_to_driver": False,
        }
        try:
            _init_within(settings, timeout_s)
        except TimeoutError:
            _stuck.append(
                RayUnreachable(
                    f"cannot join the Ray cluster at {named}: it accepts connections but did "
                    f"not answer as Ray within {timeout_s:g}s (if it is only slow, raise "
                    f"{ENV_JOIN_TIMEOUT})",
                    given,
                )
            )
            raise _stuck[0] from None
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"cannot join the Ray cluster at {named}: {exc}") from exc
        except BaseException:  # interrupted: its ray.init may go on, on its thread
            if not ray.is_initialized():
                why = f"cannot join the Ray cluster at {named}: an earlier join was interrupted"
                _stuck.append(RayUnreachable(why, given))
            raise


def join_timeout() -> float:
    """``CLUSTERFLOW_RAY_JOIN_TIMEOUT`` in seconds, or ``JOIN_TIMEOUT_S``.

    Raises:
        ConfigError: it is not a positive number (named with its value).
    """
    raw = os.environ.get(ENV_JOIN_TIMEOUT, "").strip()
    if not raw:
        return JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{ENV_JOIN_TIMEOUT}={raw!r} is not a positive number of seconds")
    return value


def resolve(given: str) -> tuple[str | None, str]:
    """The ``host:port`` that ``ray.init(address=given)`` connects to, and how to name it
    in a message (``auto`` says which file it read). ``(None, given)`` where Ray decides
    without an address to probe (``local``, or a Ray without the helpers used here).

    Raises:
        ConfigError: ``auto`` finds no running Ray (Ray's own words), or the address is
            malformed.
    """
    if given == "local":
        return None, given
    if given.startswith("ray://"):  # Ray Client: its server's port is the one to probe
        return given.removeprefix("ray://"), given
    try:
        from ray._common.utils import get_ray_address_file
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # another Ray: ray.init alone decides, within its deadline
        return None, given
    try:
        target = canonicalize_bootstrap_address(given)
    except ConnectionError as exc:  # auto, and no Ray runs here (nor a file names one)
        raise RayUnreachable(f"cannot join the Ray cluster at {given}: {exc}", given) from exc
    except ValueError as exc:
        raise ConfigError(f"cannot join the Ray cluster at {given}: {exc}") from exc
    if target is None:
        return None, given
    named = given if target == given else f"{given} ({target})"
    if given == "auto":
        found = get_ray_address_file(None)
        if os.path.exists(found):
            named = f"{target} (auto: read from {found}, which a stopped Ray leaves behind)"
    return target, named


def probe(target: str, named: str, given: str) -> None:
    """Connects to ``target`` (``host:port``) and closes again, within ``PROBE_TIMEOUT_S``.

    Raises:
        RayUnreachable: refused, unknown host, or no answer in time (one line, ``named``).
    """
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"cannot join the Ray cluster at {named}: not HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S):
            return
    except ConnectionRefusedError:
        why = "nothing listens there (connection refused)"
    except TimeoutError:
        why = f"no answer within {PROBE_TIMEOUT_S:g}s"
    except socket.gaierror as exc:
        why = f"unknown host {host!r} ({exc.strerror})"
    except OSError as exc:
        why = exc.strerror or str(exc)
    raise RayUnreachable(f"cannot join the Ray cluster at {named}: {why}", given)


def _init_within(settings: dict[str, Any], timeout_s: float) -> None:
    """``ray.init(**settings)`` on a daemon thread, waited for at most ``timeout_s``.

    Raises:
        TimeoutError: it did not return in time (it goes on, on its thread).
        KeyboardInterrupt: a signal came while waiting (the CLI's handlers raise it).
        Exception: whatever ``ray.init`` raised.
    """
    import ray

    outcome: list[BaseException | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            ray.init(**settings)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome.append(exc)
        else:
            outcome.append(None)
        finally:
            done.set()

    logging.getLogger("ray._private.worker").addFilter(_not_on_main_thread)  # once: same filter
    threading.Thread(target=run, name="ray-join", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError
    if outcome[0] is not None:
        raise outcome[0]


def _not_on_main_thread(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that ``ray.init`` off the main thread sets no SIGTERM handler:
    on purpose here (the CLI sets its own handlers, which Ray's would replace)."""
    return not str(record.msg).startswith("SIGTERM handler is not set")


def _errors_to_log() -> None:
    """Sends what Ray's driver would print to stdout into the log (see the module doc)."""
    try:
        from ray._private import worker
    except ImportError:  # a Ray without that module prints nothing there to reroute
        return
    printer = getattr(worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "clusterflow_log", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        for line in data.get("lines") or ():
            log.warning("ray (%s): %s", data.get("pid", "?"), line)

    to_log.clusterflow_log = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_log
