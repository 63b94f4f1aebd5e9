"""A small GPT on the Python standard library's source, under every strategy.

A decoder-only transformer over bytes (4 blocks of width 256, context 256 by default)
learns to write Python from the standard library's own files (``gpt_corpus.py``: no
download). ``--strategy`` picks how it is distributed; the model, the batches, AdamW,
gradient clipping, the warm-up and cosine schedule and bf16 autocast (on CUDA) are the
same under all of them::

    python examples/gpt/train.py                                # one process (fit)
    torchrun --nproc-per-node 2 examples/gpt/train.py --strategy ddp    # plain DDP
    torchrun --nproc-per-node 2 examples/gpt/train.py --strategy fsdp   # FSDP2
    clusterflow start --workers 2 -- python examples/gpt/train.py --strategy ddp
    clusterflow start --workers 2 -- python examples/gpt/train.py --strategy mirrored
    clusterflow start --ps 1 --workers 2 -- python examples/gpt/train.py --strategy ps-async
    clusterflow start --ps 1 --workers 2 -- python examples/gpt/train.py --strategy ps-sync
    clusterflow start --workers 2 -- python examples/gpt/train.py --strategy pipeline

``ddp`` and ``fsdp`` are plain PyTorch scripts (``torch.distributed`` and nothing of
clusterflow's): they run under ``torchrun`` and under ``clusterflow start`` alike. The
others train through ``clusterflow.fit``. Global batch ``s`` is drawn from the seed and
``s`` alone (``GlobalBatches``), and every replica takes its contiguous slice of it, so
a synchronous run on any number of replicas takes the steps of a one-process run.

``--data-service`` feeds records (windows of ``context + 1`` bytes) through the data
service instead; ``--cache NAME`` reads them from the in-memory cache ``NAME``, made
from the Parquet file ``--write-parquet PATH`` writes::

    python examples/gpt/train.py --write-parquet /tmp/gpt.parquet --context 256
    clusterflow cache create gpt --from /tmp/gpt.parquet --partitions 2
    clusterflow start --cache gpt --workers 2 -- \\
        python examples/gpt/train.py --strategy mirrored --cache gpt

``--checkpoint-dir`` saves every ``--checkpoint-every`` steps (and resumes from the
newest); ``examples/gpt/generate.py --checkpoint-dir DIR`` prints text from it.

What the chief prints: ``eval step N val_loss X elapsed_s T`` at every evaluation and
``final val_loss X step N``; every training task prints ``throughput tokens_per_s X``
for its own tokens (steps after the first ``--timing-warmup``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_corpus import GlobalBatches, load_corpus, val_windows, windows
from gpt_model import GPTConfig, build_model, lm_loss

PLAIN = ("ddp", "fsdp")
FIT = ("none", "mirrored", "ps-async", "ps-sync", "pipeline")
STRATEGIES = FIT + PLAIN


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, default="none")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--no-tie", action="store_true", help="untie the head (pipeline: always)")
    p.add_argument("--batch-size", type=int, default=32, help="global: over all replicas")
    p.add_argument("--steps", type=int, default=2000)
    # nanoGPT's small-model settings: 1e-3 peak, a tenth at the end, beta2 0.95.
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip; 0: none")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--val-windows", type=int, default=64, help="validation records")
    p.add_argument("--corpus-bytes", type=int, default=8_000_000, help="0: the whole library")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--data-service", action="store_true", help="records via the data service")
    p.add_argument("--cache", metavar="NAME", help="records from the in-memory cache NAME")
    p.add_argument("--write-parquet", metavar="PATH", help="write the records and exit")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-warmup", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument(
        "--slow-rank", type=int, default=-1, help="this replica sleeps --slow-factor per step"
    )
    p.add_argument("--slow-factor", type=float, default=0.2)
    args = p.parse_args(argv)
    for name in ("layers", "width", "heads", "context", "batch_size", "steps", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.clip < 0:
        p.error(f"--clip must be >= 0, got {args.clip}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    if args.cache and args.strategy in PLAIN:
        p.error(f"--cache feeds clusterflow's fit; --strategy {args.strategy} is plain torch")
    if args.device == "cpu" and args.strategy == "mirrored" and torch.cuda.is_available():
        p.error(
            "--device cpu: MultiWorkerMirroredStrategy takes this replica's GPU; hide it "
            "with CUDA_VISIBLE_DEVICES="
        )
    if args.data_service and args.strategy in PLAIN:
        p.error(f"--data-service feeds clusterflow's fit; --strategy {args.strategy} is plain")
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        context=args.context,
        # A pipeline's first and last stages live in different processes.
        tie=not args.no_tie and args.strategy != "pipeline",
        amp=not args.no_amp,
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """The learning rate of step ``step`` (from 0): linear warm-up, then cosine decay to
    ``lr * min_lr_ratio`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    done = min(1.0, (step - args.warmup) / span)
    low = args.lr * args.min_lr_ratio
    return low + 0.5 * (args.lr - low) * (1.0 + math.cos(math.pi * done))


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases, norms and position tables do not (GPT-2's rule)."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "positions" not in name else keep).append(p)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, args), betas=(0.9, 0.95))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def install_clip(box: dict[str, Any], max_norm: float, *, across_stages: bool = False) -> Any:
    """Clips ``box["optimizer"]``'s gradients to ``max_norm`` just before each of its steps.

    A global optimizer pre-hook registered before the strategy is built, so it runs
    before a parameter-server strategy's own hook pushes the gradients. Under
    all-reduce it sees the averaged gradient (exact, as one process); a ps worker clips
    its own replica's gradient before pushing it (docs/gpu.md). With ``across_stages``
    (a pipeline: each stage holds the gradients of its own layers) the squared norms
    are summed over every rank and divided by the pipelines (``box["pipelines"]``: the
    same stage of every pipeline holds the same averaged gradient), so every stage
    clips by the whole model's norm, as one process does.
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def clip(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if opt is not box.get("optimizer"):
            return
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if not across_stages:
            if params:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            return
        grads = [p.grad for p in params]
        import torch.distributed as dist

        squares = torch.zeros((), dtype=torch.float64)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad.detach(), dtype=torch.float64).cpu() ** 2
        dist.all_reduce(squares)  # every stage of every pipeline takes part
        total = math.sqrt(float(squares) / box["pipelines"])
        # torch's clip_grad_norm_ rule: scale by max_norm / (norm + 1e-6), never up.
        scale = min(1.0, max_norm / (total + 1e-6))
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)

    return register_optimizer_step_pre_hook(clip)


def pick_device(choice: str) -> torch.device:
    """``--device``: auto takes this replica's GPU (``LOCAL_RANK``) when there is one."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class Timer:
    """Tokens per second of this process after the first ``warmup`` steps, and the
    slow replica's extra sleep (the benchmarks' straggler)."""

    def __init__(self, args: argparse.Namespace, rank: int, tokens_per_step: int) -> None:
        self.warmup = args.timing_warmup
        self.tokens_per_step = tokens_per_step
        self.slow = args.slow_factor if rank == args.slow_rank else 0.0
        self.cuda = torch.cuda.is_available()
        self.start = time.perf_counter()
        self.t0: float | None = None
        self.counted = 0
        self.last = time.perf_counter()

    def step_done(self, step: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.slow:
            time.sleep(self.slow * (now - self.last))  # the behaviour measured: a straggler
            now = time.perf_counter()
        self.last = now
        if step == self.warmup:
            self.t0 = now
        elif step > self.warmup:
            self.counted += 1

    def report(self) -> None:
        """Prints the rate (a process given no tokens per step reports nothing)."""
        if self.t0 is not None and self.counted and self.tokens_per_step:
            rate = self.counted * self.tokens_per_step / (time.perf_counter() - self.t0)
            print(f"throughput tokens_per_s {rate:.1f} steps {self.counted}", flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# -- through clusterflow's fit ------------------------------------------------------------


def make_strategy(args: argparse.Namespace, device: torch.device) -> Any:
    """The strategy named by ``--strategy``; None: this process alone."""
    if args.strategy == "none":
        return None
    if args.strategy == "mirrored":
        from clusterflow.strategies import MultiWorkerMirroredStrategy

        # It takes this replica's GPU (LOCAL_RANK) when there is one, else the CPU.
        return MultiWorkerMirroredStrategy()
    if args.strategy == "pipeline":
        from clusterflow.strategies.pipeline import PipelineStrategy

        # The cut between the middle blocks: children are embed, blocks..., head.
        return PipelineStrategy("1f1b", args.microbatches, split=[1 + args.layers // 2])
    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    return ParameterServerStrategy(mode="sync" if args.strategy == "ps-sync" else "async")


def run_fit(args: argparse.Namespace, config: GPTConfig, device: torch.device) -> None:
    from clusterflow.train import Checkpoint, Hook, StopAtStep, fit

    class Schedule(Hook):
        """Sets the learning rate of the step about to run (also after a restore)."""

        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def begin(self, session: Any) -> None:
            set_lr(self.optimizer, lr_at(session.step, args))

        def after_step(self, session: Any, info: Any) -> None:
            set_lr(self.optimizer, lr_at(info.step, args))
            timer.step_done(info.step)

        def after_epoch(self, session: Any, epoch: int, logs: Any) -> None:
            if session.is_chief and "val_loss" in logs:
                print(
                    f"eval step {session.step} val_loss {logs['val_loss']:.6f} "
                    f"elapsed_s {timer.elapsed():.2f}",
                    flush=True,
                )

    train_tokens, val_tokens = load_corpus(args.corpus_bytes)
    val = val_windows(val_tokens, args.context, args.val_windows)
    # The clip hook must be registered before the strategy is built: a ps strategy's
    # own hook (registered in its constructor) pushes the gradients it sees.
    box: dict[str, Any] = {}
    pipeline = args.strategy == "pipeline"
    clip = install_clip(box, args.clip, across_stages=pipeline) if args.clip else None
    strategy = make_strategy(args, device)
    if pipeline:
        box["pipelines"] = strategy.replicas().count
    torch.manual_seed(args.seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = build_model(config)
        optimizer = box["optimizer"] = make_optimizer(model, args)
    if args.strategy in ("none", "ps-async", "ps-sync"):
        # A ps worker computes on its device; the values it pulls are copied there.
        model.to(device)
    replicas = strategy.replicas().count if strategy is not None else 1
    _say_backend(strategy is None or strategy.is_chief)
    own = args.strategy == "ps-async"  # each worker's own tokens; else the global batch's
    tokens = (args.batch_size // replicas if own else args.batch_size) * args.context
    report = own or strategy is None or strategy.is_chief
    timer = Timer(args, _rank(strategy), tokens if report else 0)

    hooks: list[Any] = [Schedule(optimizer), StopAtStep(args.steps)]
    if args.checkpoint_dir:
        hooks.append(Checkpoint(args.checkpoint_dir, every_steps=args.checkpoint_every))
        if strategy is None or strategy.is_chief:
            write_config(args.checkpoint_dir, config)
    epochs = -(-args.steps // args.eval_every)
    with contextlib.ExitStack() as stack:
        if args.data_service or args.cache:
            data: Any = stack.enter_context(open_records(args, train_tokens, replicas))
            batch = None
        else:
            data = GlobalBatches(
                train_tokens, context=args.context, batch=args.batch_size, seed=args.seed
            ).stream(args.steps)
            batch = args.batch_size
        history = fit(
            model,
            lm_loss,
            optimizer,
            data,
            strategy=strategy,
            epochs=epochs,
            steps_per_epoch=args.eval_every,
            global_batch_size=batch,
            validation_data=val,
            hooks=hooks,
            seed=args.seed,
        )
    if clip is not None:
        clip.remove()
    timer.report()
    if strategy is None or strategy.is_chief:
        last = history.last()
        print(f"final val_loss {last.get('val_loss', float('nan')):.6f} step {history.step}")
    if strategy is not None and hasattr(strategy, "close"):
        strategy.close()


def _say_backend(chief: bool) -> None:
    """``backend nccl|gloo``: which collective backend this run's group uses, if any."""
    import torch.distributed as dist

    if chief and dist.is_available() and dist.is_initialized():
        print(f"backend {dist.get_backend()}", flush=True)


def _rank(strategy: Any) -> int:
    if strategy is None:
        return 0
    worker_index = getattr(strategy, "worker_index", None)
    if isinstance(worker_index, int):
        return worker_index
    return int(os.environ.get("RANK", "0"))


def open_records(args: argparse.Namespace, train_tokens: Any, replicas: int) -> Any:
    """This replica's share of the records, leased from the data service."""
    from clusterflow.data import distributed_dataset, torch_collate

    def pairs(columns: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rec = torch_collate(columns)["tokens"]
        return rec[:, :-1], rec[:, 1:]

    if args.cache:
        source: Any = f"cache://{args.cache}"
    else:
        from clusterflow.data import TensorSource

        source = TensorSource({"tokens": windows(train_tokens, args.context)})
    return distributed_dataset(
        source,
        batch_size=max(1, args.batch_size // replicas),  # per replica: its own leases
        split_size=256,
        seed=args.seed,
        epochs=None,
        collate_fn=pairs,
    )


def write_parquet(path: str, args: argparse.Namespace) -> None:
    """The training records as one Parquet file, for ``clusterflow cache create``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rec = windows(load_corpus(args.corpus_bytes)[0], args.context)
    column = pa.FixedSizeListArray.from_arrays(pa.array(rec.ravel()), rec.shape[1])
    pq.write_table(pa.table({"tokens": column}), path, row_group_size=1024)
    print(f"wrote {len(rec)} records of {rec.shape[1]} bytes to {path}")


def write_config(directory: str, config: GPTConfig) -> None:
    """``gpt_config.json`` beside the checkpoints: what ``generate.py`` builds."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    partial = Path(directory) / f".gpt_config.{os.getpid()}.json"
    partial.write_text(json.dumps(config.to_dict()))
    os.replace(partial, Path(directory) / "gpt_config.json")


# -- plain torch: DDP and FSDP2, as under torchrun ---------------------------------------


def run_plain(args: argparse.Namespace, config: GPTConfig, device: torch.device) -> None:
    """A plain PyTorch training loop: nothing of clusterflow's is imported here.

    The process group comes from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...), which ``clusterflow start`` sets as torchrun does.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    _say_backend(rank == 0)
    world = dist.get_world_size() if distributed else 1
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not a multiple of {world} ranks")
    train_tokens, val_tokens = load_corpus(args.corpus_bytes)
    val_x, val_y = val_windows(val_tokens, args.context, args.val_windows)
    torch.manual_seed(args.seed)
    model = build_model(config).to(device)
    if args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in list(model)[1:-1]:
            fully_shard(block)
        fully_shard(model)
        train_model: nn.Module = model
    elif distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        train_model = model
    optimizer = make_optimizer(model, args)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    start = 0
    saved = Path(args.checkpoint_dir or "/nonexistent") / "plain.pt"
    if args.checkpoint_dir and saved.exists():
        state = torch.load(saved, map_location="cpu", weights_only=False)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        start = state["step"]
    if args.checkpoint_dir and rank == 0:
        write_config(args.checkpoint_dir, config)
    batches = GlobalBatches(
        train_tokens, context=args.context, batch=args.batch_size, seed=args.seed
    )
    share = args.batch_size // world
    timer = Timer(args, rank, args.batch_size * args.context if rank == 0 else 0)

    def evaluate() -> float:
        train_model.eval()
        total, rows = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(val_x), args.batch_size):
                x = val_x[i : i + args.batch_size].to(device)
                y = val_y[i : i + args.batch_size].to(device)
                # Every rank evaluates the whole set (as fit does): FSDP's forward is
                # a collective, so all ranks must call it anyway.
                total += float(lm_loss(train_model(x), y)) * len(x)
                rows += len(x)
        train_model.train()
        return total / rows

    val_loss = float("nan")
    for step in range(start, args.steps):
        set_lr(optimizer, lr_at(step, args))
        x, y = batches.at(step)
        mine = slice(rank * share, (rank + 1) * share)
        x, y = x[mine].to(device, non_blocking=True), y[mine].to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(train_model(x), y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        timer.step_done(step + 1)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            val_loss = evaluate()
            if rank == 0:
                print(
                    f"eval step {done} val_loss {val_loss:.6f} elapsed_s {timer.elapsed():.2f}",
                    flush=True,
                )
        if args.checkpoint_dir and (done % args.checkpoint_every == 0 or done == args.steps):
            model_state, optim_state = get_state_dict(model, optimizer, options=full)
            if rank == 0:
                partial = saved.with_name(f".plain.{os.getpid()}.pt")
                torch.save({"model": model_state, "optimizer": optim_state, "step": done}, partial)
                os.replace(partial, saved)
    timer.report()
    if rank == 0:
        print(f"final val_loss {val_loss:.6f} step {args.steps}", flush=True)
    if distributed:
        # The group is freed here, from its last Python reference, with the GIL
        # released and its threads joined (digits_ddp.py's leave_process_group says
        # why). First goes everything that holds it: the DDP reducer, left to free it
        # from C++ when this function returns, would do so holding the GIL, and a gloo
        # thread waiting for the GIL to drop a finished allreduce deadlocks it.
        del evaluate, train_model, model, optimizer
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group
        if args.strategy == "fsdp":
            # FSDP2's parameters are DTensors, and torch 2.13's DTensor keeps their
            # device mesh, and with it the group, in its sharding caches for good (held
            # from C++; clearing the Python caches does not free it). The group's gloo
            # threads then live into the interpreter's finalization, where one can abort
            # the process (docs/failure-semantics.md, "Process exit"). Everything is
            # written and printed: leave without finalizing.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.write_parquet:
        write_parquet(args.write_parquet, args)
        return
    device = pick_device(args.device)
    config = model_config(args)
    if args.strategy in PLAIN:
        run_plain(args, config, device)
    else:
        run_fit(args, config, device)


if __name__ == "__main__":
    main()
