"""TensorFlow's ParameterServerStrategy on the scale harness: the peer of the async ps rows.

The same emulated hosts, links and model as ``hosts`` (8 square layers of
``WIDTH``, 10 Gbit/s scaled by ``SCALE``, 0.3 s of emulated compute a step), run as
TensorFlow users run it: a chief holding a ``ClusterCoordinator``, ``n`` workers and 8
ps tasks (TensorFlow places the 8 variables round-robin, one per ps, as 8 shards of the
async ps hold them), each a ``tf.distribute.Server`` in its own host, ``TF_CONFIG``
naming the hosts' addresses. The chief's own host is a further one, so its calls cross
a link as well.

- **Compute is emulated as on the other rows**: each step first takes its batch from a
  per-worker dataset that sleeps 0.3 s per element (``SleepDataset``, prefetching and
  autotuning off, so the sleep is inside the step, on the worker, using no CPU), then
  runs the forward and backward pass of the small model and applies SGD on the ps
  (``assign_sub``): TensorFlow's custom training loop, whose every variable read and
  update is a remote op on its ps. TensorFlow overlaps nothing of a step with the next,
  where the async ps overlaps its push and pull with the next step's compute.
- **Windows**: the chief schedules one step per worker untimed, then ``rounds`` windows
  of ``steps`` steps per worker (``coordinator.join()`` ends each); per-worker steps/s
  is the window's steps over its time over ``n``. These run after the clusterflow rows,
  in the same run, not alternated with them (TensorFlow needs its own processes).

TensorFlow lives in a Python of its own (docs/benchmarks.md has the recipe); the
benchmark finds it through ``--tf-python``, ``CLUSTERFLOW_TF_PYTHON`` or its own
interpreter, and installs nothing.

    python -m benchmarks.scale.tf_peer server          # in a host: TF_CONFIG names the task
    python -m benchmarks.scale.tf_peer chief STEPS ROUNDS COMPUTE_S LAYERS WIDTH  # one JSON line

The hosts' roles import only the standard library and TensorFlow: TensorFlow's Python
need not have clusterflow installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.common import Spread

REPO = Path(__file__).resolve().parents[2]
ENV_PYTHON = "CLUSTERFLOW_TF_PYTHON"
PS_TASKS = 8
"""One ps per variable, as the async ps's 8 shards."""
BATCH = 16
CHIEF_TIMEOUT_S = 600.0


class TensorFlowMissing(LookupError):
    """No Python with TensorFlow was named or found."""


def find_python(explicit: str | None) -> str:
    """The interpreter that has TensorFlow: ``explicit``, the environment's, or this one.

    Raises:
        TensorFlowMissing: none is named and this interpreter has no TensorFlow.
        SystemExit: a named interpreter does not exist (one line naming it).
    """
    named = explicit or os.environ.get(ENV_PYTHON)
    if named:
        if not (Path(named).is_file() and os.access(named, os.X_OK)):
            where = "--tf-python" if explicit else ENV_PYTHON
            raise SystemExit(f"{where}: {named!r} is not an executable Python")
        return named
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    raise TensorFlowMissing(
        f"TensorFlow is not installed here; name a Python that has it with --tf-python "
        f"or {ENV_PYTHON}"
    )


def measure(
    sizes: list[int], steps: int, rounds: int, python: str, verbose: bool
) -> dict[int, Spread]:
    """Per-worker steps/s of TensorFlow's ParameterServerStrategy at each size."""
    from benchmarks.common import Spread
    from benchmarks.scale.hosts import COMPUTE_S, LAYERS, LINK_BIT, SCALE, WIDTH
    from clusterflow.testing import EmulatedHosts, LinkShape

    out: dict[int, Spread] = {}
    for n in sizes:
        started = time.perf_counter()
        shape = LinkShape(rate_bit=LINK_BIT // SCALE)
        with EmulatedHosts(1 + n + PS_TASKS, shape, prefix="cftf") as hosts:
            chief, workers, ps = hosts[0], hosts[1 : 1 + n], hosts[1 + n :]
            port = 22000
            cluster = {
                "chief": [f"{chief.address}:{port}"],
                "worker": [f"{h.address}:{port}" for h in workers],
                "ps": [f"{h.address}:{port}" for h in ps],
            }
            servers = [
                _start(h, python, cluster, job, i, ["server"])
                for job, group in (("worker", workers), ("ps", ps))
                for i, h in enumerate(group)
            ]
            try:
                run = _start(
                    chief,
                    python,
                    cluster,
                    "chief",
                    0,
                    ["chief", str(steps), str(rounds), str(COMPUTE_S), str(LAYERS), str(WIDTH)],
                    capture=True,
                )
                try:
                    stdout, stderr = run.communicate(timeout=CHIEF_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    run.kill()
                    raise SystemExit(
                        f"benchmark failed: TensorFlow's chief at {n} workers did not finish "
                        f"in {CHIEF_TIMEOUT_S:g} s"
                    ) from None
                rates = _parse(stdout, stderr, n)
            finally:
                for proc in servers:
                    proc.kill()
                for proc in servers:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(10)
        out[n] = Spread.of(rates)
        spent = time.perf_counter() - started
        detail = f" (rounds {', '.join(f'{r:.3f}' for r in rates)})" if verbose else ""
        print(
            f"TensorFlow ParameterServerStrategy, {n} workers, {PS_TASKS} ps ({spent:.0f} s): "
            f"{out[n].median:.2f} steps/s per worker{detail}",
            flush=True,
        )
    return out


def _start(
    host: Any,
    python: str,
    cluster: dict[str, list[str]],
    job: str,
    index: int,
    args: list[str],
    *,
    capture: bool = False,
) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    pipe = subprocess.PIPE if capture else subprocess.DEVNULL
    return host.popen(  # type: ignore[no-any-return]
        [python, "-m", "benchmarks.scale.tf_peer", *args],
        stdout=pipe,
        stderr=pipe,
        text=True,
        cwd=REPO,
        env=env,
    )


def _parse(stdout: str, stderr: str, n: int) -> list[float]:
    for line in stdout.splitlines():
        if line.startswith("@@ "):
            return [float(r) for r in json.loads(line[3:])["rates"]]
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    raise SystemExit(f"benchmark failed: TensorFlow's chief at {n} workers: {tail}")


# In the hosts (TensorFlow's Python) ----------------------------------------------------


def _server() -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()


def _chief(steps: int, rounds: int, compute_s: float, layers: int, width: int) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    workers = len(resolver.cluster_spec().as_dict()["worker"])
    with strategy.scope():
        weights = [
            tf.Variable(tf.random.normal([width, width], stddev=0.05, seed=i))
            for i in range(layers)
        ]

    def dataset_fn() -> Any:
        x = tf.random.normal([BATCH, width], seed=1)
        y = tf.random.normal([BATCH, width], seed=2)
        batches = tf.data.Dataset.from_tensors((x, y)).repeat()
        slept = tf.raw_ops.SleepDataset(  # the emulated compute: a wait, not CPU
            input_dataset=batches._variant_tensor,
            sleep_microseconds=int(compute_s * 1e6),
            output_types=[tf.float32, tf.float32],
            output_shapes=[[BATCH, width], [BATCH, width]],
        )
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        options.autotune.enabled = False
        dataset = tf.data.experimental.from_variant(slept, batches.element_spec)
        return dataset.with_options(options)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(batches: Any) -> Any:
        x, y = next(batches)
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.matmul(h, w)
            loss = tf.reduce_mean(tf.square(h - y))
        for w, g in zip(weights, tape.gradient(loss, weights), strict=True):
            w.assign_sub(1e-3 * g)
        return loss

    for _ in range(workers):  # untimed: connections, the datasets, tracing
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps * workers):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        rates.append(steps / (time.perf_counter() - start))
    print("@@ " + json.dumps({"rates": rates}), flush=True)
    os._exit(0)  # the coordinator's threads would wait for the servers


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "server":
        _server()
    elif role == "chief" and len(sys.argv) == 7:
        steps, rounds, compute_s, layers, width = sys.argv[2:]
        _chief(int(steps), int(rounds), float(compute_s), int(layers), int(width))
    else:
        raise SystemExit(
            "usage: python -m benchmarks.scale.tf_peer server | chief STEPS ROUNDS S LAYERS WIDTH"
        )


if __name__ == "__main__":
    main()
