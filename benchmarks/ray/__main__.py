"""Launch on Ray: start to both workers' first DDP step, on a 3-node Ray cluster.

``launch_vs_local``: ``clusterflow start --backend ray --workers 2`` on a three-node Ray
cluster / ``clusterflow start --workers 2`` (local processes), both running
``benchmarks/ray/probe.py`` (imports torch, joins the process group, one DDP step, prints
``ready rank=R``). Timed from just before the CLI starts until both ranks' lines were read
from its output (``benchmarks.launch.trial``). Goal <= 1.5.

``launch_vs_raytrain``: the same script's start to first step under clusterflow on Ray /
under Ray Train's ``TorchTrainer`` (2 workers, the peer Ray users would pick). Goal <=
1.0. Needs ``ray[train]``; without it this figure is skipped with the reason printed.

The Ray cluster runs one node per emulated host (``clusterflow.testing.ray_nodes``:
network namespaces on a bridge, needs root), so its nodes have addresses of their own
and this benchmark sends nothing beyond the machine. The nodes share this machine's
cores, so the figure is Ray's scheduling and the manager's round trips, not more
hardware. Rounds alternate the sides, in an order reversed each round
(``common.alternate``).

    python -m benchmarks.ray [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
import time
from collections.abc import Iterator

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
    # Ray Train has set up the process group's variables; run the same probe.
    os.environ.setdefault("RANK", str(ray.train.get_context().get_world_rank()))
    sys.argv = [{PROBE!r}]
    runpy.run_path({PROBE!r}, run_name="__main__")

TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2)).fit()
"""


def ray_train_missing() -> str | None:
    """Why Ray Train cannot run here, or None."""
    try:
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        return f"ray[train] is not installed ({exc})"
    return None


def main() -> None:
    args = parser("ray", __doc__).parse_args()
    if not available():
        raise SystemExit("benchmarks.ray needs root and iproute2 (it makes emulated hosts)")
    rounds = args.rounds or (3 if args.quick else 7)
    load = MachineLoad()
    with ray_cluster() as nodes, tempfile.TemporaryDirectory(prefix="clusterflow-bench-") as home:
        env = nodes.env(CLUSTERFLOW_HOME=home, OMP_NUM_THREADS="1")
        cli = nodes.head.argv([str(nodes.bin / "clusterflow"), "start", "--workers", "2"])
        ray = [*cli, "--backend", "ray", "--address", ADDRESS]
        sides = {
            "ray": functools.partial(trial, [*ray, "--", sys.executable, PROBE], env),
            "local": functools.partial(trial, [*cli, "--", sys.executable, PROBE], env),
        }
        missing = ray_train_missing()
        if missing is None:
            driver = nodes.head.argv([sys.executable, "-c", RAY_TRAIN_SCRIPT])
            sides["raytrain"] = functools.partial(trial, driver, env)
        else:
            print(f"launch_vs_raytrain skipped: {missing}", flush=True)
        started = time.monotonic()
        times = alternate(sides, rounds, verbose=args.verbose)
    medians = {name: f"{Spread.of(t).median:.2f} s" for name, t in times.items()}
    print(f"median of {rounds} rounds ({time.monotonic() - started:.0f} s): {medians}")
    print(load.describe(), flush=True)
    figures: dict[str, Spread] = {"launch_vs_local": ratio(times["ray"], times["local"])}
    if "raytrain" in times:
        figures["launch_vs_raytrain"] = ratio(times["ray"], times["raytrain"])
    result("ray", **figures)


if __name__ == "__main__":
    main()
