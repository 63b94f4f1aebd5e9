"""Prints text from a checkpoint that ``examples/gpt/train.py --checkpoint-dir DIR`` wrote.

Any strategy's checkpoint loads as one plain module: ``clusterflow.train.load_module``
joins parameter-server variables, pipeline stages and mirrored replicas into the model
``build_model`` makes (``gpt_config.json`` beside the checkpoints says its shape); the
plain DDP/FSDP runs write ``plain.pt``, a full state dict::

    python examples/gpt/train.py --steps 2000 --checkpoint-dir /tmp/gpt
    python examples/gpt/generate.py --checkpoint-dir /tmp/gpt --prompt "def " --tokens 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPTConfig, build_model, generate


def load(directory: str) -> tuple[nn.Module, GPTConfig, int]:
    """The trained model, its shape and its step; SystemExit naming what is missing."""
    folder = Path(directory)
    config_file = folder / "gpt_config.json"
    if not config_file.exists():
        raise SystemExit(f"error: {config_file} not found: not a train.py checkpoint directory")
    config = GPTConfig(**json.loads(config_file.read_text()))
    plain = folder / "plain.pt"
    if plain.exists():
        state = torch.load(plain, map_location="cpu", weights_only=False)
        model = build_model(config)
        model.load_state_dict(state["model"])
        return model, config, int(state["step"])
    from clusterflow.train.cut import load_module

    loaded = load_module(directory, lambda: build_model(config))
    if loaded is None:
        raise SystemExit(f"error: no checkpoint in {directory}")
    model, step = loaded
    return model, config, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=200, help="bytes to sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--score",
        type=int,
        metavar="BYTES",
        help="also print the validation loss train.py --corpus-bytes BYTES would measure",
    )
    p.add_argument("--val-windows", type=int, default=64, help="as train.py's, with --score")
    args = p.parse_args()
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    model, config, step = load(args.checkpoint_dir)
    model.eval()
    if args.score is not None:
        from gpt_corpus import load_corpus, val_windows
        from gpt_model import lm_loss

        x, y = val_windows(load_corpus(args.score)[1], config.context, args.val_windows)
        with torch.no_grad():
            print(f"checkpoint val_loss {float(lm_loss(model(x), y)):.6f}", flush=True)
    text = generate(
        model,
        args.prompt.encode(),
        context=config.context,
        new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(f"# step {step}", flush=True)
    print(text.decode("utf-8", errors="replace"), flush=True)


if __name__ == "__main__":
    main()
