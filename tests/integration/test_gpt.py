"""The GPT example (examples/gpt) under every strategy against one process, on CPU.

A tiny model (2 blocks of width 32, context 32) trains 20 steps on the standard
library's source. Every strategy is fed the global batches a one-process run takes
(``GlobalBatches``: drawn from seed and step), so the synchronous ones must end on the
one-process validation loss (within 1e-4), and async ps, whose updates are each one
worker's half batch, must reach it within 5% at equal samples. The plain DDP and FSDP2
scripts must give the same result under ``clusterflow start`` as under ``torchrun``.
The one-process runs are made once per module, in this process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.integration.conftest import Clusterflow
from tests.integration.test_cache import caches  # noqa: F401  (the fixture: drops the caches made)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt"
TRAIN = str(EXAMPLE / "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TINY = [
    *("--layers", "2", "--width", "32", "--heads", "2", "--context", "32"),
    *("--batch-size", "8", "--steps", "20", "--eval-every", "10", "--warmup", "5"),
    *("--val-windows", "32", "--corpus-bytes", "300000", "--threads", "1"),
]
CORPUS_BYTES = "300000"
# A ps worker clips its own gradient before pushing it (docs/gpu.md): with two workers
# that is not one process's clip, so the ps runs are compared without clipping.
NO_CLIP = ["--clip", "0"]


def final_loss(output: str) -> float:
    found = re.findall(r"final val_loss ([0-9.]+) step (\d+)", output)
    assert found, output[-3000:]
    return float(found[0][0])


@pytest.fixture(scope="module")
def alone() -> Callable[..., float]:
    """The one-process run's final validation loss for the given flags (memoised)."""
    spec = importlib.util.spec_from_file_location("gpt_train", TRAIN)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cache: dict[tuple[str, ...], float] = {}

    def run(*flags: str) -> float:
        if flags not in cache:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                train.main([*TINY, *flags])
            cache[flags] = final_loss(out.getvalue())
        return cache[flags]

    return run


def start(cf: Clusterflow, shape: list[str], *flags: str) -> str:
    done = cf.run("start", *shape, "--", sys.executable, TRAIN, *TINY, *flags, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def torchrun(tmp_path: Path, *flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "TF_CONFIG"))}
    done = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "2", TRAIN, *TINY, *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def checkpoint_loss(directory: Path) -> float:
    """What ``generate.py`` measures of the checkpoint (and that it generates text)."""
    done = subprocess.run(
        [
            *(sys.executable, str(EXAMPLE / "generate.py"), "--checkpoint-dir", str(directory)),
            *("--tokens", "20", "--score", CORPUS_BYTES, "--val-windows", "32"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[1] == "# step 20" and lines[2].startswith("def "), done.stdout
    return float(lines[0].removeprefix("checkpoint val_loss "))


def test_mirrored_matches_one_process_and_its_checkpoint_generates(
    cf: Clusterflow, alone: Callable[..., float], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    out = start(cf, ["--workers", "2"], "--strategy", "mirrored", "--checkpoint-dir", str(ckpt))
    loss = final_loss(out)
    assert abs(loss - alone()) < 1e-4
    assert abs(checkpoint_loss(ckpt) - loss) < 1e-5  # load_module gives the trained model


def test_sync_ps_matches_one_process(cf: Clusterflow, alone: Callable[..., float]) -> None:
    out = start(cf, ["--ps", "1", "--workers", "2"], "--strategy", "ps-sync", *NO_CLIP)
    assert abs(final_loss(out) - alone(*NO_CLIP)) < 1e-4


def test_async_ps_fed_by_the_data_service_reaches_the_one_process_loss_at_equal_samples(
    cf: Clusterflow, alone: Callable[..., float]
) -> None:
    # Each worker takes 20 steps of half a global batch: the samples of 20 global steps.
    flags = ["--strategy", "ps-async", "--data-service", *NO_CLIP]
    out = start(cf, ["--ps", "1", "--workers", "2"], *flags)
    reference = alone(*NO_CLIP)
    assert final_loss(out) <= reference * 1.05
    assert len(re.findall(r"throughput tokens_per_s", out)) == 2  # both workers trained


def test_pipeline_matches_one_process(cf: Clusterflow, alone: Callable[..., float]) -> None:
    # Two stages: the head cannot share the embedding's weight (train.py unties it).
    # Each stage clips by the whole model's norm (summed over the stages), as one process.
    out = start(cf, ["--workers", "2"], "--strategy", "pipeline")
    assert abs(final_loss(out) - alone("--no-tie")) < 1e-4


@pytest.mark.parametrize("plain", ["ddp", "fsdp"])
def test_unmodified_torch_script_gives_the_same_result_under_clusterflow_as_under_torchrun(
    cf: Clusterflow, alone: Callable[..., float], tmp_path: Path, plain: str
) -> None:
    ours = final_loss(start(cf, ["--workers", "2"], "--strategy", plain))
    theirs = final_loss(torchrun(tmp_path, "--strategy", plain))
    assert ours == theirs
    assert abs(ours - alone()) < 1e-4


@pytest.mark.usefixtures("caches")
def test_records_from_an_in_memory_cache_teach_the_model(cf: Clusterflow, tmp_path: Path) -> None:
    parquet = tmp_path / "gpt.parquet"
    subprocess.run(
        [sys.executable, TRAIN, *TINY, "--write-parquet", str(parquet)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    made = cf.run("cache", "create", "gpt", "--from", str(parquet), "--partitions", "2")
    assert made.returncode == 0, made.stderr
    out = start(
        cf, ["--cache", "gpt", "--workers", "2"], "--strategy", "mirrored", "--cache", "gpt"
    )
    # An untrained model scores ln(256) = 5.55 on the validation text; records that were
    # not the corpus's (zeros, a wrong column) would not bring it down on real text.
    assert final_loss(out) < 5.3
