"""Which GPUs a task's replicas use: those best connected, from ``nvidia-smi topo -m``.

A task with ``--replicas-per-host N`` runs one process per device. Its all-reduce is as
fast as the slowest link between its devices, so of the GPUs the task may use (Ray's
assignment, or ``CUDA_VISIBLE_DEVICES``, or every GPU of the machine), it takes the N
whose weakest pairwise link is best (an NVLink before a shared PCIe switch before a
host bridge before a cross-socket hop), then the most links of that kind, then the
lowest ids, and gives replica ``i`` the ``i``-th of them as its only visible device.
The supervisor does this for both backends, so a task chooses alike wherever it runs.

Between tasks: Ray gives each task its own GPUs. On the local backend every task sees
the whole machine, so the manager splits the machine's GPUs first (``split``): each
chief and worker task gets as many as it runs replicas, task by task, each the best
connected group of what is left, as its ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from clusterflow.cluster.contract import CUDA_VISIBLE_DEVICES

log = logging.getLogger(__name__)

LINK_SCORE = {"PIX": 50, "PXB": 40, "PHB": 30, "NODE": 20, "SYS": 10, "SOC": 10}
"""How good a link is (``nvidia-smi topo -m`` legend); NVLink ``NV<k>`` scores 100 + k."""
NVIDIA_SMI_DEADLINE_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

Topology = dict[tuple[int, int], str]
"""The link between two GPUs by their ids, as ``nvidia-smi topo -m`` names it."""


def parse_topology(text: str) -> Topology:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``'s matrix (NICs and affinities left out).

    Raises:
        ValueError: the text holds no GPU matrix.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines() if line.strip()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        raise ValueError("no GPU matrix in the nvidia-smi topo -m output")
    columns = [int(name[3:]) for name in itertools.takewhile(_is_gpu, header)]
    links: Topology = {}
    for line in lines:
        cells = line.split()
        if not cells or not _is_gpu(cells[0]) or cells == header:
            continue
        row = int(cells[0][3:])
        for column, link in zip(columns, cells[1 : 1 + len(columns)], strict=False):
            if column != row:
                links[(row, column)] = link
    if not links and len(columns) > 1:
        raise ValueError("the GPU matrix of nvidia-smi topo -m has no rows")
    return links


def _is_gpu(name: str) -> bool:
    return re.fullmatch(r"GPU\d+", name) is not None


def link_score(link: str) -> int:
    if link.startswith("NV") and link[2:].isdigit():
        return 100 + int(link[2:])
    return LINK_SCORE.get(link, 0)


def choose(topology: Mapping[tuple[int, int], str], visible: Sequence[int], n: int) -> list[int]:
    """The ``n`` of ``visible`` GPUs best connected among themselves (see the module doc).

    Raises:
        ValueError: fewer than ``n`` GPUs are visible.
    """
    if n > len(visible):
        raise ValueError(f"{n} GPUs wanted, {len(visible)} visible")
    best: tuple[int, int, list[int]] | None = None
    for group in itertools.combinations(sorted(visible), n):
        scores = [link_score(topology.get((a, b), "")) for a, b in itertools.combinations(group, 2)]
        key = (min(scores, default=0), sum(scores))
        if best is None or key > best[:2]:
            best = (*key, list(group))
    assert best is not None
    return best[2]


def visible_gpus(env: Mapping[str, str], topology: Topology | None) -> list[int] | None:
    """The GPUs a process may use: ``CUDA_VISIBLE_DEVICES`` (ids), else every GPU in
    ``topology``; None when unknown (no GPUs, or GPUs named by UUID)."""
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is None:
        return sorted({a for a, _ in topology} | {0}) if topology else None
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names or not all(name.isdigit() for name in names):
        return None
    return [int(name) for name in names]


def split(
    topology: Topology | None, visible: Sequence[int], wants: Sequence[int]
) -> list[list[int]]:
    """Disjoint GPUs for tasks that want ``wants[i]`` each, in order: each takes the best
    connected group (``choose``) of the GPUs the tasks before it left.

    Raises:
        ValueError: the tasks want more GPUs than ``visible`` has.
    """
    if sum(wants) > len(visible):
        raise ValueError(f"{sum(wants)} GPUs wanted, {len(visible)} visible")
    left = list(visible)
    out = []
    for n in wants:
        chosen = choose(topology or {}, left, n) if n else []
        left = [gpu for gpu in left if gpu not in chosen]
        out.append(chosen)
    return out


def read_topology() -> Topology | None:
    """This machine's matrix from ``nvidia-smi topo -m``; None without nvidia-smi or GPUs."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "topo", "-m"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_DEADLINE_S,
            check=True,
        )
        return parse_topology(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("cannot read the GPU topology (nvidia-smi topo -m): %s", exc)
        return None


def replica_devices(
    env: Mapping[str, str], replicas: int, topology: Topology | None
) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` for each replica, or None to leave every replica's as is.

    The GPUs to choose from are the task's visible ones (``CUDA_VISIBLE_DEVICES``, as Ray
    sets it for the task's GPUs) or, when that is unset, every GPU in ``topology``. When
    there are fewer than ``replicas`` of them, or they are named by UUID, nothing is
    changed (replicas then share their devices, as before).
    """
    visible = visible_gpus(env, topology)
    if visible is None or replicas < 2 or len(visible) < replicas:
        return None
    chosen = choose(topology or {}, visible, replicas)
    return [str(gpu) for gpu in chosen]
