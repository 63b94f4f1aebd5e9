"""Ray's driver prints cluster errors to stdout; a clusterflow command's stdout is data."""

from __future__ import annotations

import logging

import pytest

from clusterflow.backends import ray_driver


def test_ray_cluster_errors_go_to_the_log_not_to_stdout(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ray._private import worker

    # The thread that prints them looks the printer up at each message (not bound once),
    # so replacing the module's printer reroutes every later message.
    assert "print_to_stdstream" in worker.listen_error_messages.__code__.co_names
    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)
    ray_driver._errors_to_log()
    ray_driver._errors_to_log()  # a second join changes nothing
    message = {"lines": ["The node with node id abc has been marked dead"], "pid": "raylet"}
    with caplog.at_level(logging.WARNING, logger=ray_driver.__name__):
        worker.print_to_stdstream({**message, "is_err": False}, ignore_prefix=False)
    assert capsys.readouterr().out == ""  # `describe --json` stays parseable
    assert [r.getMessage() for r in caplog.records] == [
        "ray (raylet): The node with node id abc has been marked dead"
    ]
