"""The emulated-hosts harness (clusterflow.testing): addresses, shaping, loss, cuts, cleanup.

Real namespaces, veths, a bridge and tc on this machine (root needed). Traffic goes only
between the harness's own hosts. Rates are set low (tens of Mbit/s) so that the shaper,
not two busy cores, decides how fast bytes move. What is measured is checked only on the
side a busy machine cannot push it to: a shaped link is never faster than its rate, a
delayed one never answers sooner than its delay. How close to the set figures the
harness comes is measured, not tested (``clusterflow/testing/relay.py``'s docstring).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from clusterflow.testing import EmulatedHosts, LinkShape, available, sweep_stale
from clusterflow.testing.netns import _NAME
from conftest import wait_until

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
    # Never above the shaped rate (10% for htb's burst): without the shaper the
    # bridge's veths move these bytes at Gbit/s. How slow a busy machine makes it is
    # not the harness's behaviour, so there is no lower bound.
    rate = _measure_bit_s(hosts, 0, 1, 3 << 20)  # ~0.6 s at 40 Mbit/s
    assert rate < 1.1 * 40e6, rate
    # the receiver's link shapes its download too: host 1 slowed to 10 Mbit/s, which
    # the 40 Mbit/s it had would exceed four times
    hosts.reshape(1, LinkShape.parse("10mbit"))
    try:
        slow = _measure_bit_s(hosts, 0, 1, 1 << 20)
        assert slow < 1.1 * 10e6, slow
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


def test_a_delay_on_hosts_without_a_relay_is_refused(hosts: EmulatedHosts) -> None:
    with pytest.raises(ValueError, match="needs the relay"):
        hosts.reshape(0, LinkShape.parse("40mbit", "50us"))
    assert hosts.shape_of(0).delay_s == 0
    assert _reaches(hosts, 0, 1)


# -- delay, jitter and reordering through the userspace relay (no sch_netem here) ----------

ECHO = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.settimeout(30)
    print("ready", flush=True)
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)
    """
)

PROBE = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1)
    rtts, tries = [], 0
    while len(rtts) < int(sys.argv[3]) and tries < 30:
        tries += 1  # UDP: a datagram lost (the first, while ARP settles) is sent again
        t0 = time.perf_counter()
        s.sendto(str(tries).encode(), (sys.argv[1], int(sys.argv[2])))
        try:
            while s.recv(2048) != str(tries).encode():
                pass
        except TimeoutError:
            continue
        rtts.append(time.perf_counter() - t0)
    print(min(rtts), max(rtts))
    """
)

SEQ_SINK = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    s.bind((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    s.settimeout(30)
    got, late, top = 0, 0, -1
    while True:
        try:
            data = s.recv(2048)
        except TimeoutError:
            break
        if data == b"end":
            s.settimeout(1.0)  # frames held back behind the end marker still come
            continue
        seq = int(data[:8])
        got += 1
        if seq < top:
            late += 1
        top = max(top, seq)
        if got == int(sys.argv[3]):
            break
    """
)

SEQ_SOURCE = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(int(sys.argv[3])):
        s.sendto(b"%08d" % i + bytes(56), (sys.argv[1], int(sys.argv[2])))
    """
)


@pytest.fixture(scope="module")
def relayed() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(2, LinkShape.parse("40mbit"), prefix="cftest", relay=True) as made:
        yield made


def _rtt_s(hosts: EmulatedHosts, probes: int = 10) -> tuple[float, float]:
    echo = hosts[1].popen(
        [sys.executable, "-c", ECHO, hosts[1].address, str(PORT)], stdout=subprocess.PIPE
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == b"ready"
        out = hosts[0].run([sys.executable, "-c", PROBE, hosts[1].address, str(PORT), str(probes)])
        assert out.returncode == 0, out.stderr
        low, high = (float(x) for x in out.stdout.split())
        return low, high
    finally:
        echo.kill()
        echo.wait(10)


def test_a_relayed_link_adds_the_set_delay_and_reshape_changes_it(
    relayed: EmulatedHosts,
) -> None:
    # Each round trip is at least the delays set (no frame leaves before it is due);
    # how little the relay adds on top is a measured figure (relay.py), not a bound.
    # host 0 sends with 50 ms of delay, host 1 with none: the round trip gains 50 ms
    relayed.reshape(0, LinkShape.parse("40mbit", "50ms"))
    try:
        low, _ = _rtt_s(relayed)
        assert low >= 0.050, low
        relayed.reshape(1, LinkShape.parse("40mbit", "25ms"))
        both, _ = _rtt_s(relayed, 3)
        assert both >= 0.075, both  # the reshape reached host 1's relay
    finally:
        relayed.reshape(0, LinkShape.parse("40mbit"))
        relayed.reshape(1, LinkShape.parse("40mbit"))
    assert relayed.shape_of(0).delay_s == relayed.shape_of(1).delay_s == 0


def _late_frames(hosts: EmulatedHosts, n: int) -> tuple[int, int]:
    """Sends ``n`` numbered datagrams 0 -> 1; returns (received, arrived after a later one)."""
    sink = hosts[1].popen(
        [sys.executable, "-c", SEQ_SINK + "print(got, late)", hosts[1].address, str(PORT), str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        out = hosts[0].run([sys.executable, "-c", SEQ_SOURCE, hosts[1].address, str(PORT), str(n)])
        assert out.returncode == 0, out.stderr
        hosts[0].run(
            [
                sys.executable,
                "-c",
                SEQ_SOURCE.replace('b"%08d" % i + bytes(56)', 'b"end"'),
                hosts[1].address,
                str(PORT),
                "20",  # the marker may be lost too: sent 20 times
            ]
        )
        got, late = (int(x) for x in sink.stdout.readline().split())
        return got, late
    finally:
        sink.kill()
        sink.wait(10)


def test_reordering_happens_at_the_set_rate_and_not_without_it(relayed: EmulatedHosts) -> None:
    n = 2000
    relayed.reshape(0, LinkShape.parse("40mbit", "2ms"))
    try:
        got, late = _late_frames(relayed, n)
        assert got > 0.9 * n and late == 0, (got, late)  # a delay alone keeps the order
        relayed.reshape(0, LinkShape.parse("40mbit", "2ms", reorder=0.05))
        got, late = _late_frames(relayed, n)
        # ~100 expected (binomial sd ~10); held frames at the very end may pass nothing
        assert got > 0.9 * n and 50 <= late <= 150, (got, late)
    finally:
        relayed.reshape(0, LinkShape.parse("40mbit"))


def test_loss_works_through_the_relay(relayed: EmulatedHosts) -> None:
    relayed.reshape(0, LinkShape.parse("40mbit", "1ms", 0.3))
    try:
        got, _ = _late_frames(relayed, 1000)
        assert 0.55 * 1000 < got < 0.85 * 1000, got
    finally:
        relayed.reshape(0, LinkShape.parse("40mbit"))


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_relays_and_taps_go_at_close_and_when_the_harness_is_killed() -> None:
    made = EmulatedHosts(1, LinkShape.parse("40mbit", "1ms"), prefix="cftest")
    pid = made.relay_pid(0)
    assert pid is not None and not _pid_gone(pid)
    made.close()
    assert _pid_gone(pid)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert "cv" + made._tag not in links
    script = (
        "import os, signal\n"
        "from clusterflow.testing import EmulatedHosts, LinkShape\n"
        "h = EmulatedHosts(1, LinkShape.parse('40mbit', '1ms'), prefix='cftest')\n"
        "print(h[0].netns, h.relay_pid(0), h[0].veth, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    netns, relay, tap = out.stdout.split()
    # the relay dies with its parent (PR_SET_PDEATHSIG), and its TAPs with it
    wait_until(lambda: _pid_gone(int(relay)), 10, "the orphaned relay's death")
    assert sweep_stale() >= 2
    wait_until(lambda: netns not in _netns_names(), 10, "the sweep")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert tap not in links
