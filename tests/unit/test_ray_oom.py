"""Which of Ray's errors say its memory monitor killed a task's actor (``_ray_oom``).

A task killed for memory restarts with more memory (manager/policy.py); any other death
is an ordinary kill. The errors are built as Ray 2.60 builds them on ``ray.get``: a
task's ``OutOfMemoryError``, and for an actor an ``ActorDiedError`` made from the death
context the raylet filled in, whose message is all it keeps.
"""

from __future__ import annotations

import pytest

# Ray is a test dependency (the `test` extra): its absence is a failure, not a skip.
import ray.exceptions as ray_exceptions
from ray.core.generated import common_pb2

from clusterflow.backends.ray_actor import _ray_oom

pytestmark = pytest.mark.timeout(30)

# The raylet's own wording (its binary's format strings, Ray 2.60), as it reaches Python.
_RAYLET_OOM = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.1, ID: 7f3a) was 7.52GB used / 7.60GB limit (0.99)"
)


def _actor_died(message: str) -> BaseException:
    context = common_pb2.ActorDiedErrorContext(
        error_message=message, actor_id=b"\x01" * 16, class_name="_TaskActor"
    )
    return ray_exceptions.ActorDiedError(cause=context)


def test_an_actor_killed_by_the_memory_monitor_is_an_oom() -> None:
    assert _ray_oom(_actor_died(_RAYLET_OOM))


def test_a_task_killed_by_the_memory_monitor_is_an_oom_by_its_type() -> None:
    assert _ray_oom(ray_exceptions.OutOfMemoryError("any wording"))


@pytest.mark.parametrize(
    "error",
    [
        _actor_died("The actor was killed by `ray.kill`."),
        _actor_died("Worker exits with an exit code None. SIGSEGV"),
        ray_exceptions.ActorDiedError(),
        # The wording alone, on an error that is no actor's death, is no OOM.
        ray_exceptions.RaySystemError(_RAYLET_OOM),
    ],
    ids=["ray-kill", "segfault", "no-cause", "not-an-actor"],
)
def test_other_deaths_are_ordinary_kills(error: BaseException) -> None:
    assert not _ray_oom(error)
