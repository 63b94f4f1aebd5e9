"""A small decoder-only transformer (GPT) over bytes, as an ``nn.Sequential``.

The model is a sequence of children (embedding, blocks, head) so that every strategy
takes it as it is: ``PipelineStrategy`` cuts a ``Sequential`` between children, the
others see one module. The head shares the token embedding's weight (weight tying)
unless ``tie=False``; a pipeline needs it untied, since the two ends live on different
stages.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "build_model", "generate", "lm_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """The model's shape; ``train.py``'s flags fill it and checkpoints store it."""

    layers: int = 4
    """Transformer blocks."""
    width: int = 256
    """Embedding width (the residual stream)."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    context: int = 256
    """Tokens a sequence holds (positions learnt up to this length)."""
    vocab: int = 256
    """Byte-level: every byte is a token, so no tokenizer and no download."""
    tie: bool = True
    """Head weight is the token embedding's (False for a pipeline: its ends are apart)."""
    amp: bool = True
    """bf16 autocast when the input is on CUDA (CPU runs stay in float32 so that runs
    compare to 1e-4)."""

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "context", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"GPTConfig.heads={self.heads} does not divide width={self.width}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _autocast(config: GPTConfig, x: torch.Tensor) -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=config.amp and x.is_cuda)


class Embed(nn.Module):
    """Token plus learnt position embeddings; takes byte ids of any integer dtype.

    Plain parameters, not ``nn.Embedding``: under a parameter-server scope an
    ``nn.Embedding`` becomes a sparse row table (docs/embeddings.md), which is for
    tables too large to pull whole; 256 byte rows, every one used every step, are a
    dense variable (and the head shares this weight).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.empty(config.vocab, config.width))
        self.positions = nn.Parameter(torch.empty(config.context, config.width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Batches travel as uint8 (a quarter of int32's bytes through the data service).
        ids = ids.long()
        return F.embedding(ids, self.tokens) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.ln1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.ln2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.out = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.config.heads
        with _autocast(self.config, x):
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x


class Head(nn.Module):
    """Final norm and the projection to byte logits (tied to ``embed`` when given)."""

    def __init__(self, config: GPTConfig, embed: Embed | None) -> None:
        super().__init__()
        self.config = config
        self.ln = nn.LayerNorm(config.width)
        # A list, so the embedding is not registered twice: its weight stays one
        # parameter (and one ps variable), created once, by the embedding.
        self._tied = [embed] if embed is not None else []
        if embed is None:
            self.weight = nn.Parameter(torch.empty(config.vocab, config.width))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._tied[0].tokens if self._tied else self.weight
        with _autocast(self.config, x):
            return F.linear(self.ln(x), weight)


def build_model(config: GPTConfig) -> nn.Sequential:
    """The model, initialised from torch's current random state (seed it first)."""
    embed = Embed(config)
    blocks = [Block(config) for _ in range(config.layers)]
    model = nn.Sequential(embed, *blocks, Head(config, embed if config.tie else None))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            # GPT-2's: residual projections scaled down by depth, so the stream's
            # variance does not grow with the number of blocks.
            std = (
                0.02 / math.sqrt(2 * config.layers)
                if name.endswith(("proj.weight", "out.weight"))
                else 0.02
            )
            nn.init.normal_(p, std=std)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy, in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long())


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    *,
    context: int,
    new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> bytes:
    """``prompt`` followed by ``new_tokens`` sampled bytes."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor(list(prompt) or [10], dtype=torch.long, device=device)[None]
    for _ in range(new_tokens):
        logits = model(ids[:, -context:])[:, -1, :].float() / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return bytes(ids[0].tolist())
