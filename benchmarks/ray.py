"""Launch on Ray: start to both workers' first DDP step, on a 3-node Ray cluster.

``launch_vs_local``: ``clusterflow start --backend ray --workers 2`` on a three-node Ray
cluster / ``clusterflow start --workers 2`` (local processes), both running
``benchmarks/_ray_probe.py`` (imports torch, joins the process group, one DDP step, prints
``ready rank=R``). Timed from just before the CLI starts until both ranks' lines were read
from its output (``benchmarks.launch.trial``). Goal <= 1.5.

``launch_vs_raytrain``: the same script's start to first step under clusterflow on Ray /
under Ray Train's ``TorchTrainer`` (2 workers, the peer Ray users would pick). Goal <=
1.0. Needs ``ray[train]``; without it this figure is skipped with the reason printed.

The Ray cluster runs inside a network namespace made here (``ip netns``; needs root),
with only loopback up: Ray advertises the machine's primary address otherwise, and this
benchmark sends nothing beyond the machine. Its three nodes share this machine's cores,
so the figure is Ray's scheduling and the manager's round trips, not more hardware.
Rounds alternate the sides, in an order reversed each round (``_common.alternate``).

    python -m benchmarks.ray [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks._common import MachineLoad, Spread, alternate, parser, ratio, result
from benchmarks.launch import ROOT, trial

PROBE = str(ROOT / "benchmarks" / "_ray_probe.py")
PORT = 6379
ADDRESS = f"127.0.0.1:{PORT}"
BIN = Path(sys.executable).parent


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """A three-node Ray cluster in a network namespace of its own; yields the namespace.

    On exit every process in the namespace (all started here) is killed and the
    namespace deleted: not ``ray stop``, which kills every Ray process of the machine.
    """
    ns = f"ray-bench-{secrets.token_hex(3)}"
    root = Path(tempfile.mkdtemp(prefix="ray-b-"))
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        common = ["--num-cpus=2", "--object-store-memory=100000000", f"--temp-dir={root}"]
        common.append("--disable-usage-stats")
        nodes = [
            [
                "--head",
                f"--port={PORT}",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=false",
            ],
            [f"--address={ADDRESS}"],
            [f"--address={ADDRESS}"],
        ]
        for i, node in enumerate(nodes):
            cmd = ["ip", "netns", "exec", ns, str(BIN / "ray"), "start", *node, *common]
            cmd.append(f"--labels=node={i}")
            subprocess.run(cmd, check=True, capture_output=True, env=_env())
        yield ns
    finally:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
        )
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "RAY_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


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
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("benchmarks.ray needs root and iproute2 (it makes a network namespace)")
    rounds = args.rounds or (3 if args.quick else 7)
    load = MachineLoad()
    with ray_cluster() as ns, tempfile.TemporaryDirectory(prefix="clusterflow-bench-") as home:
        env = _env(CLUSTERFLOW_HOME=home, OMP_NUM_THREADS="1")
        run = ["ip", "netns", "exec", ns, str(BIN / "clusterflow"), "start", "--workers", "2"]
        sides = {
            "ray": functools.partial(
                trial,
                [
                    *run[:6],
                    "--backend",
                    "ray",
                    "--address",
                    ADDRESS,
                    *run[6:],
                    "--",
                    sys.executable,
                    PROBE,
                ],
                env,
            ),
            "local": functools.partial(trial, [*run, "--", sys.executable, PROBE], env),
        }
        missing = ray_train_missing()
        if missing is None:
            sides["raytrain"] = functools.partial(
                trial, ["ip", "netns", "exec", ns, sys.executable, "-c", RAY_TRAIN_SCRIPT], env
            )
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
