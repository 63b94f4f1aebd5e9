"""The ``tc`` programs that shape one emulated host's link: pure command builders.

Each direction of a host's link (its own ``eth0`` egress inside the namespace, and the
bridge-side veth egress toward it) carries the same tree::

    htb 1:  (default 1:10)
      class 1:10  rate R ceil R           <- all traffic
      class 1:20  rate 8bit, pfifo limit 0 <- a black hole: whatever is sent here is lost
    filters on 1:  prio 10  cBPF "random < loss" -> 1:20     (random loss)
                   prio 100+ u32 "dst == peer"   -> 1:20     (a cut to one peer)
                   prio 99   u32 "everything"    -> 1:20     (the host cut off)

Why htb and a classic-BPF filter, not ``netem``: netem (rate, delay, loss in one qdisc)
is a module many kernels leave out (this project's kernel among them, and ``sch_fq``
too), while htb, u32, cls_bpf and pfifo are built in nearly everywhere. The loss filter
is four classic BPF instructions (``ld rand; jge``), which ``tc`` loads from its
``bytecode`` text without a compiler. Delay, jitter and reordering are not tc's job
here: a link that needs them runs through a userspace relay (``relay.py``) between two
TAP devices, and this tree shapes those TAPs as it shapes a veth.

Everything here returns argv lists or ``tc -batch`` lines; ``netns.py`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.errors import ConfigError

DEFAULT_CLASS = "1:10"
DROP_CLASS = "1:20"
LOSS_PRIO = 10
CUT_ALL_PRIO = 99
CUT_PEER_PRIO = 100
"""Cuts to single peers use priorities from here up, one per peer (its host index)."""

# Classic BPF: BPF_LD|BPF_W|BPF_ABS with k = SKF_AD_OFF + SKF_AD_RANDOM loads a random u32.
_LD_RANDOM = "32 0 0 4294963256"
_RET_CLASSID = "6 0 0 4294967295"  # -1: the filter's own classid (the black hole)
_RET_NO_MATCH = "6 0 0 0"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """How one host's link behaves, the same in both directions (a full-duplex NIC)."""

    rate_bit: int = 10_000_000_000
    """Line rate in bits per second, each direction (10 Gbit/s by default)."""
    delay_s: float = 0.0
    """Delay of every frame the host sends (its egress, like netem on its ``eth0``), so
    host-to-host one-way delay is the sender's; done by the relay (``relay.py``)."""
    jitter_s: float = 0.0
    """Each sent frame's delay varies uniformly by up to this much (frames may reorder)."""
    reorder: float = 0.0
    """Fraction of sent frames held back one more delay (>= 1 ms), so later ones pass."""
    loss: float = 0.0
    """Fraction of packets dropped on each direction, at random (0 <= loss < 1)."""

    def __post_init__(self) -> None:
        if self.rate_bit < 8_000:
            raise ConfigError(f"rate_bit={self.rate_bit}: a link needs at least 8 kbit/s")
        if not 0.0 <= self.delay_s < 10.0:
            raise ConfigError(f"delay_s={self.delay_s}: must be in [0, 10) seconds")
        if not 0.0 <= self.jitter_s < 10.0:
            raise ConfigError(f"jitter_s={self.jitter_s}: must be in [0, 10) seconds")
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"loss={self.loss}: must be in [0, 1)")
        if not 0.0 <= self.reorder < 1.0:
            raise ConfigError(f"reorder={self.reorder}: must be in [0, 1)")

    @property
    def needs_relay(self) -> bool:
        """Whether this shape needs the userspace relay (delay, jitter or reordering)."""
        return self.delay_s > 0 or self.jitter_s > 0 or self.reorder > 0

    @classmethod
    def parse(
        cls,
        rate: str = "10gbit",
        delay: str = "0us",
        loss: float = 0.0,
        *,
        jitter: str = "0us",
        reorder: float = 0.0,
    ) -> LinkShape:
        """From ``tc``-style text: ``rate="25gbit"``, ``delay="50ms"``, ``jitter="1ms"``."""
        return cls(
            rate_bit=parse_rate(rate),
            delay_s=parse_time(delay),
            jitter_s=parse_time(jitter),
            loss=loss,
            reorder=reorder,
        )


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> int:
    """``"10gbit"`` -> 10_000_000_000; a clear error otherwise."""
    low = text.strip().lower()
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if low.endswith(unit):
            try:
                return int(float(low[: -len(unit)]) * _RATE_UNITS[unit])
            except ValueError:
                break
    raise ConfigError(f"rate {text!r}: expected a number and bit|kbit|mbit|gbit")


def parse_time(text: str) -> float:
    """``"50us"`` -> 5e-05 seconds; a clear error otherwise."""
    low = text.strip().lower()
    for unit in ("us", "ms", "s"):
        if low.endswith(unit):
            try:
                return float(low[: -len(unit)]) * _TIME_UNITS[unit]
            except ValueError:
                break
    raise ConfigError(f"delay {text!r}: expected a number and s|ms|us")


def burst_bytes(rate_bit: int) -> int:
    """htb's bucket: 1 ms of line rate, at least 64 KiB (one GSO super-packet of veth).

    A smaller bucket caps the rate below the set one (the kernel refills it once per
    timer tick and veth hands over 64 KiB segments); a much larger one lets bursts pass
    at memory speed, which a real NIC never does.
    """
    return max(64 * 1024, rate_bit // 8 // 1000)


def root_lines(dev: str, shape: LinkShape) -> list[str]:
    """``tc -batch`` lines that build the tree of the module docstring on ``dev``."""
    burst = burst_bytes(shape.rate_bit)
    rate = f"{shape.rate_bit}bit"
    # r2q sets htb's quantum (bytes a class sends per round); with one busy class its
    # value only silences the kernel's "quantum is big" warning at 10 Gbit/s.
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb default 10 r2q 100000",
        f"class replace dev {dev} parent 1: classid {DEFAULT_CLASS} htb rate {rate} "
        f"ceil {rate} burst {burst} cburst {burst} quantum 65536",
        f"class replace dev {dev} parent 1: classid {DROP_CLASS} htb rate 8bit ceil 8bit",
        f"qdisc replace dev {dev} parent {DROP_CLASS} handle 20: pfifo limit 0",
    ]
    lines += loss_lines(dev, shape.loss)
    return lines


def change_lines(dev: str, old: LinkShape, new: LinkShape) -> list[str]:
    """Lines that move ``dev`` from ``old`` to ``new`` without dropping its cut filters."""
    lines: list[str] = []
    if new.rate_bit != old.rate_bit:
        burst = burst_bytes(new.rate_bit)
        rate = f"{new.rate_bit}bit"
        lines.append(
            f"class change dev {dev} parent 1: classid {DEFAULT_CLASS} htb rate {rate} "
            f"ceil {rate} burst {burst} cburst {burst} quantum 65536"
        )
    if new.loss != old.loss:
        if old.loss > 0:
            lines.append(f"filter del dev {dev} parent 1: prio {LOSS_PRIO}")
        lines += loss_lines(dev, new.loss)
    return lines


def loss_lines(dev: str, loss: float) -> list[str]:
    """The random-loss filter: a random u32 at or above ``(1 - loss) * 2**32`` is lost."""
    if loss <= 0:
        return []
    threshold = min(int((1.0 - loss) * 2**32), 2**32 - 1)
    code = f"4,{_LD_RANDOM},53 0 1 {threshold},{_RET_CLASSID},{_RET_NO_MATCH}"
    return [
        f"filter add dev {dev} parent 1: prio {LOSS_PRIO} protocol all "
        f'bpf bytecode "{code}" classid {DROP_CLASS}'
    ]


def cut_all_lines(dev: str) -> list[str]:
    """Everything ``dev`` sends is lost (ARP too), until ``heal_all_lines``."""
    return [
        f"filter add dev {dev} parent 1: prio {CUT_ALL_PRIO} protocol all "
        f"u32 match u32 0 0 classid {DROP_CLASS}"
    ]


def heal_all_lines(dev: str) -> list[str]:
    return [f"filter del dev {dev} parent 1: prio {CUT_ALL_PRIO}"]


def cut_peer_lines(dev: str, peer_address: str, peer_index: int) -> list[str]:
    """IPv4 packets ``dev`` sends to ``peer_address`` are lost, until ``heal_peer_lines``."""
    return [
        f"filter add dev {dev} parent 1: prio {CUT_PEER_PRIO + peer_index} protocol ip "
        f"u32 match ip dst {peer_address}/32 classid {DROP_CLASS}"
    ]


def heal_peer_lines(dev: str, peer_index: int) -> list[str]:
    return [f"filter del dev {dev} parent 1: prio {CUT_PEER_PRIO + peer_index}"]
