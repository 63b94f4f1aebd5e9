"""The emulated-hosts harness (clusterflow.testing): addresses, shaping, loss, cuts, cleanup.

Real namespaces, veths, a bridge and tc on this machine (root needed). Traffic goes only
between the harness's own hosts. Rates are set low (tens of Mbit/s) so that the shaper,
not two busy cores, decides how fast bytes move: the rate checks test the harness, and
stay true on a loaded machine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from conftest import wait_until

from clusterflow.testing import EmulatedHosts, LinkShape, available, netem_available, sweep_stale
from clusterflow.testing.netns import _NAME

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

if not available():
    pytest.skip("needs root and iproute2 to make network namespaces", allow_module_level=True)

PORT = 5100

SINK = textwrap.dedent(
    """
    import socket, sys, time
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    srv.settimeout(30)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(30)
    n, t0 = 0, None
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        t0 = t0 or time.perf_counter()
        n += len(b)
    print(n, n * 8 / (time.perf_counter() - t0), flush=True)
    """
)

SOURCE = textwrap.dedent(
    """
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    buf = bytes(1 << 16)
    for _ in range(int(sys.argv[3]) // len(buf)):
        c.sendall(buf)
    c.close()
    """
)

CONNECT = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    except ConnectionRefusedError:
        print("reached")  # a RST came back: the packets went both ways
    except OSError as exc:
        print("unreachable", type(exc).__name__)
    else:
        print("reached")
    """
)


@pytest.fixture(scope="module")
def hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(3, LinkShape.parse("40mbit"), prefix="cftest") as made:
        yield made


def _measure_bit_s(hosts: EmulatedHosts, src: int, dst: int, nbytes: int) -> float:
    addr = hosts[dst].address
    sink = hosts[dst].popen(
        [sys.executable, "-c", SINK, addr, str(PORT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None
        assert sink.stdout.readline().strip() == "ready"
        out = hosts[src].run([sys.executable, "-c", SOURCE, addr, str(PORT), str(nbytes)])
        assert out.returncode == 0, out.stderr
        got, rate = sink.stdout.readline().split()
        assert int(got) == nbytes // (1 << 16) * (1 << 16)
        return float(rate)
    finally:
        sink.kill()
        sink.wait(10)


def _reaches(hosts: EmulatedHosts, src: int, dst: int) -> bool:
    out = hosts[src].run([sys.executable, "-c", CONNECT, hosts[dst].address, "9", "0.5"])
    assert out.returncode == 0, out.stderr
    return out.stdout.startswith("reached")


def test_each_host_has_its_own_private_address_and_sees_the_others(
    hosts: EmulatedHosts,
) -> None:
    addresses = [h.address for h in hosts.hosts]
    assert len(set(addresses)) == 3 and all(a.startswith("10.77.") for a in addresses)
    for h in hosts.hosts:
        shown = h.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
        assert f"inet {h.address}/16" in shown
    # the root namespace holds no address of the range: no route from the hosts to it
    assert (
        "10.77."
        not in subprocess.run(
            ["ip", "-o", "addr"], capture_output=True, text=True, check=False
        ).stdout
    )
    assert _reaches(hosts, 0, 1) and _reaches(hosts, 2, 0)


def test_link_rate_is_the_shaped_one_and_reshape_changes_it(hosts: EmulatedHosts) -> None:
    rate = _measure_bit_s(hosts, 0, 1, 3 << 20)  # ~0.6 s at 40 Mbit/s
    assert 0.6 * 40e6 < rate < 1.1 * 40e6, rate
    # the receiver's link shapes its download too: host 1 slowed to 10 Mbit/s
    hosts.reshape(1, LinkShape.parse("10mbit"))
    try:
        slow = _measure_bit_s(hosts, 0, 1, 1 << 20)
        assert 0.6 * 10e6 < slow < 1.1 * 10e6, slow
    finally:
        hosts.reshape(1, LinkShape.parse("40mbit"))


def test_random_loss_drops_about_the_set_fraction(hosts: EmulatedHosts) -> None:
    hosts.reshape(2, LinkShape.parse("40mbit", loss=0.3))
    try:
        before = hosts.link_stats(2)
        send = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for _ in range(2000): s.sendto(b'x' * 64, (sys.argv[1], 9))\n"
        )
        out = hosts[2].run([sys.executable, "-c", send, hosts[0].address])
        assert out.returncode == 0, out.stderr
        after = hosts.link_stats(2)
        lost = after["lost_packets"] - before["lost_packets"]
        sent = after["sent_packets"] - before["sent_packets"]
        assert lost + sent >= 2000
        assert 0.2 < lost / (lost + sent) < 0.4, (lost, sent)
    finally:
        hosts.reshape(2, LinkShape.parse("40mbit"))


def test_cut_and_heal_a_host_and_a_pair(hosts: EmulatedHosts) -> None:
    hosts.cut(1)
    try:
        assert not _reaches(hosts, 0, 1)
        assert not _reaches(hosts, 1, 2)
        assert _reaches(hosts, 0, 2)
    finally:
        hosts.heal(1)
    assert _reaches(hosts, 0, 1)
    hosts.cut(0, 2)
    try:
        assert not _reaches(hosts, 0, 2) and not _reaches(hosts, 2, 0)
        assert _reaches(hosts, 0, 1) and _reaches(hosts, 2, 1)
    finally:
        hosts.heal(0, 2)
    assert _reaches(hosts, 2, 0)


def test_bad_values_are_refused_with_the_value_named() -> None:
    with pytest.raises(ValueError, match=r"loss=1\.5"):
        LinkShape(loss=1.5)
    with pytest.raises(ValueError, match="'10gbps'"):
        LinkShape.parse("10gbps")
    with pytest.raises(ValueError, match="n=0"):
        EmulatedHosts(0)


def _netns_names() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def test_close_kills_processes_and_removes_everything() -> None:
    made = EmulatedHosts(2, LinkShape.parse("40mbit"), prefix="cftest")
    names = {h.netns for h in made.hosts}
    proc = made[0].popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert names <= _netns_names()
    made.close()
    assert proc.wait(10) == -signal.SIGKILL
    assert not names & _netns_names()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert made._bridge not in links and "cv" + made._tag not in links
    made.close()  # idempotent


def test_a_killed_harness_is_swept_by_the_next() -> None:
    script = (
        "import os, signal\n"
        "from clusterflow.testing import EmulatedHosts\n"
        "h = EmulatedHosts(1, prefix='cftest')\n"
        "print(h[0].netns, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == -signal.SIGKILL
    leftover = out.stdout.strip()
    assert _NAME.match(leftover) and leftover in _netns_names()
    assert sweep_stale() >= 2  # its namespace and its bridge
    wait_until(lambda: leftover not in _netns_names(), 10, "the sweep")


def test_a_delay_needs_netem_and_says_so_when_absent(hosts: EmulatedHosts) -> None:
    delayed = LinkShape.parse("40mbit", delay="50us")
    if netem_available():
        hosts.reshape(0, delayed)
        assert "netem" in hosts[0].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        hosts.reshape(0, LinkShape.parse("40mbit"))
    else:
        with pytest.raises(ValueError, match="sch_netem"):
            hosts.reshape(0, delayed)
        assert hosts.shape_of(0).delay_s == 0
    assert _reaches(hosts, 0, 1)
