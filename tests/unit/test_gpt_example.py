"""The GPT example's own pieces (examples/gpt), in one process.

The schedule, the batches every replica and run must agree on, and the clipping hook's
place before a parameter-server strategy's push (docs/gpu.md says a ps worker pushes
its clipped gradient).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from clusterflow.ps.local import LocalPS
from clusterflow.strategies import SimpleClusterResolver
from clusterflow.strategies.parameter_server import ParameterServerStrategy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"

pytestmark = pytest.mark.timeout(60)


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


train = load("train")
corpus = load("gpt_corpus")


def test_warm_up_then_cosine_down_to_the_floor() -> None:
    args = train.parse_args(["--lr", "1e-3", "--warmup", "10", "--steps", "110"])
    assert train.lr_at(0, args) == pytest.approx(1e-4)
    assert train.lr_at(9, args) == pytest.approx(1e-3)
    assert train.lr_at(60, args) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way down
    assert train.lr_at(110, args) == pytest.approx(1e-4)
    lrs = [train.lr_at(s, args) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_a_global_batch_depends_on_seed_and_step_alone() -> None:
    tokens = np.arange(5000, dtype=np.int64).astype(np.uint8)
    a = corpus.GlobalBatches(tokens, context=16, batch=8, seed=3)
    b = corpus.GlobalBatches(tokens, context=16, batch=8, seed=3)
    x5, y5 = a.at(5)
    assert torch.equal(x5, b.at(5)[0]) and torch.equal(y5, b.at(5)[1])
    assert torch.equal(x5[:, 1:], y5[:, :-1])  # targets are the next byte
    assert not torch.equal(x5, a.at(6)[0])
    assert not torch.equal(x5, corpus.GlobalBatches(tokens, context=16, batch=8, seed=4).at(5)[0])
    streamed = list(a.stream(7))
    assert torch.equal(streamed[5][0], x5)


def test_bad_sizes_are_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--layers", "0"])
    assert exc.value.code == 2
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err


def test_a_ps_worker_pushes_its_clipped_gradient() -> None:
    box: dict[str, torch.optim.Optimizer] = {}
    clip = train.install_clip(box, 1.0)  # before the strategy, as train.py does
    spec = {"worker": ["127.0.0.1:2000"], "ps": ["127.0.0.1:3000"]}
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=0)
    strategy = ParameterServerStrategy(resolver, _connection=LocalPS(), mode="sync")
    try:
        with strategy.scope():
            layer = torch.nn.Linear(4, 1, bias=False)
            torch.nn.init.zeros_(layer.weight)
            box["optimizer"] = torch.optim.SGD(layer.parameters(), lr=1.0)

        def step() -> None:
            # A gradient of norm 100 * sqrt(4) = 200: clipped to 1 before it is pushed.
            layer(torch.full((1, 4), 100.0)).sum().backward()
            box["optimizer"].step()
            box["optimizer"].zero_grad()

        strategy.run(step)
        strategy.pull_values()
        moved = float(layer.weight.detach().norm())
        assert math.isclose(moved, 1.0, rel_tol=1e-5), moved  # the ps applied lr * clipped
    finally:
        clip.remove()
        strategy.close()


TINY = [
    *("--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4"),
    *("--steps", "6", "--eval-every", "6", "--warmup", "2", "--val-windows", "8"),
    *("--corpus-bytes", "60000", "--clip", "0.05", "--lr", "1e-2"),
]


def final_loss(flags: list[str]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main([*TINY, *flags])
    found = re.findall(r"final val_loss ([0-9.]+)", out.getvalue())
    assert found, out.getvalue()
    return float(found[0])


def test_train_py_clips_before_a_one_worker_ps_pushes_so_it_trains_as_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One sync worker: its own gradient is the global one, so clipping it before the
    # push is exact; a clip that ran after the push would leave the ps unclipped.
    spec = {"worker": ["127.0.0.1:2000"], "ps": ["127.0.0.1:3000"]}
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=0)
    monkeypatch.setattr(
        train,
        "make_strategy",
        lambda args, device: ParameterServerStrategy(resolver, _connection=LocalPS(), mode="sync"),
    )
    ps = final_loss(["--strategy", "ps-sync"])
    assert abs(ps - final_loss(["--strategy", "none"])) < 1e-5
    assert abs(ps - final_loss(["--strategy", "none", "--clip", "0"])) > 1e-4  # it clipped
