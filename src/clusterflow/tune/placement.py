"""How many trials run at once: as many whole trial clusters as the machine (or the Ray
cluster) holds, and never more than ``--parallel``.

A trial's cluster is counted whole, by what each of its tasks takes:

* **local**: a core per tracked process (chief and worker replicas; a ps or an
  untracked job mostly waits); memory, as the platform sizes a task it never measured
  (``manager.memory_sizing.ESTIMATE`` per process, the first request of a task on Ray),
  against the memory free when the study starts; and, on a machine with GPUs, a GPU per
  replica of each chief/worker task that runs several (``--replicas-per-host``), else
  one: each running trial's manager is given GPUs of its own (``CUDA_VISIBLE_DEVICES``),
  never another trial's.
* **Ray**: each task's placement-group bundle, as ``start --backend ray`` asks for it
  (CPU, GPU, memory sized as ``--memory`` says, custom resources, node labels), packed
  onto the Ray cluster's nodes by their total resources: Ray places a cluster whole or
  not at all, so trials beyond what the nodes hold would only wait for a placement.

A trial that does not fit even alone is bad input: one line, naming what is missing.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterflow.backends import kinds
from clusterflow.cluster.contract import CUDA_VISIBLE_DEVICES
from clusterflow.errors import ConfigError
from clusterflow.manager.config import RunConfig

log = logging.getLogger(__name__)

NVIDIA_SMI_DEADLINE_S = 10.0
GPU_JOBS = ("chief", "worker")
"""Jobs whose replicas each take a device (``--replicas-per-host``)."""


@dataclass(frozen=True, slots=True)
class Fit:
    """How many trials run at once, and why no more, in words for the CLI."""

    trials: int
    why: str


def _number(name: str, value: float) -> str:
    if name == "memory":
        return f"{value / 2**30:.3g}G"
    return f"{value:g}"


def _describe(needs: Mapping[str, float]) -> str:
    return ",".join(f"{k}={_number(k, v)}" for k, v in needs.items() if v)


# local -------------------------------------------------------------------------------


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs the tuner may hand out: its ``CUDA_VISIBLE_DEVICES``, else every GPU
    ``nvidia-smi -L`` lists; none on a machine without them."""
    env = os.environ if environ is None else environ
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is not None:
        return [name.strip() for name in raw.split(",") if name.strip() and name.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_DEADLINE_S,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot list the GPUs (nvidia-smi -L): %s", exc)
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def gpus_per_trial(config: RunConfig) -> int:
    """GPUs one local trial takes on a machine with GPUs: one per replica of each task
    that runs several (``--replicas-per-host``: the local manager gives each such task
    GPUs of its own), else one, which its lone-process tasks share."""
    if CUDA_VISIBLE_DEVICES in config.env:
        return 0  # the trial's own settings name its GPUs: the user placed it
    tasks = [t for t in config.tasks() if t.job in GPU_JOBS]
    return max(1, sum(n for t in tasks if (n := config.replicas_of(t)) > 1)) if tasks else 0


def local_needs(config: RunConfig, *, gpus: bool) -> dict[str, float]:
    """What one trial's cluster takes of this machine (``gpus``: the machine has some)."""
    from clusterflow.manager.memory_sizing import ESTIMATE

    processes = [config.replicas_of(t) for t in config.tasks()]
    cores = sum(config.replicas_of(t) for t in config.tasks() if config.is_tracked(t))
    return {
        "CPU": float(max(1, cores)),
        "memory": ESTIMATE * sum(processes),
        "GPU": float(gpus_per_trial(config)) if gpus else 0.0,
    }


def fit_local(needs: Mapping[str, float], have: Mapping[str, float], parallel: int) -> Fit:
    """Trials of ``needs`` that ``have`` holds at once (at most ``parallel``)."""
    count, bound = parallel, ""
    for name, need in needs.items():
        if not need:
            continue
        held = math.floor(have.get(name, 0.0) / need + 1e-9)
        if held < 1:
            raise ConfigError(
                f"a trial's cluster needs {name}={_number(name, need)} and this machine has "
                f"{_number(name, have.get(name, 0.0))}"
            )
        if held < count:
            count, bound = held, f"this machine has {name}={_number(name, have[name])}"
    return Fit(count, f"{bound or '--parallel'}; a trial takes {_describe(needs)}")


def machine() -> dict[str, float]:
    """This machine's cores, free memory and GPUs (those the tuner may hand out)."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "CPU": float(cores or 1),
        "memory": float(psutil.virtual_memory().available),
        "GPU": float(len(visible_gpus())),
    }


# Ray ---------------------------------------------------------------------------------


def _fits(bundle: Mapping[str, float], labels: Mapping[str, str], node: dict[str, Any]) -> bool:
    from clusterflow.backends.ray_placement import label_matches

    if not label_matches(labels, node["Labels"]):
        return False
    return all(node["Resources"].get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def fit_ray(requests: Sequence[Any], nodes: Sequence[Mapping[str, Any]], parallel: int) -> Fit:
    """Whole trials (``requests``: one ``TaskRequest`` per task) that the live ``nodes``
    (``ray.nodes()``) hold at once, packed first-fit, largest bundle first."""
    from clusterflow.backends.ray_placement import unplaceable

    reason = unplaceable(requests, nodes)
    if reason:
        raise ConfigError(f"a trial's cluster cannot be placed: {reason}")
    free = [
        {"Labels": dict(n.get("Labels") or {}), "Resources": dict(n.get("Resources") or {})}
        for n in nodes
        if n.get("Alive")
    ]
    order = sorted(
        requests,
        key=lambda r: tuple(-r.bundle().get(k, 0.0) for k in ("GPU", "CPU", "memory")),
    )
    count = 0
    while count < parallel:
        for request in order:
            bundle = request.bundle()
            node = next((n for n in free if _fits(bundle, request.labels, n)), None)
            if node is None:
                total = _sum(requests)
                if count == 0:
                    raise ConfigError(
                        f"a trial's cluster cannot be placed: it takes {_describe(total)} "
                        "at once, more than the Ray cluster's nodes hold together"
                    )
                why = f"the Ray cluster's nodes hold no more; a trial takes {_describe(total)}"
                return Fit(count, why)
            for name, value in bundle.items():
                node["Resources"][name] = node["Resources"].get(name, 0.0) - value
        count += 1
    return Fit(count, "--parallel")


def _sum(requests: Sequence[Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for request in requests:
        for name, value in request.bundle().items():
            total[name] = total.get(name, 0.0) + value
    return total


def ray_requests(config: RunConfig) -> list[Any]:
    """One trial's ``TaskRequest``\\ s, its memory sized as ``start --backend ray`` sizes it."""
    from clusterflow.manager.memory_sizing import size
    from clusterflow.manager.ray_host import task_requests

    sized, automatic = size(config)
    return task_requests(sized, automatic)


def ray_nodes(config: RunConfig) -> list[dict[str, Any]]:
    """The Ray cluster's nodes (joining it as ``start --backend ray`` does)."""
    from clusterflow.manager.ray_host import connect

    connect(config.address, config.job_dir)
    import ray

    return list(ray.nodes())


def trials_at_once(config: RunConfig, parallel: int) -> Fit:
    """How many trials of ``config`` run at once (see the module's docstring)."""
    if kinds.named(config.backend).placed_by_ray:
        return fit_ray(ray_requests(config), ray_nodes(config), parallel)
    have = machine()
    return fit_local(local_needs(config, gpus=have["GPU"] > 0), have, parallel)
