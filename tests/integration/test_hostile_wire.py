"""Hostile bytes at a live cluster: its rpc Server, ps service, dispatcher and manager.

The promise (docs/failure-semantics.md, "Hostile bytes"): whatever arrives at a port,
each message gets an error reply or a dropped connection; the process stays up, its
memory stays bounded, and good clients keep being served during and after.

One cluster (``--ps 1 --workers 1``, a job that sleeps) gives four live targets in two
processes: the ps task's ``Server`` (``health.ping``, unknown methods) and its ps service
(``ps.*``), and the manager's dispatcher (``data.*``) and its own methods (``manager.*``).
Hypothesis draws the messages: ``EXAMPLES`` examples of ``PER_EXAMPLE`` messages per
process, 2 x 24 x 25 = 1,200 messages in all, plus ``GARBAGE`` raw non-ZMTP payloads; the
suite's per-test timeout (120 s) is its time bound (it takes a few seconds: legal waits
are kept short, ``LEGAL_WAIT_S``). The 100,000-message run is
``python -m benchmarks.hostile``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterflow.ps.wire import DEFAULT_TIMEOUT_S, MAX_WAIT_S
from clusterflow.rpc import Credentials, RpcClient, codec
from clusterflow.rpc.fuzz import FIELDS, WireProbe, hostile_message, raw_garbage

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

EXAMPLES = 24
PER_EXAMPLE = 25
GARBAGE = 20
RSS_GROWTH_BOUND = 256 * 1024**2
"""Far above what a few thousand small messages may leave behind (allocator slack),
far below what a leak of one copy per message, or one absurd allocation, would take."""

ANSWER_TIMEOUT_S = DEFAULT_TIMEOUT_S + 20.0
"""A safety net for a hang, not a measurement: an answer comes in milliseconds, except
for a body that legitimately waits. A ``ps.pull`` or ``ps.wait_version`` for a version
far ahead, with no ``timeout`` of its own, waits the default (``DEFAULT_TIMEOUT_S``)
and is then answered with ``VersionTimeout``: Hypothesis found one, a ``ps.pull`` with
``min_version`` 15729526, which the former 20 s net called unanswered."""

LEGAL_WAIT_S = 0.2
"""The wait a structured message asks for in place of a legal longer one (``_structured``).

A wait for a version far ahead is well-formed, not hostile: the ps answers it with
``VersionTimeout`` once it ends. Left at the default (60 s), or at a drawn 100 s, each
such example held the test that long, and two of them ran it past its 120 s timeout
(with ``derandomize=True``, Hypothesis's first examples do: 240 s, failed). Values
outside the bounds a ps accepts (``ps.wire.BOUNDED``: NaN, infinities, negatives, more
than ``MAX_WAIT_S``) are sent as drawn, and must be refused at once."""

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _structured(method: str, request_id: int, body: Any, keys: dict[str, Any]) -> list[bytes]:
    """A well-formed header of a known method whose body hypothesis chose; a legal wait
    longer than ``LEGAL_WAIT_S``, or none (the default), asks for that instead."""
    named = {k: v for k, v in keys.items() if k in FIELDS.get(method, ())}
    if named and "timeout" in FIELDS.get(method, ()):
        wait = named.get("timeout", DEFAULT_TIMEOUT_S)
        legal = isinstance(wait, int | float) and not isinstance(wait, bool)
        if legal and LEGAL_WAIT_S < wait <= MAX_WAIT_S:
            named["timeout"] = LEGAL_WAIT_S
    header = {"v": codec.PROTOCOL_VERSION, "k": codec.KIND_REQUEST, "id": request_id, "m": method}
    header["b"] = named or body
    return [msgpack.packb(header, use_bin_type=True)]


def _fuzz(address: str, credentials: Credentials, methods: list[str], good: str) -> int:
    """Runs the hypothesis examples against one process; returns the messages sent."""
    sent = 0
    client = RpcClient(address, credentials, deadline=ANSWER_TIMEOUT_S)
    probe = WireProbe(address, credentials)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        # The same examples every run: a failure reproduces, and the legal waits among
        # them (LEGAL_WAIT_S) are drawn every time. The random search of 100,000
        # messages is ``benchmarks.hostile``'s.
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        rng=st.randoms(use_true_random=False),
        method=st.sampled_from(methods),
        body=_msgpack_values,
        keys=st.dictionaries(
            st.sampled_from(sorted({k for m in methods for k in FIELDS[m]}) or ["x"]),
            _msgpack_values,
            max_size=4,
        ),
        garbage=st.binary(max_size=256),
    )
    def one_example(
        rng: random.Random, method: str, body: Any, keys: dict[str, Any], garbage: bytes
    ) -> None:
        nonlocal sent
        messages = []
        # Ids do not depend on earlier examples: hypothesis replays an example exactly.
        for i in range(1, PER_EXAMPLE - 1):
            frames, owed = hostile_message(rng, methods, i)
            messages.append((frames, owed, i))
        structured_id = PER_EXAMPLE
        messages.append((_structured(method, structured_id, body, keys), True, structured_id))
        messages.append(([garbage], True, structured_id + 1))
        result = probe.run(messages, answer_timeout_s=ANSWER_TIMEOUT_S)
        sent += result.sent
        assert not result.unanswered_ids, f"no answer to {len(result.unanswered_ids)} messages"
        assert result.malformed_answers == 0
        assert not result.internal, f"handlers raised on bad input: {result.internal}"
        # A good client on its own connection is served between every batch.
        client.call(good)

    try:
        one_example()
    finally:
        probe.close()
    client.call(good)
    client.close()
    return sent


def test_fuzzed_wire_gets_answers_and_the_cluster_keeps_serving(cf: Clusterflow) -> None:
    job = cf.script("sleep.py", "import time\ntime.sleep(300)\n")
    cluster_id = cf.start_detached("--ps", "1", "--workers", "1", "--", "python", str(job))
    state = cf.wait_until(
        lambda: (s := cf.state(cluster_id)).get("status") == "running" and s,
        90,
        "the cluster to run",
    )
    credentials = Credentials.from_file(cf.path(cluster_id) / "secret")
    manager_address = state["manager"]["address"]
    ps_address = next(t["address"] for t in state["tasks"] if t["task"] == "ps:0")
    manager = psutil.Process(state["manager"]["pid"])
    ps_proc = next(p for p in cf.live(cluster_id) if "clusterflow.ps" in " ".join(p.cmdline()))
    before = {p.pid: p.memory_info().rss for p in (manager, ps_proc)}

    ps_methods = [m for m in FIELDS if m.startswith(("ps.", "health."))]
    manager_methods = [m for m in FIELDS if m.startswith(("data.", "manager.", "task.", "trial."))]
    sent = _fuzz(ps_address, credentials, ps_methods, "health.ping")
    sent += _fuzz(manager_address, credentials, manager_methods, "manager.status")
    assert sent == 2 * EXAMPLES * PER_EXAMPLE

    rng = random.Random(0)
    for address in (ps_address, manager_address):
        for _ in range(GARBAGE // 2):
            raw_garbage(address, rng.randbytes(rng.randrange(1, 4096)))

    for proc in (manager, ps_proc):
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        growth = proc.memory_info().rss - before[proc.pid]
        assert growth < RSS_GROWTH_BOUND, f"{proc.pid} grew by {growth} bytes"
    with RpcClient(ps_address, credentials, deadline=ANSWER_TIMEOUT_S) as client:
        assert client.call("ps.stats").body is not None
    assert cf.state(cluster_id)["status"] == "running"
