"""A custom training loop in a ``TrainingSession``: restore, checkpoints, a last step, summaries.

TensorFlow's ``MonitoredTrainingSession`` for a loop of your own. Entering the session
restores the newest checkpoint (``session.step`` says where the run resumes); every
``run_step`` drives the hooks, which save every N steps, write TensorBoard scalars on
the chief and stop the loop at the last step. Stop or kill the run, start it again with
the same arguments, and it continues from the step it saved:

    python examples/custom_loop_session.py --steps 200 --checkpoint-dir ckpt --log-dir logs
    python examples/custom_loop_session.py --steps 400 --checkpoint-dir ckpt --log-dir logs
    clusterflow start --workers 2 -- \\
        python examples/custom_loop_session.py --steps 200 --checkpoint-dir ckpt

The same file runs as one replica alone and as all-reduce replicas in a cluster.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from _digits import load_digits_split, make_model
from clusterflow.strategies import MultiWorkerMirroredStrategy
from clusterflow.train import Checkpoint, Progress, StopAtStep, Summary, TrainingSession


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="the global step to stop at")
    p.add_argument("--batch-size", type=int, default=64, help="per replica")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--every-steps", type=int, default=50, help="checkpoint interval")
    p.add_argument("--log-dir", help="TensorBoard summaries (written by the chief)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    strategy = MultiWorkerMirroredStrategy()  # alone: a single replica
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    train, test = load_digits_split()

    torch.manual_seed(args.seed)
    with strategy.scope():
        model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # gradients averaged over the replicas here
        optimizer.step()
        return loss.detach()

    def global_batches(epoch: int) -> DataLoader[tuple[torch.Tensor, ...]]:
        # Every replica shuffles alike, so all walk the same global batches.
        generator = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        return DataLoader(train, batch_size=global_batch, shuffle=True, generator=generator)

    hooks = [
        StopAtStep(args.steps),
        Checkpoint(args.checkpoint_dir, every_steps=args.every_steps),
        Progress(every_steps=args.every_steps),
    ]
    if args.log_dir:
        hooks.append(Summary(args.log_dir, every_steps=10))

    with TrainingSession(
        strategy=strategy, model=model, optimizer=optimizer, hooks=hooks
    ) as session:
        if session.step:
            print(f"resumed at step {session.step}", flush=True)
        # Where the run resumes in the data: the epoch and the batches already taken.
        steps_per_epoch = len(global_batches(0))
        epoch, skip = divmod(session.step, steps_per_epoch)
        while not session.should_stop():
            batches = strategy.distribute(global_batches(epoch), global_batch)
            for x, y in itertools.islice(batches, skip, None):
                session.run_step(train_step, x, y)
                if session.should_stop():
                    break
            epoch, skip = epoch + 1, 0

    if strategy.is_chief:
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
        print(f"stopped at step {session.step} test_accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
