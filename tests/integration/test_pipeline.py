"""PipelineStrategy with real stage processes on 127.0.0.1 (docs/pipeline.md).

Four replicas run ``pipeline_job.py`` once (every scenario in one launch: each replica
pays torch's import on two cores); the tests assert on what each wrote:

* GPipe (4 stages), 1F1B and interleaved 1F1B (2 pipelines of 2 stages, data-parallel)
  end with the parameters one process reaches on the same global batches, within 1e-5;
* every stage wrote its part of a consistent checkpoint, and ``load_module`` joins the
  parts into one plain module;
* PipeDream's weight stashing, micro-batch by micro-batch: each backward differentiates
  the weights its forward ran on, while the live weights had moved on; and the whole run
  equals a one-process simulation of asynchronous 1F1B with stashing, within 1e-5;
* PipeDream reaches 1F1B's accuracy on the digits, within 1 point;
* layers built under ``cf.device("/job:worker/task:k")`` form task k's stage;
* GPipe's and 1F1B's stages, all on this host, sent through shared memory.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import clusterflow as cf
from clusterflow.checkpoint import CheckpointStorage

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_job as job
from script_ranks import run_script_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Any]]]:
    out = tmp_path_factory.mktemp("pipeline")
    run_script_ranks(Path(job.__file__), [str(out)], WORLD, timeout_s=240)
    yield {
        name: [torch.load(out / f"{name}-{r}.pt", weights_only=False) for r in range(WORLD)]
        for name in ("sync", "pipedream", "digits")
    } | {"out": [out]}


def _global_batches(
    global_batch_size: int, epochs: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches ``fit`` trains on, recorded from a one-process run."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((x.clone(), torch.empty(0)))
            return torch.zeros(len(x), job.CLASSES) + self.w

    def spy_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen[-1] = (seen[-1][0], y.clone())
        return out.sum() * 0

    spy = Spy()
    cf.fit(
        spy,
        spy_loss,
        torch.optim.SGD(spy.parameters(), lr=0.0),
        job.data(),
        epochs=epochs,
        global_batch_size=global_batch_size,
        seed=seed,
    )
    return seen


def test_sync_schedules_equal_one_process(results: dict[str, list[Any]]) -> None:
    model = job.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = cf.fit(
        model, nn.CrossEntropyLoss(), optimizer, job.data(), epochs=2, global_batch_size=16, seed=3
    )
    expected = job.flat(model)
    for schedule in ("gpipe", "1f1b", "interleaved", "1f1b-runtime"):
        for rank, result in enumerate(results["sync"]):
            got = result[schedule]
            diff = (got["params"] - expected).abs().max().item()
            assert diff < 1e-5, f"{schedule} rank {rank}: parameters differ by {diff}"
            assert got["loss"] == pytest.approx(history.history["loss"], abs=1e-5)
            # The 1/m of the batch mean rode on each micro-batch's loss: torch made no
            # pass over the gradients to divide them (sync.py).
            assert got["grads_divided"] == [], f"{schedule} rank {rank}: {got['grads_divided']}"
    assert results["sync"][0]["gpipe"]["bounds"] == [(0, 2), (2, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_each_stage_posts_every_receive_before_it_computes(
    results: dict[str, list[Any]], schedule: str
) -> None:
    """The overlap (``pipeline/overlap.py``, on by default): a stage posts the step's
    receives at its start, so the next micro-batch's activations and gradients arrive
    while it computes; torch's own lowering posts each one just before its compute. The
    run above, which equals one process, ran these very schedules."""
    for rank, result in enumerate(results["sync"]):
        assert result[schedule]["actions"], f"{schedule} rank {rank} built no schedule"
        first = result[schedule]["stage"] == 0 and schedule != "interleaved"
        for order in result[schedule]["actions"]:
            # The shard actions (no-ops without FSDP) aside.
            actions = [a for a in order if not a.endswith(("SHARD", "REDUCE_GRAD"))]
            receives = [i for i, a in enumerate(actions) if "RECV" in a]
            assert receives, f"{schedule} rank {rank} received nothing: {actions}"
            start = 0
            if first:
                # The first stage sends its first forward before anything else: every
                # other stage waits for it (overlap.receives_after_first_send).
                assert actions[:2] == ["0F0", "0SEND_F0"], f"{schedule} rank {rank}: {actions}"
                start = 2
            assert receives == list(range(start, start + len(receives))), (
                f"{schedule} rank {rank}: {actions}"
            )


def test_stages_on_one_host_send_through_shared_memory(results: dict[str, list[Any]]) -> None:
    """The run above, which equals one process, carried GPipe's and 1F1B's activations
    and gradients between neighbouring stages through shared memory (``shm_link``);
    the schedules that run on torch's runtime kept gloo."""
    for rank, result in enumerate(results["sync"]):
        for schedule, stages in (("gpipe", 4), ("1f1b", 2)):
            stage = result[schedule]["stage"]
            neighbours = [s for s in (stage - 1, stage + 1) if 0 <= s < stages]
            assert result[schedule]["linked"] == neighbours, f"{schedule} rank {rank}"
        assert result["interleaved"]["linked"] == []
        assert result["1f1b-runtime"]["linked"] == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_first_stage_zeroes_its_gradients_after_its_first_forward(
    results: dict[str, list[Any]], schedule: str
) -> None:
    """The step's own preparation (zeroing the gradients, posting the outputs' receive)
    waits on the first stage until its first forward is on its way, and runs before
    anything else on the other stages (SyncEngine.step). Each step's zeroing is
    therefore preceded, on the first stage, by its forward of micro-batch 0, and
    elsewhere never is."""
    for rank, result in enumerate(results["sync"]):
        events = result[schedule]["events"]
        before = [events[i - 1] if i else None for i, e in enumerate(events) if e[0] == "Z"]
        assert before, f"{schedule} rank {rank} zeroed nothing"
        if result[schedule]["stage"] == 0:
            assert set(before) == {("F", 0)}, f"{schedule} rank {rank}: {before}"
        else:
            assert ("F", 0) not in before, f"{schedule} rank {rank}: {before}"
    assert results["sync"][0]["1f1b"]["bounds"] == [(0, 3), (3, 7)]


def test_every_stage_writes_its_part_and_load_module_joins_them(
    results: dict[str, list[Any]],
) -> None:
    joined = results["sync"][0]["joined"]
    assert joined["step"] == 8
    assert (joined["params"] - results["sync"][0]["1f1b"]["params"]).abs().max().item() == 0.0
    manifest = CheckpointStorage(str(results["out"][0] / "ckpt-1f1b")).latest()
    assert manifest is not None and manifest.step == 8
    assert {"stage-0", "stage-1"} <= set(manifest.parts)
    assert manifest.meta["joined_parts"] == ["stage-0", "stage-1"]


def test_device_blocks_cut_the_model_at_their_tasks(results: dict[str, list[Any]]) -> None:
    for result in results["pipedream"]:
        assert result["device_bounds"] == [(0, 2), (2, 5)]


def test_a_training_session_loop_trains_and_checkpoints_the_stages(
    results: dict[str, list[Any]],
) -> None:
    for result in results["pipedream"]:
        loop = result["loop"]
        assert loop["step"] == 6 and len(loop["losses"]) == 6
        assert loop["losses"][-1] < loop["losses"][0]
        assert loop["losses"] == results["pipedream"][0]["loop"]["losses"]
    manifest = CheckpointStorage(str(results["out"][0] / "ckpt-loop")).latest()
    assert manifest is not None and manifest.step == 6
    assert {"stage-0", "stage-1", "worker-3"} <= set(manifest.parts)


def test_pipedream_stages_get_the_outputs_before_the_last_backward(
    results: dict[str, list[Any]],
) -> None:
    """The last stage sends a step's outputs as soon as its last forward ran
    (``pipeline/outputs.py``): stage 0 returns from its step, outputs in hand, while the
    last stage's loss function in its last backward waits for stage 0 to say so. A
    step that ended with a barrier on the last stage's whole step (its last backward
    and its update) would leave that wait to run out."""
    by_stage: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for result in results["pipedream"]:
        by_stage[result["outputs_early"]["stage"]].append(result["outputs_early"])
    for last in by_stage[1]:
        assert last["waits"] == [True, True], last["waits"]
    for first, last in zip(by_stage[0], by_stage[1], strict=True):
        # Stage 0's loss is the last stage's own, from the outputs it received.
        assert first["losses"] == last["losses"] and first["rows"] == last["rows"] == 16


def test_pipedream_backward_uses_the_weights_its_forward_used(
    results: dict[str, list[Any]],
) -> None:
    stale = 0
    for result in results["pipedream"]:
        records = result["records"]
        assert [r[0] for r in records] == list(range(len(records)))  # every micro-batch
        for mb, fwd, bwd, live, stash_sum, fwd_sum, live_sum in records:
            assert bwd == fwd, f"micro-batch {mb}: backward on version {bwd}, forward {fwd}"
            assert stash_sum == fwd_sum, f"micro-batch {mb}: the stash changed"
            if result["stage"] == 1:
                assert live == fwd  # the last stage: backward right after its forward
            elif live != fwd:
                stale += 1
                assert live_sum != stash_sum, f"micro-batch {mb}: live weights equal the stash"
    # Stage 0 ran one micro-batch ahead: every backward but the first saw newer weights.
    assert stale >= 2 * (len(results["pipedream"][0]["records"]) - 1)


@pytest.mark.parametrize("two_bw", [False, True], ids=["pipedream", "pipedream-2bw"])
def test_pipedream_equals_a_simulation_of_async_1f1b_with_stashing(
    results: dict[str, list[Any]], two_bw: bool
) -> None:
    """Stage 0 runs one micro-batch ahead; each backward on its forward's weights; an
    update per micro-batch, or (2BW) the mean of a batch's micro-batches per update."""
    lr, microbatches, pipelines = 0.05, 4, 2
    every = microbatches if two_bw else 1
    model = job.mlp()
    (a, b), (c, d) = results["pipedream"][0]["bounds"]
    first, last = model[a:b], model[c:d]
    loss_fn = nn.CrossEntropyLoss()
    names = [n for n, _ in first.named_parameters()]
    waiting: deque[tuple[list[torch.Tensor], list[torch.Tensor]]] = deque()
    returned: deque[list[torch.Tensor]] = deque()

    sums = {id(m): [torch.zeros_like(p) for p in m.parameters()] for m in (first, last)}
    counts = {id(first): 0, id(last): 0}

    def update(module: nn.Module, grads: list[torch.Tensor]) -> None:
        for t, g in zip(sums[id(module)], grads, strict=True):
            t.add_(g)
        counts[id(module)] += 1
        if counts[id(module)] % every == 0:
            with torch.no_grad():
                for p, t in zip(module.parameters(), sums[id(module)], strict=True):
                    p.sub_(lr * t / every)
                    t.zero_()

    def backward_first() -> None:
        outs, stash = waiting.popleft()
        grads_out = returned.popleft()
        total = [torch.zeros_like(p) for p in stash]
        for out, grad in zip(outs, grads_out, strict=True):
            for t, g in zip(total, torch.autograd.grad(out, stash, grad), strict=True):
                t.add_(g / pipelines)
        update(first, total)

    for x, y in _global_batches(16, 2, 3):
        xs = [part.chunk(microbatches) for part in x.chunk(pipelines)]
        ys = [part.chunk(microbatches) for part in y.chunk(pipelines)]
        for i in range(microbatches):
            stash = [p.detach().clone().requires_grad_() for p in first.parameters()]
            outs = [
                functional_call(first, dict(zip(names, stash, strict=True)), (xs[k][i],))
                for k in range(pipelines)
            ]
            waiting.append((outs, stash))
            last.zero_grad()
            grads_out = []
            for k in range(pipelines):
                act = outs[k].detach().requires_grad_()
                (loss_fn(last(act), ys[k][i]) / pipelines).backward()
                grads_out.append(act.grad * pipelines)
            returned.append(grads_out)
            update(last, [p.grad.clone() for p in last.parameters()])
            if len(waiting) > 1:
                backward_first()
    while waiting:
        backward_first()
    for rank, result in enumerate(results["pipedream"]):
        got = result["2bw"] if two_bw else result
        diff = (got["params"] - job.flat(model)).abs().max().item()
        assert diff < 1e-5, f"rank {rank}: PipeDream differs from the simulation by {diff}"
        if two_bw and got["stage"] == 0:
            # One weight snapshot per update (8 updates, 2 epochs of 4 batches), not one
            # per micro-batch: the micro-batches of a version share it.
            assert got["versions"] <= 9, got["versions"]


def test_pipedream_reaches_1f1b_accuracy_on_digits(results: dict[str, list[Any]]) -> None:
    for accuracy in results["digits"]:
        assert accuracy["1f1b"] > 0.8, accuracy
        assert accuracy["pipedream"] >= accuracy["1f1b"] - 0.01, accuracy
