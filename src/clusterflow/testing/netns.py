"""N emulated hosts on this machine: network namespaces on one bridge, links shaped by tc.

Each host is a Linux network namespace holding one veth end (``eth0``) with a private
address ``10.77.x.y/16``; the other end sits in the root namespace, enslaved to a bridge
of this harness (the switch). The bridge has no address in the root namespace, so nothing
a host sends can reach this machine's own addresses or leave it: the hosts see each
other and nothing else. Both directions of each host's link are shaped (see ``tc.py``),
like a full-duplex NIC on a non-blocking switch, so a parameter-server host receiving
from eight workers is limited by its own link, as on real machines.

Names carry the creating process's pid (``<prefix>-<pid>-<tag>-<i>`` for namespaces,
the bridge's alias for the bridge), so several harnesses (other tests, other checkouts)
never collide, and a harness whose process died (SIGKILL) is swept by the next one.
Cleanup always happens: ``close`` kills every process left in the namespaces (all of
them started here), deletes the namespaces (their veths go with them) and the bridge; it
runs from ``__exit__``, from ``atexit``, and is idempotent.

A host whose link needs delay, jitter or reordering (``LinkShape.needs_relay``, or
``relay=True``) gets two TAP devices instead of the veth pair, held by a relay process
inside its namespace (``relay.py``: this kernel has no ``sch_netem``); its ``eth0`` and
bridge-side end are shaped by the same tc tree, and ``reshape`` hands new delay settings
to the running relay. The relay dies with the namespace's other processes.

Needs root and iproute2 (``ip``, ``tc``); ``available()`` says whether both are present.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from clusterflow.errors import ClusterflowError, ConfigError
from clusterflow.testing import tc
from clusterflow.testing.tc import LinkShape

log = logging.getLogger(__name__)

SUBNET = "10.77.0.0/16"
"""The hosts' private range; nothing outside the harness's bridge ever sees it."""
MAX_HOSTS = 250 * 250
_COMMAND_TIMEOUT_S = 30.0
_RELAY_START_S = 30.0
_NAME = re.compile(r"^([a-z][a-z0-9]{0,11})-(\d+)-([0-9a-f]{6})-(\d+)$")
_ALIAS = re.compile(r"^clusterflow-testing-(\d+)$")


class HarnessError(ClusterflowError):
    """Setting up or shaping the emulated hosts failed (the ``ip``/``tc`` error inside)."""


def available() -> bool:
    """Root and iproute2: what the harness needs (tests skip their module without them)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    try:
        out = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"{' '.join(argv)}: no answer in {_COMMAND_TIMEOUT_S:.0f}s") from exc
    if check and out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        raise HarnessError(f"{' '.join(argv)}: {detail[-1] if detail else out.returncode}")
    return out.stdout


def _batch(tool: str, netns: str | None, lines: list[str]) -> None:
    """Runs ``lines`` through one ``ip -batch``/``tc -batch`` (one process, not one each)."""
    if not lines:
        return
    argv = [tool] + (["-n", netns] if netns else []) + ["-batch", "-"]
    _run(argv, stdin="\n".join(lines) + "\n")


_netem: list[bool] = []
"""The probe's answer, once made (a list, not a global rebound)."""


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem``; probed once, on a veth. Nothing here needs it
    any more (delays run through ``relay.py``); it tells whether figures could be
    cross-checked against netem on another kernel."""
    if not _netem:
        ns = f"cfprobe-{os.getpid()}-{secrets.token_hex(3)}-0"
        _run(["ip", "netns", "add", ns])
        try:
            _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            out = subprocess.run(
                ["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"],
                capture_output=True,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
            )
            _netem.append(out.returncode == 0)
        finally:
            _run(["ip", "netns", "del", ns], check=False)
    return _netem[0]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> int:
    """Deletes namespaces and bridges of harnesses whose process is gone; returns how many."""
    swept = 0
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(2))):
            _kill_netns_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            swept += 1
    for line in _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).splitlines():
        fields = line.split()
        dev = fields[1].rstrip(":").split("@")[0] if len(fields) > 1 else ""
        alias = re.search(r"alias (\S+)", line)
        m = _ALIAS.match(alias.group(1)) if alias else None
        if dev and m and not _pid_alive(int(m.group(1))):
            _run(["ip", "link", "del", dev], check=False)
            swept += 1
    return swept


def _kill_netns_processes(netns: str) -> None:
    pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
        if pids:
            time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass(frozen=True, slots=True)
class Host:
    """One emulated host: its namespace, its address, and how to run things in it."""

    index: int
    netns: str
    address: str
    """Its private IPv4 address on the bridge (``10.77.x.y``)."""
    veth: str
    """The bridge-side end of its link, in the root namespace."""

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` in this host and waits; keyword arguments go to ``subprocess.run``
        (``timeout`` defaults to 60 s: every call has a deadline)."""
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("text", True)
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.argv(argv), **kwargs)  # noqa: PLW1510 (caller's check)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` in this host; the harness kills it at ``close`` if still alive."""
        return subprocess.Popen(self.argv(argv), **kwargs)


class EmulatedHosts:
    """``n`` hosts on one bridge, each link shaped by ``shape`` (a context manager).

    Use as ``with EmulatedHosts(4, LinkShape.parse("10gbit")) as hosts: hosts[0].popen(...)``.
    ``cut``/``heal`` partition a host from everyone or from one peer; ``reshape`` changes
    one host's link while traffic flows.
    """

    def __init__(
        self,
        n: int,
        shape: LinkShape | None = None,
        *,
        prefix: str = "cf",
        relay: bool | None = None,
    ) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ConfigError(f"n={n}: the harness makes 1 to {MAX_HOSTS} hosts")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
            raise ConfigError(f"prefix {prefix!r}: 1-12 lowercase letters/digits, a letter first")
        if not available():
            raise HarnessError("emulated hosts need root and iproute2 (ip, tc)")
        self._shape0 = shape or LinkShape()
        self._tag = secrets.token_hex(3)
        self._prefix = prefix
        self._bridge = f"cfb{self._tag}"
        self._lock = threading.Lock()
        self._closed = False
        self._shapes: dict[int, LinkShape] = {}
        self._cut_all: set[int] = set()
        self._cut_pairs: set[tuple[int, int]] = set()
        self.hosts: list[Host] = []
        self._relayed = self._shape0.needs_relay if relay is None else relay
        """Every host's link runs through a relay (delays possible), or none does."""
        self._relays: dict[int, subprocess.Popen[bytes]] = {}
        sweep_stale()
        atexit.register(self.close)
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    # -- building ------------------------------------------------------------------

    def _build(self, n: int) -> None:
        pid = os.getpid()
        _batch(
            "ip",
            None,
            [
                f"link add {self._bridge} type bridge",
                f"link set dev {self._bridge} alias clusterflow-testing-{pid}",
                f"link set dev {self._bridge} up",
            ],
        )
        for i in range(n):
            host = Host(
                index=i,
                netns=f"{self._prefix}-{pid}-{self._tag}-{i}",
                address=f"10.77.{i // 250}.{i % 250 + 1}",
                veth=f"cv{self._tag}{i}",
            )
            _run(["ip", "netns", "add", host.netns])
            self.hosts.append(host)
            if self._relayed:
                self._start_relay(host)
                link = [f"link set dev {host.veth} netns {pid}"]
                _batch("ip", host.netns, link)
            else:
                link = [f"link add {host.veth} type veth peer name eth0 netns {host.netns}"]
                _batch("ip", None, link)
            _batch(
                "ip",
                None,
                [
                    f"link set dev {host.veth} master {self._bridge}",
                    # no IPv6 link-local address: no router solicitations on the switch
                    f"link set dev {host.veth} addrgenmode none",
                    f"link set dev {host.veth} up",
                ],
            )
            _batch(
                "ip",
                host.netns,
                [
                    "link set dev lo up",
                    "link set dev eth0 addrgenmode none",
                    f"addr add {host.address}/16 dev eth0",
                    "link set dev eth0 up",
                ],
            )
            self._apply(host, self._shape0)
        log.info("emulated %d hosts on bridge %s (%s)", n, self._bridge, self._shape0)

    def _start_relay(self, host: Host) -> None:
        """Starts the relay in ``host``: it makes TAPs ``eth0`` and ``host.veth`` there."""
        proc = subprocess.Popen(
            host.argv(
                [
                    sys.executable,
                    "-m",
                    "clusterflow.testing.relay",
                    "eth0",
                    host.veth,
                    str(host.index),
                ]
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._relays[host.index] = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], _RELAY_START_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise HarnessError(f"the relay of {host.netns} did not start (exit {proc.poll()})")

    def _apply(self, host: Host, shape: LinkShape) -> None:
        self._check_relay(shape)
        _batch("tc", host.netns, tc.root_lines("eth0", shape))
        _batch("tc", None, tc.root_lines(host.veth, shape))
        self._tell_relay(host, shape)
        self._shapes[host.index] = shape

    def _check_relay(self, shape: LinkShape) -> None:
        if shape.needs_relay and not self._relayed:
            raise ConfigError(
                f"delay {shape.delay_s * 1e3:g}ms/jitter {shape.jitter_s * 1e3:g}ms/"
                f"reorder {shape.reorder:g} needs the relay (this kernel has no sch_netem): "
                "make the hosts with a delayed shape or relay=True"
            )

    def _tell_relay(self, host: Host, shape: LinkShape) -> None:
        proc = self._relays.get(host.index)
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"{shape.delay_s!r} {shape.jitter_s!r} {shape.reorder!r}\n".encode())
            proc.stdin.flush()
        except BrokenPipeError as exc:
            raise HarnessError(f"the relay of {host.netns} is gone") from exc

    # -- access --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def shape_of(self, i: int) -> LinkShape:
        return self._shapes[i]

    def relay_pid(self, i: int) -> int | None:
        """The pid of host ``i``'s relay (None when its link is a plain veth)."""
        proc = self._relays.get(i)
        return proc.pid if proc is not None else None

    # -- shaping and partitions ----------------------------------------------------

    def reshape(self, i: int, shape: LinkShape) -> None:
        """Changes host ``i``'s link (both directions) in place; cuts stay as they are."""
        host = self.hosts[i]
        with self._lock:
            old = self._shapes[i]
            self._check_relay(shape)
            _batch("tc", host.netns, tc.change_lines("eth0", old, shape))
            _batch("tc", None, tc.change_lines(host.veth, old, shape))
            self._tell_relay(host, shape)
            self._shapes[i] = shape

    def cut(self, i: int, peer: int | None = None) -> None:
        """Partitions host ``i`` from everyone (``peer=None``) or from host ``peer`` only.

        Packets are lost silently in both directions, as when a cable or a switch port
        dies: the link stays up, so open TCP connections retransmit and time out rather
        than being reset. ``heal`` undoes it; cutting twice is a no-op.
        """
        host = self.hosts[i]
        with self._lock:
            if peer is None:
                if i in self._cut_all:
                    return
                _batch("tc", host.netns, tc.cut_all_lines("eth0"))
                _batch("tc", None, tc.cut_all_lines(host.veth))
                self._cut_all.add(i)
                return
            other = self.hosts[peer]
            pair = (min(i, peer), max(i, peer))
            if pair in self._cut_pairs or i == peer:
                return
            _batch("tc", host.netns, tc.cut_peer_lines("eth0", other.address, other.index))
            _batch("tc", other.netns, tc.cut_peer_lines("eth0", host.address, host.index))
            self._cut_pairs.add(pair)

    def heal(self, i: int, peer: int | None = None) -> None:
        """Undoes ``cut(i, peer)``; healing what is not cut is a no-op."""
        host = self.hosts[i]
        with self._lock:
            if peer is None:
                if i not in self._cut_all:
                    return
                _batch("tc", host.netns, tc.heal_all_lines("eth0"))
                _batch("tc", None, tc.heal_all_lines(host.veth))
                self._cut_all.discard(i)
                return
            other = self.hosts[peer]
            pair = (min(i, peer), max(i, peer))
            if pair not in self._cut_pairs:
                return
            _batch("tc", host.netns, tc.heal_peer_lines("eth0", other.index))
            _batch("tc", other.netns, tc.heal_peer_lines("eth0", host.index))
            self._cut_pairs.discard(pair)

    def link_stats(self, i: int) -> dict[str, int]:
        """Bytes and packets host ``i`` sent and dropped (its eth0 egress, from htb)."""
        out = _run(["tc", "-n", self.hosts[i].netns, "-s", "class", "show", "dev", "eth0"])
        stats: dict[str, int] = {}
        for block in out.split("class htb ")[1:]:
            cls = block.split()[0]
            m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", block)
            if m:
                key = "sent" if cls == tc.DEFAULT_CLASS else "lost"
                stats[f"{key}_bytes"] = int(m.group(1))
                stats[f"{key}_packets"] = int(m.group(2)) + (
                    int(m.group(3)) if key == "lost" else 0
                )
        return stats

    # -- teardown ------------------------------------------------------------------

    def close(self) -> None:
        """Kills what runs in the hosts, deletes namespaces, veths and bridge; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for host in self.hosts:
            _kill_netns_processes(host.netns)
        for proc in self._relays.values():  # killed above (they run in the namespaces)
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        # Deleting a namespace frees its veth later, from a kernel work queue; deleting the
        # veths first makes them gone when close returns.
        lines = [f"link del {host.veth}" for host in self.hosts]
        if lines:
            _run(["ip", "-force", "-batch", "-"], stdin="\n".join(lines) + "\n", check=False)
        for host in self.hosts:
            _run(["ip", "netns", "del", host.netns], check=False)
        _run(["ip", "link", "del", self._bridge], check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        log.info("emulated hosts on %s removed", self._bridge)

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
