"""In-graph model parallelism: a module built under ``cf.device("/job:worker/task:1")``
on the chief runs on that task (a real ``serve_worker`` process), its activations sent
there and its gradients back over clusterflow's RPC, and trains exactly as it would here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import clusterflow as cf
from clusterflow.rpc import Credentials
from clusterflow.strategies.pipeline import PipelineError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[subprocess.Popen[str]]:
    """worker:1 serving; this process plays the chief (TF_CONFIG and the secret set)."""
    spec = {
        "chief": [f"127.0.0.1:{_free_port()}"],
        "worker": [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"],
    }
    secret = Credentials.generate().to_hex()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "TF_CONFIG"))}
    worker = subprocess.Popen(
        [sys.executable, "-c", "from clusterflow.strategies import serve_worker; serve_worker()"],
        env={
            **base,
            "CLUSTERFLOW_SECRET": secret,
            "TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker", "index": 1}}),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    saved = {k: os.environ.get(k) for k in ("TF_CONFIG", "CLUSTERFLOW_SECRET")}
    os.environ["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}})
    os.environ["CLUSTERFLOW_SECRET"] = secret
    try:
        yield worker
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _build(place: bool) -> nn.Sequential:
    torch.manual_seed(0)
    if place:
        with cf.device("/job:worker/task:1"):
            body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    else:
        body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    return nn.Sequential(body, nn.Linear(16, 3))


def test_a_placed_module_trains_on_its_task_as_it_would_here(
    cluster: subprocess.Popen[str],
) -> None:
    class WhereAmI(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :1] * 0 + self.w + float(os.getpid())

    with cf.device("/job:worker/task:1"):
        probe = WhereAmI()
    assert probe(torch.zeros(2, 3))[0, 0].item() == cluster.pid  # it ran on worker:1

    placed, local = _build(place=True), _build(place=False)
    assert type(placed[0]).__name__ == "PlacedSequential"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (placed, local)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        for model, optimizer in zip((placed, local), optimizers, strict=True):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    for a, b in zip(placed.parameters(), local.parameters(), strict=True):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6)
        assert torch.allclose(a, b, atol=1e-6)
    with torch.no_grad():
        x = torch.randn(5, 8, generator=gen)
        assert torch.allclose(placed(x), local(x), atol=1e-6)
    with pytest.raises(PipelineError, match="takes one tensor argument"):
        placed[0](x, x)
    with (
        pytest.raises(PipelineError, match=r"worker:7, which is not a task"),
        cf.device("/job:worker/task:7"),
    ):
        pass
