"""Launch on Ray: start to both workers' first DDP step, on a 3-node Ray cluster.

``launch_vs_local``: ``clusterflow start --backend ray --workers 2`` on a three-node Ray
cluster / ``clusterflow start --workers 2`` (local processes), both running
``benchmarks/ray/probe.py`` (imports torch, joins the process group, one DDP step, prints
``ready rank=R``). Timed from just before the CLI starts until both ranks' lines were read
from its output (``benchmarks.launch.trial``). Goal <= 1.5.

``launch_vs_raytrain``: the same script's start to first step under clusterflow on Ray /
under Ray Train's ``TorchTrainer`` (2 workers, the peer Ray users would pick). Needs
``ray[train]`` (in the ``[test]`` extra, as the README installs it); without it the
benchmark stops with one line saying so: the figure is never left out.

Goals (issue 28): ``launch_vs_local`` <= 1.1 and ``launch_vs_raytrain`` <= 0.4. Before the
rounds, ``clusterflow ray-agents start`` starts one clusterflow agent per node (once,
untimed, as the Ray nodes themselves are): a launch then starts no Ray worker, the
head's agent hosts the manager and each node's agent the supervisors
(``backends/ray_agent.py``). ``--no-agents`` measures launches without them (each one
starting an actor, so a Ray worker, for the manager and for every task).

``--verbose`` also prints where each clusterflow launch's time went, by phase: ``cli``
(the CLI's start, to its cluster folder), ``manager`` (joining Ray and starting the
manager, to its ``starting`` event), ``tasks`` (placing and starting every supervisor,
to ``spec_assembled``: all registered) and ``job`` (the job's torch import, rendezvous
and first step, to both ready lines).

The Ray cluster runs one node per emulated host (``clusterflow.testing.ray_nodes``:
network namespaces on a bridge, needs root), so its nodes have addresses of their own
and this benchmark sends nothing beyond the machine. The nodes share this machine's
cores, so the figure is Ray's scheduling and the manager's round trips, not more
hardware. Rounds alternate the sides, in an order reversed each round
(``common.alternate``).

    python -m benchmarks.ray [--quick] [--rounds N] [--verbose] [--no-agents]
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import MachineLoad, Spread, alternate, parser, ratio, result
from benchmarks.launch import ROOT, trial
from clusterflow.testing import available
from clusterflow.testing.ray_nodes import RayNodes

PROBE = str(ROOT / "benchmarks" / "ray" / "probe.py")
ADDRESS = "10.77.0.1:6379"
"""The head's address: host 0 of the emulated hosts."""


@contextlib.contextmanager
def ray_cluster() -> Iterator[RayNodes]:
    """A three-node Ray cluster, one node per emulated host (two CPUs each).

    On exit every process on the hosts (all started here) is killed and the hosts are
    removed: not ``ray stop``, which kills every Ray process of the machine.
    """
    # Every node tells gloo its interface, as clusterflow does for its own tasks
    # (backends/ray_backend.py): the host name resolves to loopback on the emulated hosts, and
    # Ray Train's workers would otherwise advertise 127.0.0.1 to each other.
    with RayNodes(3, prefix="raybench", node_env={"GLOO_SOCKET_IFNAME": "eth0"}) as nodes:
        assert nodes.address == ADDRESS
        nodes.start_head("--num-cpus=2", "--labels=node=0")
        for i in (1, 2):
            nodes.start_node(i, "--num-cpus=2", f"--labels=node={i}")
        yield nodes


RAY_TRAIN_SCRIPT = f"""
import os, runpy, sys
import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

ray.init(address={ADDRESS!r}, logging_level="ERROR")

def loop(config):
    # Ray Train has set up the process group's variables; run the same probe. RANK is
    # set, not defaulted: a worker process Ray reuses keeps the last trial's, and two
    # ranks then both said "ready rank=1" (a failed trial, 2026-11-28).
    os.environ["RANK"] = str(ray.train.get_context().get_world_rank())
    sys.argv = [{PROBE!r}]
    runpy.run_path({PROBE!r}, run_name="__main__")

TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2)).fit()
"""


PHASES = ("cli", "manager", "tasks", "job")
"""A clusterflow launch's phases (module docstring), each up to the next mark."""


def ray_train_missing() -> str | None:
    """Why Ray Train cannot run here, or None."""
    try:
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        return f"ray[train] is not installed ({exc})"
    return None


def timed(side: Callable[[], float], marks: list[tuple[float, float]]) -> Callable[[], float]:
    """``side``, recording each trial's (launch, ready) wall-clock times into ``marks``."""

    def run() -> float:
        wall = time.time()
        took = side()
        marks.append((wall, wall + took))
        return took

    return run


def phases(home: Path, marks: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, Any]]:
    """Each clusterflow side's phases (``PHASES``, seconds per trial), from its clusters'
    folders: one cluster per trial, the untimed first one too, in launch order."""
    by_backend: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for folder in (home / "clusters").iterdir():
        state = json.loads((folder / "state.json").read_text())
        events: dict[str, float] = {}
        with contextlib.suppress(OSError):
            for line in (folder / "events.jsonl").read_text().splitlines():
                record = json.loads(line)
                events.setdefault(record["event"], float(record["time"]))
        by_backend.setdefault(state.get("backend") or "local", []).append(
            (float(state["created"]), events)
        )
    out: dict[str, dict[str, Any]] = {}
    for side, backend in (("ray", "ray"), ("local", "local")):
        clusters = sorted(by_backend.get(backend, []), key=lambda c: c[0])
        spent: dict[str, list[float]] = {name: [] for name in PHASES}
        for (launched, ready), (created, events) in zip(marks[side], clusters, strict=False):
            if "starting" not in events or "spec_assembled" not in events:
                continue  # a mirror the trial's end cut short
            points = [launched, created, events["starting"], events["spec_assembled"], ready]
            for name, begin, end in zip(PHASES, points, points[1:], strict=False):
                spent[name].append(end - begin)
        out[side] = {name: Spread.of(v) for name, v in spent.items() if v}
    return out


def main() -> None:
    arguments = parser("ray", __doc__)
    arguments.add_argument(
        "--no-agents",
        action="store_true",
        help="launch without per-node agents (a Ray worker per manager and per task)",
    )
    args = arguments.parse_args()
    if not available():
        raise SystemExit("benchmarks.ray needs root and iproute2 (it makes emulated hosts)")
    missing = ray_train_missing()
    if missing is not None:
        raise SystemExit(
            f"benchmarks.ray needs Ray Train for launch_vs_raytrain: {missing}; install the "
            "[test] extra as the README does (pip install -c ci/constraints.txt -e '.[test]')"
        )
    rounds = args.rounds or (3 if args.quick else 7)
    load = MachineLoad()
    with ray_cluster() as nodes, tempfile.TemporaryDirectory(prefix="clusterflow-bench-") as home:
        env = nodes.env(CLUSTERFLOW_HOME=home, OMP_NUM_THREADS="1")
        clusterflow = str(nodes.bin / "clusterflow")
        if not args.no_agents:
            agents = nodes.head.run(
                [clusterflow, "ray-agents", "start", "--address", ADDRESS],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            if agents.returncode != 0:
                raise SystemExit(f"clusterflow ray-agents start failed: {agents.stderr[-2000:]}")
        cli = nodes.head.argv([clusterflow, "start", "--workers", "2"])
        ray = [*cli, "--backend", "ray", "--address", ADDRESS]
        marks: dict[str, list[tuple[float, float]]] = {"ray": [], "local": []}
        sides: dict[str, Callable[[], float]] = {
            "ray": timed(
                functools.partial(trial, [*ray, "--", sys.executable, PROBE], env), marks["ray"]
            ),
            "local": timed(
                functools.partial(trial, [*cli, "--", sys.executable, PROBE], env), marks["local"]
            ),
            "raytrain": functools.partial(
                trial, nodes.head.argv([sys.executable, "-c", RAY_TRAIN_SCRIPT]), env
            ),
        }
        started = time.monotonic()
        times = alternate(sides, rounds, verbose=args.verbose)
        if args.verbose:
            for side, spent in phases(Path(home), marks).items():
                shown = ", ".join(f"{name} {spread}" for name, spread in spent.items())
                print(f"{side} launch by phase, seconds: {shown}")
    medians = {name: f"{Spread.of(t).median:.2f} s" for name, t in times.items()}
    agents_said = "without agents" if args.no_agents else "with agents"
    print(
        f"median of {rounds} rounds ({time.monotonic() - started:.0f} s, {agents_said}): {medians}"
    )
    print(load.describe(), flush=True)
    result(
        "ray",
        launch_vs_local=ratio(times["ray"], times["local"]),
        launch_vs_raytrain=ratio(times["ray"], times["raytrain"]),
    )


if __name__ == "__main__":
    main()
