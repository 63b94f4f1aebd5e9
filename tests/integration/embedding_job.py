"""A click-through job for ``test_embedding_cluster.py``: ``python embedding_job.py OUT``.

The data come from a known logistic model: ``P(click) = sigmoid(user_bias[u] +
item_bias[i] + dense . w)``, users and items drawn from a power law (Zipf), so hot rows
are seen often and most of the item table never. The model learns it with an
``nn.Embedding`` of users and an ``nn.EmbeddingBag`` of items whose table is larger
than this worker's memory budget: the budget is enforced (``RLIMIT_AS``, the address
space, set before the model is built), so a table built whole here would fail.
Each replica writes ``OUT/w<index>.json``: its AUC on held-out data, the AUC of the
true model, its peak memory and the budget.
"""

from __future__ import annotations

import ctypes
import json
import resource
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

ITEMS = 2_000_000
DIM = 64
USERS = 4096
DENSE = 4
BUDGET = 160 << 20  # bytes the worker may grow by: far less than the 512 MB item table
STEPS, BATCH = 120, 512


def truth() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    return (
        torch.randn(USERS, generator=gen),
        torch.randn(8192, generator=gen),
        torch.randn(DENSE, generator=gen),
    )


def sample(seed: int, n: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(seed)
    users = torch.from_numpy((rng.zipf(1.3, n) - 1) % USERS)
    items = torch.from_numpy((rng.zipf(1.2, n) - 1) % ITEMS)
    dense = torch.from_numpy(rng.standard_normal((n, DENSE)).astype(np.float32))
    user_bias, item_bias, w = truth()
    hot = torch.where(
        items < item_bias.numel(), item_bias[items.clamp(max=item_bias.numel() - 1)], 0.0
    )
    logit = 1.5 * user_bias[users] + 1.5 * hot + dense @ w
    label = torch.from_numpy(rng.random(n) < torch.sigmoid(logit).numpy()).float()
    return users, items, dense, label, logit


class CTR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(USERS, 8, sparse=True)
        self.items = nn.EmbeddingBag(ITEMS, DIM, mode="sum")
        self.head = nn.Sequential(nn.Linear(8 + DIM + DENSE, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(
        self, users: torch.Tensor, items: torch.Tensor, dense: torch.Tensor
    ) -> torch.Tensor:
        offsets = torch.arange(items.numel())
        x = torch.cat([self.users(users), self.items(items, offsets), dense], 1)
        return self.head(x).squeeze(1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def bad_ids(model: CTR, strategy: object) -> list[str]:
    """An id past the item table, from the module and from a raw client: one line each,
    and the ps still answers a good pull after it."""
    from clusterflow.ps.rows import TableIndexError
    from clusterflow.rpc import RemoteError

    said = []
    try:
        model.items(torch.tensor([ITEMS]), torch.tensor([0]))
    except TableIndexError as exc:
        said.append(str(exc))
    name = model.items.__dict__["_cf_table"][0]
    ps = strategy._ps  # type: ignore[attr-defined]
    try:
        ps.call(1, "rows_pull", {}, {f"i/{name}": torch.tensor([ITEMS + 1])})
    except RemoteError as exc:
        said.append(f"{exc.error_type}: {exc}")
    _, rows = ps.call(1, "rows_pull", {}, {f"i/{name}": torch.tensor([1, 3])})
    said.append(f"then {tuple(rows[f'r/{name}'].shape)}")
    return said


def main() -> None:
    from sklearn.metrics import roc_auc_score

    from clusterflow.strategies.parameter_server import ParameterServerStrategy

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    strategy = ParameterServerStrategy(mode="async", dense="allreduce", table_init="uniform")
    base_rss = rss_bytes()
    # One malloc arena: glibc reserves 64 MiB of address space for each arena a new thread
    # may open, which would spend RLIMIT_AS on reservations, not memory ("can't start new
    # thread" once the ps client's pool grew). M_ARENA_MAX is -8 in malloc.h.
    ctypes.CDLL(None).mallopt(-8, 1)
    limit = vm_bytes() + BUDGET
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with strategy.scope():
        model = CTR()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def step(
        users: torch.Tensor, items: torch.Tensor, dense: torch.Tensor, y: torch.Tensor
    ) -> float:
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(users, items, dense), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    replica = strategy.worker_index
    for i in range(STEPS):
        users, items, dense, label, _ = sample(1000 * replica + i, BATCH)
        strategy.run(step, (users, items, dense, label))
    strategy.pull_values()
    users, items, dense, label, logit = sample(999_999, 20_000)
    with torch.no_grad():
        scores = model(users, items, dense)
    tables = strategy._sparse.tables
    assert tables is not None
    record: dict[str, object] = {"bad_id": bad_ids(model, strategy)}
    record |= {
        "auc": float(roc_auc_score(label.numpy(), scores.numpy())),
        "true_auc": float(roc_auc_score(label.numpy(), logit.numpy())),
        "base_rss": base_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "budget": BUDGET,
        "table_bytes": ITEMS * DIM * 4,
        "steps": strategy.steps,
        "bytes_pulled": tables.stats.bytes_pulled,
        "ps_stats": strategy.ps_stats(),
    }
    (out / f"w{replica}.json").write_text(json.dumps(record))
    strategy.close()


if __name__ == "__main__":
    main()
