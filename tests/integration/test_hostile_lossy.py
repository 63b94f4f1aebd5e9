"""Sync training over slow, lossy links ends with the same parameters as over clean ones.

Issue 19's link: 20 Mbit/s, 50 ms of one-way delay, 1% loss and 0.1% reordering, on
every host's link both ways (the userspace relay of ``clusterflow.testing.relay``: this
kernel has no ``sch_netem``). Two sync workers and a ps on three emulated hosts run the
same deterministic steps on clean links, then on those; ``benchmarks/scenarios/lossy``
is the scenario, and ``benchmarks/hostile.py`` reports the throughput it costs (a
figure, not this test's business).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from benchmarks.scenarios import lossy as scenario

from clusterflow.testing import available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

if not available():
    pytest.skip("needs root and iproute2 to make network namespaces", allow_module_level=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[scenario.Comparison]:
    # runs() stops the ps and removes the hosts (namespaces, relays, bridge) in its finally.
    yield scenario.runs(tmp_path_factory.mktemp("lossy"))


def _steps(run: scenario.Run) -> dict[str, int]:
    """The ps's counts that say what happened to every push."""
    stats = run.stats
    return {
        key: int(stats.get(key, 0))
        for key in ("version", "pushes", "applied", "dropped_late", "dropped_stale")
    }


def test_sync_training_over_lossy_delayed_reordering_links_ends_bit_for_bit_equal(
    runs: scenario.Comparison,
) -> None:
    # TCP hides the loss and the reordering from ZeroMQ: only time is lost, no update
    # is lost or applied twice, so every parameter is the clean run's, bit for bit.
    assert runs.lossy.final == runs.clean.final
    assert runs.figures()["lossy_max_param_diff"] == 0.0


def test_every_step_took_both_pushes_once_on_either_link(runs: scenario.Comparison) -> None:
    # Exactly STEPS sync steps of two pushes each; none dropped as late or stale.
    expected = {
        "version": scenario.STEPS,
        "pushes": 2 * scenario.STEPS,
        "applied": scenario.STEPS,
        "dropped_late": 0,
        "dropped_stale": 0,
    }
    assert _steps(runs.clean) == expected, runs.clean.stats
    assert _steps(runs.lossy) == expected, runs.lossy.stats


def test_the_parameters_are_those_of_the_same_steps_in_one_process(
    runs: scenario.Comparison,
) -> None:
    # The mean of the two replicas' gradients each step, SGD with momentum: what the ps
    # must have applied. Not bit for bit: the ps sums the pushes in its own order.
    torch.testing.assert_close(torch.tensor(runs.clean.final), torch.tensor(scenario.reference()))


def test_the_lossy_links_lost_packets_and_the_clean_ones_none(
    runs: scenario.Comparison,
) -> None:
    # The agreement above means something only if the second run did cross lossy links.
    assert runs.clean.lost_packets == 0
    assert runs.lossy.lost_packets >= 1, runs.lossy
