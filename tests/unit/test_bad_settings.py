"""Settings of the Python API refuse what would misbehave later (``_checks.py``): NaN,
a number of the wrong kind, a string where a list belongs. Each of these was accepted
once, and went wrong far from where it was given: a NaN lease timeout took every
worker's leases back at every sweep, a NaN ``max_staleness`` bounded nothing, a NaN
trial count made a study that never started a trial, ``command="python x.py"`` ran
the program ``p``, a checkpoint folder that was a file restored nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

import clusterflow as cf
from clusterflow._checks import seconds, whole
from clusterflow.checkpoint.manifest import CheckpointError
from clusterflow.checkpoint.storage import CheckpointStorage
from clusterflow.data.api import DatasetSpec
from clusterflow.data.config import DataConfig
from clusterflow.data.dispatcher import DispatcherConfig
from clusterflow.data.sources import ArrowSource, TensorSource
from clusterflow.errors import ConfigError
from clusterflow.strategies.parameter_server.config import ParameterServerConfig
from clusterflow.train.evaluate import Evaluate
from clusterflow.tune.space import parse_params
from clusterflow.tune.study import TuneSettings

NAN = float("nan")
ONE_WORKER = {"TF_CONFIG": '{"cluster": {"worker": ["h:1"]}}'}


def _study(**change: Any) -> TuneSettings:
    settings: dict[str, Any] = {
        "study": "s",
        "metric": "loss",
        "params": parse_params(["lr=uniform:0:1"]),
        "command": ("python", "x.py"),
        **change,
    }
    return TuneSettings(**settings)


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "ps-max-staleness-nan": (
        lambda: ParameterServerConfig(max_staleness=NAN),
        "max_staleness must be an integer >= 0, got nan",
    ),
    "ps-max-staleness-fraction": (
        lambda: ParameterServerConfig(max_staleness=2.5),
        "max_staleness must be an integer >= 0, got 2.5",
    ),
    "ps-warmup-string": (
        lambda: ParameterServerConfig(warmup_steps="3"),
        "warmup_steps must be an integer >= 0, got '3'",
    ),
    "ps-backup-string": (
        lambda: ParameterServerConfig(mode="sync", backup_workers="1"),
        "backup_workers must be an integer >= 0, got '1'",
    ),
    "ps-deadline-infinite": (
        lambda: ParameterServerConfig(deadline_s=math.inf),
        "deadline_s must be a positive, finite number of seconds, got inf",
    ),
    "ps-table-sharding": (
        lambda: ParameterServerConfig(table_sharding="modulo"),
        "table_sharding must be 'hash' or 'range', got 'modulo'",
    ),
    "ps-table-init": (
        lambda: ParameterServerConfig(table_init="xavier"),
        "table_init must be 'normal', 'uniform' or 'zeros', got 'xavier'",
    ),
    "lease-timeout-nan": (
        lambda: DispatcherConfig(lease_timeout_s=NAN),
        "lease_timeout_s must be a positive, finite number of seconds, got nan",
    ),
    "lease-timeout-string": (
        lambda: DispatcherConfig(lease_timeout_s="5"),
        "lease_timeout_s must be a positive, finite number of seconds, got '5'",
    ),
    "shuffle-buffer-fraction": (
        lambda: DataConfig(shuffle_buffer=2.5),
        "shuffle_buffer must be an integer >= 0, got 2.5",
    ),
    "evaluator-idle-nan": (
        lambda: Evaluate(lambda model: {}, idle_timeout_s=NAN),
        "idle_timeout_s must be a finite number of seconds >= 0, got nan",
    ),
    "study-trials-nan": (
        lambda: _study(trials=NAN).check(),
        "--trials must be an integer >= 1, got nan",
    ),
    "study-poll-zero": (
        lambda: _study(poll_s=0).check(),
        "poll_s must be a positive, finite number of seconds, got 0",
    ),
    "param-bound-infinite": (
        lambda: parse_params(["n=int:1:inf"]),
        "--param 'n=int:1:inf': 'inf' is not a finite number",
    ),
    "tune-command-string": (
        lambda: cf.tune.run(
            "s", params={"lr": "uniform:0:1"}, command="python x.py", metric="loss"
        ),
        "command must be a list of arguments, got the string 'python x.py'",
    ),
    "pipeline-split-string": (
        lambda: cf.PipelineStrategy(split="layer3"),
        "split must be a list of split points, got the string 'layer3'",
    ),
    "resolver-task-outside-the-cluster": (
        lambda: cf.TFConfigClusterResolver(task_type="worker", task_id=7, environ=ONE_WORKER),
        "no task 7 in job 'worker'",
    ),
    "checkpoint-every-secs-string": (
        lambda: cf.train.Checkpoint("ckpt", every_secs="60"),
        "every_secs must be a positive, finite number of seconds, got '60'",
    ),
    "arrow-cached-chunks-string": (
        lambda: ArrowSource("x.parquet", cached_chunks="2"),
        "cached_chunks must be an integer >= 1, got '2'",
    ),
    "ps-resolver-string": (
        lambda: cf.ParameterServerStrategy(cluster_resolver="worker"),
        "ParameterServerStrategy: cluster_resolver must be a ClusterResolver",
    ),
    "ps-config-dict": (
        lambda: cf.ParameterServerStrategy(config={"mode": "sync"}),
        "config must be a ParameterServerConfig",
    ),
    "mirrored-resolver-dict": (
        lambda: cf.MultiWorkerMirroredStrategy(cluster_resolver={"worker": ["h:1"]}),
        "MultiWorkerMirroredStrategy: cluster_resolver must be a ClusterResolver",
    ),
    "pipeline-resolver-string": (
        lambda: cf.PipelineStrategy(cluster_resolver="worker"),
        "PipelineStrategy: cluster_resolver must be a ClusterResolver",
    ),
    "mirrored-devices-string": (
        lambda: cf.MirroredStrategy("cpu:0"),
        "devices must be a list of device names, got the string 'cpu:0'",
    ),
    "session-max-steps-negative": (
        lambda: cf.TrainingSession(max_steps=-1),
        "max_steps must be an integer >= 1, got -1",
    ),
    "session-strategy-name": (
        lambda: cf.TrainingSession(strategy="mirrored"),
        "strategy must be a clusterflow Strategy or None, got str",
    ),
    "mirrored-gpu-on-a-cpu-host": (
        lambda: cf.MirroredStrategy(["/gpu:0"]),
        "device '/gpu:0' is not on this host (0 CUDA devices visible)",
    ),
    "data-seed-string": (
        lambda: DataConfig(seed="x"),
        "seed must be an integer >= 0, got 'x'",
    ),
    "data-epochs-negative": (
        lambda: DataConfig(epochs=-1),
        "epochs must be an integer >= 1, got -1",
    ),
    "data-name-empty": (
        lambda: DataConfig(name=""),
        "name must be a non-empty string, got ''",
    ),
    "tensor-source-scalar-column": (
        lambda: TensorSource({"x": 5}),
        "TensorSource column 'x' must be an array, a tensor or a sequence of records, got int 5",
    ),
    "tensor-source-string-column": (
        lambda: TensorSource({"x": "abc"}),
        "must be an array, a tensor or a sequence of records, got str 'abc'",
    ),
    "tensor-source-0d-column": (
        lambda: TensorSource({"x": torch.tensor(3.0)}),
        "TensorSource column 'x' must hold records, got a scalar",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_setting_is_one_error_naming_it(case: str) -> None:
    make, message = CASES[case]
    with pytest.raises(ConfigError) as raised:
        make()
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_checkpoint_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "afile"
    path.write_text("")
    with pytest.raises(CheckpointError, match=f"checkpoint folder '{path}' is a file"):
        CheckpointStorage(str(path))
    CheckpointStorage(str(tmp_path / "not-yet"))  # a folder still to make is fine


def test_a_checkpoint_url_of_no_path_is_refused() -> None:
    with pytest.raises(CheckpointError, match="url must be a non-empty string, got None"):
        CheckpointStorage(None)  # type: ignore[arg-type]


def test_good_values_pass_numpy_numbers_too() -> None:
    assert whole("n", np.int64(3), least=1) == 3
    assert seconds("t", np.float32(0.5)) == 0.5
    assert ParameterServerConfig(max_staleness=3, warmup_steps=2).max_staleness == 3
    resolver = cf.TFConfigClusterResolver(task_type="worker", task_id=0, environ=ONE_WORKER)
    assert str(resolver.task) == "worker:0"
    # Without TF_CONFIG there is no cluster to hold the task to, as in TensorFlow.
    assert str(cf.TFConfigClusterResolver(task_type="worker", task_id=3, environ={}).task) == (
        "worker:3"
    )


def test_good_columns_and_data_settings_pass() -> None:
    source = TensorSource({"x": np.ones((3, 2)), "y": [1, 2, 3], "z": torch.zeros(3)})
    assert source.num_records() == 3
    assert DataConfig(seed=np.int64(2), epochs=None).seed == 2
    assert type(DataConfig(seed=np.int64(2)).seed) is int  # crosses msgpack
    spec = DatasetSpec(name="d", source="memory:x", num_records=np.int64(10), split_size=3)
    assert msgpack.unpackb(msgpack.packb(spec.to_wire()))["num_records"] == 10


def test_numpy_integers_count_as_integers_in_every_step_and_partition_setting() -> None:
    """Each of these checked ``isinstance(value, int)`` once, so a numpy integer (what
    arithmetic on a numpy array gives) was refused as "must be an integer, got 3"."""
    from clusterflow.cache.plan import partition_ranges
    from clusterflow.train import Progress, StopAtStep

    three = np.int64(3)
    assert StopAtStep(three).last_step == 3
    assert Progress(every_steps=three).every_steps == 3
    ranges = partition_ranges(9, three)
    assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == 9
    resolver = cf.TFConfigClusterResolver(
        task_type="worker", task_id=np.int64(0), environ=ONE_WORKER
    )
    assert str(resolver.task) == "worker:0"
    with pytest.raises(ConfigError, match=r"StopAtStep\(last_step\) must be an integer >= 0"):
        StopAtStep(-1)


def test_hooks_none_is_no_hooks_as_in_tensorflow() -> None:
    assert cf.TrainingSession(hooks=None).hooks == []
