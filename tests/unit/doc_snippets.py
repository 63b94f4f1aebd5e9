"""Every code block of README.md and docs/*.md, and how the suite runs it.

Shared by ``tests/unit/test_doc_snippets.py`` (blocks that run in one process, and the
names every block uses) and ``tests/integration/test_doc_snippets_in_cluster.py`` (blocks that run
under ``clusterflow start``).

How a Python block runs is read from the page itself:

* no marker: it runs as shown, alone (one process, no cluster);
* a first line ``# Run under `clusterflow start OPTIONS -- python train.py`.`` (or
  ``# clusterflow start OPTIONS -- python train.py``): it runs as shown, as the job of a
  local cluster started with those options;
* ``<!-- snippet: ID -->`` on the line above the fence: it runs as ``SNIPPETS[ID]``
  says (the names a fragment leaves to the reader defined before it, sizes made small);
  a block whose sizes the suite changes says so in the marker, in parentheses;
* ``<!-- not run: REASON -->``: it only compiles and its names resolve; the reason is
  the review of why it cannot run.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^\s*```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(snippet|not run):\s*(.*?)\s*-->\s*$")
_SNIPPET = re.compile(r"^([\w-]+)(?:\s+\((.+)\))?$")
_CLUSTER_LINE = re.compile(r"^#\s*(?:Run under\s+)?`?clusterflow start (.*?) -- python\b")


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """How the suite runs one marked block (``<!-- snippet: ID -->``)."""

    setup: str = ""
    """Code run before the block, in its namespace: what the page leaves to the reader."""
    replace: tuple[tuple[str, str], ...] = ()
    """Text of the block swapped before it runs (a size made small, a file made local);
    each must occur in the block, and the marker must say so."""
    after: str = ""
    """Code run after the block: what proves it did its part (a step through a model)."""
    cluster: tuple[str, ...] | None = None
    """``clusterflow start``'s options when it runs as a cluster's job; None: alone."""
    files: dict[str, str] = field(default_factory=dict)
    """Files written in the folder it runs in, by name (a job script it names)."""
    parquet: bool = False
    """Write ``train.parquet`` (x: 2 floats, y: an int; 600 rows) where it runs."""
    starts_clusters: bool = False
    """It starts clusters itself (``cf.tune.run``): it runs in the integration suite, whose
    fixture stops whatever it leaves."""


@dataclass(frozen=True, slots=True)
class Block:
    page: str
    line: int
    """The line of its first line of code (1-based)."""
    language: str
    text: str
    marker: str | None
    """``snippet`` or ``not run``, from the comment on the line above the fence."""
    note: str
    """What follows the marker's colon."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def snippet_id(self) -> str | None:
        match = _SNIPPET.match(self.note) if self.marker == "snippet" else None
        return match.group(1) if match else None

    @property
    def says_resized(self) -> bool:
        match = _SNIPPET.match(self.note) if self.marker == "snippet" else None
        return bool(match and match.group(2))

    def cluster_options(self) -> tuple[str, ...] | None:
        """``start``'s options from the block's first line, or its ``Run``'s."""
        run = SNIPPETS.get(self.snippet_id or "")
        if run is not None and run.cluster is not None:
            return run.cluster
        first = self.text.lstrip().splitlines()[0] if self.text.strip() else ""
        match = _CLUSTER_LINE.match(first)
        return tuple(shlex.split(match.group(1))) if match else None

    def program(self) -> str:
        """The code the suite runs: setup, the block (its swaps made), and after."""
        run = run_of(self)
        text = self.text
        for old, new in run.replace:
            text = text.replace(old, new)
        return "\n".join(part for part in (run.setup, text, run.after) if part.strip()) + "\n"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker on the line above its fence."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    name = str(path.relative_to(ROOT))
    fence: str | None = None
    code: list[str] = []
    start, marker, note = 0, None, ""
    for number, line in enumerate(lines, 1):
        match = _FENCE.match(line)
        if fence is not None:
            if match and not match.group(1):
                out.append(Block(name, start, fence, "\n".join(code), marker, note))
                fence, code = None, []
            else:
                code.append(line)
            continue
        if match:
            fence, start = match.group(1).lower(), number + 1
            above = next((x for x in reversed(lines[: number - 1]) if x.strip()), "")
            found = _MARKER.match(above)
            marker, note = (found.group(1), found.group(2)) if found else (None, "")
    assert fence is None, f"{name}: a code block opened on line {start - 1} never closes"
    return out


def all_blocks() -> list[Block]:
    return [b for path in pages() for b in blocks(path)]


def python_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.language == "python"]


def run_of(block: Block) -> Run:
    return SNIPPETS.get(block.snippet_id or "", Run())


def runs_alone(block: Block) -> bool:
    """Runs in one process of the unit suite."""
    return (
        block.marker != "not run"
        and block.cluster_options() is None
        and not run_of(block).starts_clusters
    )


def runs_in_integration(block: Block) -> bool:
    """Runs in the integration suite: as a cluster's job, or a program starting clusters."""
    return block.marker != "not run" and not runs_alone(block)


# The names a block uses -----------------------------------------------------------------


_DEFAULT_NAMES = {"cf": ("clusterflow", []), "clusterflow": ("clusterflow", [])}
"""What a fragment may use without importing it: the page's ``import clusterflow as cf``."""


class _Missing:
    """Stands for an argument when a call is checked against a signature."""


def exported_submodule(package: ModuleType, name: str, value: ModuleType) -> bool:
    """Whether ``package.name`` (a submodule) is there for every user, not only for one
    whose process happened to import the submodule already (which sets the attribute as
    a side effect): the package's ``__getattr__`` hands it out, or its ``__init__``
    imports it."""
    lazy = vars(package).get("__getattr__")
    if callable(lazy):
        try:
            if lazy(name) is value:
                return True
        except AttributeError:
            pass
    source = getattr(package, "__file__", None)
    if not source or not source.endswith("__init__.py"):
        return False
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            return True
        if isinstance(node, ast.Import) and any(
            a.name == f"{package.__name__}.{name}" for a in node.names
        ):
            return True
    return False


def resolve(module: str, attributes: list[str]) -> Any:
    """The object ``module.a.b`` names, as a fresh process would find it once it
    imported ``module``.

    Raises:
        LookupError: naming the first part that is not there.
    """
    parts = [module, *attributes]
    obj: Any = importlib.import_module(module)
    for i, name in enumerate(attributes, 2):
        try:
            value = getattr(obj, name)
        except AttributeError:
            raise LookupError(f"{'.'.join(parts[:i])} does not exist") from None
        if (
            inspect.ismodule(value)
            and inspect.ismodule(obj)
            and not exported_submodule(obj, name, value)
        ):
            raise LookupError(
                f"{'.'.join(parts[:i])} is there only once something imported it: "
                f"{obj.__name__} does not export {name!r}"
            )
        obj = value
    return obj


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def name_problems(block: Block) -> list[str]:
    """Every ``clusterflow`` name the block uses that does not exist, and every call of
    one whose arguments its signature refuses: imports, ``cf.x.y`` paths, calls."""
    tree = ast.parse(block.text)
    names: dict[str, tuple[str, list[str]]] = dict(_DEFAULT_NAMES)
    problems: list[str] = []

    def at(node: ast.AST) -> str:
        return f"{block.page}:{block.line + getattr(node, 'lineno', 1) - 1}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "clusterflow":
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as exc:
                        problems.append(f"{at(node)}: import {alias.name}: {exc}")
                    bound = alias.name if alias.asname else "clusterflow"
                    names[alias.asname or "clusterflow"] = (bound, [])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clusterflow"):
            module = node.module or ""
            try:
                found = importlib.import_module(module)
            except ImportError as exc:
                problems.append(f"{at(node)}: from {module}: {exc}")
                continue
            for alias in node.names:
                if not hasattr(found, alias.name):
                    try:
                        importlib.import_module(f"{module}.{alias.name}")
                    except ImportError:
                        problems.append(f"{at(node)}: {module} has no {alias.name!r}")
                        continue
                names[alias.asname or alias.name] = (module, [alias.name])
    seen: set[str] = set()
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node
        if not isinstance(target, ast.Attribute | ast.Name):
            continue
        dotted = _dotted(target)
        if not dotted or dotted[0] not in names:
            continue
        module, attributes = names[dotted[0]]
        path = ".".join([module, *attributes, *dotted[1:]])
        try:
            obj = resolve(module, [*attributes, *dotted[1:]])
        except LookupError as exc:
            if path not in seen:
                problems.append(f"{at(node)}: {'.'.join(dotted)}: {exc}")
            seen.add(path)
            continue
        if isinstance(node, ast.Call) and callable(obj):
            problem = _call_problem(node, obj)
            if problem:
                problems.append(f"{at(node)}: {'.'.join(dotted)}(...): {problem}")
    return problems


def _call_problem(call: ast.Call, obj: Any) -> str | None:
    """Why ``obj``'s signature refuses the call's arguments, or None."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return None  # *args or **kwargs: nothing to check by name
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(
            *[_Missing()] * len(call.args), **{k.arg: _Missing() for k in call.keywords if k.arg}
        )
    except TypeError as exc:
        return str(exc)
    return None


# How marked blocks run ------------------------------------------------------------------

_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn

import clusterflow as cf

torch.manual_seed(0)
torch.set_num_threads(1)
"""

_TRIAL = """
import argparse
import clusterflow as cf

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("--layers", type=int)
args = parser.parse_args()
cf.tune.report(val_accuracy=1.0 - abs(args.lr - 0.01) - 0.01 * args.layers)
"""

SNIPPETS: dict[str, Run] = {
    "readme-fit": Run(
        setup=_MODEL
        + """
def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


loss_fn = nn.CrossEntropyLoss()
x, y = torch.randn(512, 8), torch.randint(0, 2, (512,))
""",
        after="assert len(history.history['loss']) == 5, history.history",
    ),
    "data-service": Run(
        setup=_MODEL + "seen = []\nstep = lambda columns: seen.extend(columns['y'].tolist())\n",
        replace=(("s3://bucket/train/*.parquet", "train.parquet"),),
        after="assert sorted(seen) == sorted(list(range(600)) * 3), len(seen)",
        parquet=True,
    ),
    "data-cache": Run(
        setup="import clusterflow as cf\n",
        after="assert sum(len(b.data['y']) for b in data) == 600",
        cluster=("--workers", "1", "--cache", "mnist"),
        parquet=True,
    ),
    "embeddings-dlrm": Run(
        setup=_MODEL,
        replace=(("5_000_000", "1_000"),),
        after="""
dense, ids = torch.randn(4, 13), [torch.randint(0, 1_000, (8,)) for _ in range(4)]
offsets = [torch.tensor([0, 2, 4, 6])] * 4
loss = model(dense, ids, offsets).pow(2).mean()
loss.backward()
optimizer.step()
strategy.close()
""",
        cluster=("--ps", "1", "--workers", "1"),
    ),
    "failure-semantics-session": Run(
        setup=_MODEL
        + """
import clusterflow
from clusterflow import Checkpoint, TrainingSession

path = "train.parquet"
strategy = cf.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = nn.Linear(2, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


seen = []


def train_step(xb, yb):
    seen.extend(yb.tolist())
    opt.zero_grad()
    loss = F.cross_entropy(model(xb.float()), yb.long() % 3)
    loss.backward()
    opt.step()
    return loss.detach()
""",
        parquet=True,
        after="assert sorted(seen) == list(range(600)), len(seen)",
    ),
    "ps-sync": Run(
        setup=_MODEL
        + """
Net = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
xs, ys = torch.randn(256, 8), torch.randint(0, 2, (256,))
batches = list(zip(xs.split(32), ys.split(32)))
""",
        after="strategy.close()",
        cluster=("--ps", "1", "--workers", "2"),
    ),
    "ps-config": Run(
        setup="import clusterflow as cf\n"
        "from clusterflow.strategies.parameter_server.config import ParameterServerConfig\n",
        after="strategy.close()",
        cluster=("--ps", "1", "--workers", "2"),
    ),
    "pipeline-fit": Run(
        setup=_MODEL + "x, y = torch.randn(512, 8), torch.randint(0, 2, (512,))\n",
        replace=(
            ("nn.Sequential(...)", "nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))"),
        ),
        after="assert all(p.isfinite().all() for p in model.parameters())",
        cluster=("--workers", "2"),
    ),
    "pipeline-device": Run(
        setup=_MODEL + "strategy = cf.PipelineStrategy(microbatches=2)\n",
        after="""
x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
cf.fit(model, nn.CrossEntropyLoss(), optimizer, (x, y), strategy=strategy, global_batch_size=8)
""",
        cluster=("--workers", "2"),
    ),
    "pipeline-placed": Run(
        setup=_MODEL,
        after="""
if cf.TFConfig.from_env().task.job != "worker":
    loss = F.cross_entropy(model(torch.randn(4, 64)), torch.randint(0, 10, (4,)))
    loss.backward()
    optimizer.step()
""",
    ),
    "tune-report": Run(
        setup="epochs, acc, loss = 2, 0.9, 0.1\n",
    ),
    "tune-run": Run(
        replace=(
            ("trials=20", "trials=2"),
            ('cluster={"workers": 2}', 'cluster={"workers": 1}'),
            ('command=["python",', f"command=[{sys.executable!r},"),
        ),
        after="assert code == 0, code",
        files={"train.py": _TRIAL},
        starts_clusters=True,
    ),
}
"""How each marked block runs, by the ID in its marker."""


def prepare(block: Block, folder: Path) -> None:
    """The files a marked block reads, written in the folder it runs in."""
    folder.mkdir(parents=True, exist_ok=True)
    run = run_of(block)
    for name, text in run.files.items():
        (folder / name).write_text(text, encoding="utf-8")
    if run.parquet:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        x = np.arange(1200, dtype=np.float32).reshape(600, 2)
        table = pa.table({"x": list(x), "y": np.arange(600, dtype=np.int64)})
        pq.write_table(table, folder / "train.parquet")
