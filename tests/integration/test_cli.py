"""``clusterflow start/ps/describe/logs/attach/stop`` end to end, with real local clusters.

Each test writes its job scripts into its own folder and runs the CLI as a subprocess;
the ``cf`` fixture (conftest.py) stops every cluster a test started and fails the test
if any process of one is left.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from clusterflow.cluster.contract import ENV_WARM_FORK

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = pytest.mark.integration

PY = sys.executable

DDP_SCRIPT = """\
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.nn  # before the group forms, so it holds none (examples/digits_ddp.py)
from torch import nn

dist.init_process_group("gloo")  # everything from the environment: RANK, MASTER_PORT...
rank = dist.get_rank()
torch.manual_seed(rank)  # each rank builds different weights; DDP must broadcast rank 0's
model = nn.Linear(4, 2)
initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100 + rank)  # rank-dependent batches
for _ in range(3):
    x = torch.randn(8, 4, generator=data)
    loss = (ddp(x) - 1.0).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
final = {k: v.detach().clone() for k, v in model.state_dict().items()}
torch.save({"initial": initial, "final": final}, os.path.join(sys.argv[1], f"rank{rank}.pt"))
print(f"rank {rank} of {dist.get_world_size()} done")
del ddp, opt, loss  # first: DDP's reducer would free the group from C++, holding the GIL
group = dist.group.WORLD
dist.destroy_process_group()
del group  # the last reference: freed here, with its threads joined
"""

ENV_SCRIPT = """\
import json, os, sys, time

out, mode = sys.argv[1], sys.argv[2]
task = os.environ["CLUSTERFLOW_TASK"]
job = task.split(":")[0]
keys = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT")
record = {"env": {k: v for k, v in os.environ.items()
                  if k in keys or k.startswith("CLUSTERFLOW_")}}
if mode == "ping" and job == "chief":
    # Proves the ps task serves clusterflow's built-in server at its spec address.
    from clusterflow.rpc import Credentials, RpcClient
    ps = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
    with RpcClient(ps, Credentials.from_env(), deadline=60) as client:
        record["ps_ping"] = client.call("health.ping").body
name = os.path.join(out, task.replace(":", "-") + ".json")
with open(name + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(name + ".tmp", name)
print("wrote", task)
if mode == "wait":
    if job == "chief":  # ends the run once every task has written its file
        while len(os.listdir(out)) < 4:
            time.sleep(0.05)
    else:  # would never end by itself
        while True:
            time.sleep(1)
"""

OUTPUT_SCRIPT = """\
import os, sys
task = os.environ["CLUSTERFLOW_TASK"]
for i in range(3):
    print(f"line {i} from {task}")
print(f"stderr of {task}", file=sys.stderr)
sys.stdout.write(f"no newline from {task}")
"""

FAIL_SCRIPT = """\
import os, sys, time
if os.environ["CLUSTERFLOW_TASK"] == "worker:1":
    print("worker 1 fails")
    sys.exit(3)
print("ready")
while True:
    time.sleep(1)
"""

GATED_SCRIPT = """\
import os, sys, time
task = os.environ["CLUSTERFLOW_TASK"]
print(f"ready {task}")  # no flush: PYTHONUNBUFFERED must carry it while we wait
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print(f"final {task}")
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


BACKGROUND_SCRIPT = """\
import subprocess, sys
# A background process that would outlive the job, holding the job's output pipe.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("started", child.pid)
"""

SLOW_REGISTRATION = """\
# Holds one task's supervisor before it registers, until the test lets it go.
import os, time
if os.environ.get("CLUSTERFLOW_TASK") == "worker:1" and "TF_CONFIG" not in os.environ:
    while not os.path.exists(os.environ["TEST_RELEASE_FILE"]):
        time.sleep(0.05)
"""


def _task_states(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["task"]: t for t in state["tasks"]}


def _statuses(ps_output: str) -> dict[str, str]:
    """``{id: status}`` from the table ``clusterflow ps`` prints."""
    rows = [line.split() for line in ps_output.splitlines()[1:] if line.strip()]
    return {row[0]: row[1] for row in rows}


# 1. PyTorch DDP ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_unmodified_ddp_script_trains_in_sync(cf: Clusterflow) -> None:
    import torch

    script = cf.script("ddp.py", DDP_SCRIPT)
    out = cf.workdir / "params"
    out.mkdir()

    done = cf.run("start", "--workers", "2", "--", PY, str(script), str(out), timeout=170)

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "[worker:0] rank 0 of 2 done" in lines
    assert "[worker:1] rank 1 of 2 done" in lines
    saved = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    # The ranks started from different weights and saw different data ...
    assert not torch.equal(saved[0]["initial"]["weight"], saved[1]["initial"]["weight"])
    for name in ("weight", "bias"):
        # ... yet end identical: DDP broadcast rank 0's weights and averaged gradients.
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name])
        # And training moved them.
        assert not torch.equal(saved[0]["final"][name], saved[0]["initial"][name])
    assert cf.state(cf.only_id())["status"] == "succeeded"


# 2. The cluster spec and the environment of each task ------------------------------------


def _read_records(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem.replace("-", ":"): json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.timeout(90)
def test_chief_ps_workers_get_spec_and_environment(cf: Clusterflow) -> None:
    script = cf.script("env.py", ENV_SCRIPT)
    out = cf.workdir / "env"
    out.mkdir()

    done = cf.run(
        "start", "--chief", "--ps", "1", "--workers", "2", "--", PY, str(script), str(out), "ping"
    )

    assert done.returncode == 0, done.stdout + done.stderr
    cluster_id = cf.only_id()
    records = _read_records(out)
    # The ps task ran the built-in server, not the job command.
    assert sorted(records) == ["chief:0", "worker:0", "worker:1"]
    configs = {task: json.loads(r["env"]["TF_CONFIG"]) for task, r in records.items()}
    cluster = configs["chief:0"]["cluster"]
    assert {job: len(addrs) for job, addrs in cluster.items()} == {
        "chief": 1,
        "ps": 1,
        "worker": 2,
    }
    addresses = [a for addrs in cluster.values() for a in addrs]
    assert len(set(addresses)) == 4
    for address in addresses:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert all(c["cluster"] == cluster for c in configs.values())
    # Byte for byte what TensorFlow's launchers write: compact JSON, jobs sorted, the
    # cluster before the task, the index a JSON integer.
    jobs = ",".join(
        f'"{job}":[' + ",".join(f'"{a}"' for a in cluster[job]) + "]" for job in sorted(cluster)
    )
    for task, record in records.items():
        job, index = task.split(":")
        expected = f'{{"cluster":{{{jobs}}},"task":{{"type":"{job}","index":{index}}}}}'
        assert record["env"]["TF_CONFIG"] == expected
    ranks = {"chief:0": 0, "worker:0": 1, "worker:1": 2}
    master_ports = set()
    for task, record in records.items():
        env = record["env"]
        job, index = task.split(":")
        assert configs[task]["task"] == {"type": job, "index": int(index)}
        assert env["CLUSTERFLOW_TASK"] == task
        assert env["CLUSTERFLOW_JOB"] == job
        assert env["CLUSTERFLOW_TASK_INDEX"] == index
        assert env["CLUSTERFLOW_CLUSTER_ID"] == cluster_id
        assert env["RANK"] == env["LOCAL_RANK"] == str(ranks[task])
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        master_ports.add(env["MASTER_PORT"])
    (master_port,) = master_ports
    assert f"127.0.0.1:{master_port}" not in addresses
    assert records["chief:0"]["ps_ping"]["task"] == "ps:0"

    state = cf.state(cluster_id)
    assert state["status"] == "succeeded" and state["exit_code"] == 0
    tasks = _task_states(state)
    assert tasks["ps:0"]["tracked"] is False
    assert tasks["ps:0"]["status"] == "stopped"  # stopped once the tracked tasks were done
    for task in ranks:
        assert tasks[task]["exit_code"] == 0
    assert not cf.live(cluster_id)


@pytest.mark.timeout(90)
def test_ps_cmd_and_untracked_workers_end_with_the_chief(cf: Clusterflow) -> None:
    script = cf.script("env.py", ENV_SCRIPT)
    out = cf.workdir / "env"
    out.mkdir()
    command = [PY, str(script), str(out), "wait"]

    done = cf.run(
        "start",
        "--chief",
        "--ps",
        "1",
        "--workers",
        "2",
        "--ps-cmd",
        shlex.join(command),
        "--untracked",
        "ps,worker",
        "--grace",
        "5",
        "--",
        *command,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    records = _read_records(out)
    assert sorted(records) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    ps_env = records["ps:0"]["env"]
    assert json.loads(ps_env["TF_CONFIG"])["task"] == {"type": "ps", "index": 0}
    assert "RANK" not in ps_env  # ps tasks are not torch ranks
    cluster_id = cf.only_id()
    state = cf.state(cluster_id)
    assert state["status"] == "succeeded" and state["exit_code"] == 0
    tasks = _task_states(state)
    assert tasks["chief:0"]["exit_code"] == 0
    for task in ("ps:0", "worker:0", "worker:1"):
        assert tasks[task]["tracked"] is False
        assert tasks[task]["status"] == "stopped"
        assert tasks[task]["exit_code"] == -signal.SIGTERM
    assert not cf.live(cluster_id)


# 3. Output routing ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_output_is_prefixed_on_the_terminal_and_raw_in_task_logs(cf: Clusterflow) -> None:
    script = cf.script("out.py", OUTPUT_SCRIPT)

    done = cf.run("start", "--workers", "2", "--", PY, str(script))

    assert done.returncode == 0, done.stdout + done.stderr
    cluster_id = cf.only_id()
    combined = cf.output(cluster_id).splitlines()
    for task in ("worker:0", "worker:1"):
        raw = [*(f"line {i} from {task}" for i in range(3)), f"stderr of {task}"]
        raw.append(f"no newline from {task}")
        log = cf.path(cluster_id) / "logs" / f"{task.replace(':', '-')}.log"
        assert log.read_text() == "".join(f"{line}\n" for line in raw)
        prefixed = [f"[{task}] {line}" for line in raw]
        terminal = [line for line in done.stdout.splitlines() if line.startswith(f"[{task}] ")]
        assert terminal == prefixed
        assert [line for line in combined if line.startswith(f"[{task}] ")] == prefixed
    assert sorted(combined) == sorted(done.stdout.splitlines())
    assert done.stderr == ""


@pytest.mark.timeout(60)
def test_processes_a_job_leaves_behind_end_with_the_run(cf: Clusterflow) -> None:
    script = cf.script("bg.py", BACKGROUND_SCRIPT)

    done = cf.run("start", "--grace", "5", "--", PY, str(script))

    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("[worker:0] started ")
    child = int(line.split()[-1])
    assert not cf.alive([child])
    assert not cf.live(cf.only_id())


# 4. Exit codes -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_failing_worker_fails_the_run_and_stops_the_rest(cf: Clusterflow) -> None:
    script = cf.script("fail.py", FAIL_SCRIPT)

    done = cf.run("start", "--workers", "2", "--grace", "5", "--", PY, str(script))

    assert done.returncode == 3, done.stdout + done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: ")
    assert "worker:1" in errors[0] and "code 3" in errors[0]
    cluster_id = cf.only_id()
    assert not cf.live(cluster_id)
    state = cf.state(cluster_id)
    assert not cf.alive(cf.recorded_pids(state))
    assert state["status"] == "failed" and state["exit_code"] == 3
    tasks = _task_states(state)
    assert tasks["worker:1"]["exit_code"] == 3
    assert tasks["worker:0"]["status"] == "stopped"


REPLICA_FAIL_SCRIPT = """
import os, signal, sys, time
print("replica", os.environ["LOCAL_RANK"], "of", os.environ["LOCAL_WORLD_SIZE"], flush=True)
if os.environ["LOCAL_RANK"] == "1":
    while not os.path.exists("replica-0-ready"):  # fails once its peer is up and has spoken
        time.sleep(0.05)
    sys.exit(4)
open("replica-0-ready", "w").close()
signal.pause()  # as a replica waiting in a collective for the one that failed
"""


@pytest.mark.timeout(60)
def test_a_failing_replica_fails_its_task_and_stops_its_peers(cf: Clusterflow) -> None:
    script = cf.script("replica_fail.py", REPLICA_FAIL_SCRIPT)

    done = cf.run("start", "--replicas-per-host", "2", "--grace", "5", "--", PY, str(script))

    assert done.returncode == 4, done.stdout + done.stderr
    assert "worker:0" in done.stderr and "code 4" in done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines == ["[worker:0/0] replica 0 of 2", "[worker:0/1] replica 1 of 2"]
    cluster_id = cf.only_id()
    log = cf.path(cluster_id) / "logs" / "worker-0.log"
    assert sorted(log.read_text().splitlines()) == ["[0] replica 0 of 2", "[1] replica 1 of 2"]
    assert not cf.live(cluster_id)
    assert not cf.alive(cf.recorded_pids(cf.state(cluster_id)))


@pytest.mark.timeout(90)
def test_max_restarts_bounds_recovery_of_a_task_that_always_crashes(cf: Clusterflow) -> None:
    script = cf.script(
        "crash.py",
        'import os, sys\nprint("attempt", os.environ["CLUSTERFLOW_ATTEMPT"])\nsys.exit(5)\n',
    )

    done = cf.run("start", "--workers", "2", "--max-restarts", "2", "--", PY, str(script))

    assert done.returncode == 5, done.stdout + done.stderr
    (error,) = done.stderr.splitlines()
    assert error.startswith("error: ") and "worker:" in error
    assert "exited with code 5 (after 2 restarts)" in error
    cluster_id = cf.only_id()
    state = cf.state(cluster_id)
    assert state["status"] == "failed" and state["restarts"] == 2
    events = [json.loads(line) for line in (cf.path(cluster_id) / "events.jsonl").open()]
    assert [e["restarts"] for e in events if e["event"] == "cluster_restarted"] == [1, 2]
    # The job ran in each of the 3 incarnations (the first and 2 restarts); a task may
    # be killed before it printed, when its peer's crash restarted them both.
    for attempt in range(3):
        lines = [f"[worker:{i}] attempt {attempt}" for i in (0, 1)]
        assert any(line in done.stdout.splitlines() for line in lines), done.stdout
    assert not cf.live(cluster_id)


RESUME_SCRIPT = """
import os, sys, torch
from clusterflow.train.cut import Checkpointer

ckpt = Checkpointer(model=torch.nn.Linear(2, 1), every_steps=5)
step = ckpt.restore()
print("restored", step, flush=True)
while step < 20:
    step += 1
    ckpt.maybe_save(step)
    if step == 12 and not os.path.exists(sys.argv[1]):
        open(sys.argv[1], "w").close()
        sys.exit(3)  # the first run dies after its checkpoint at step 10
print("done", step, flush=True)
"""


@pytest.mark.timeout(90)
def test_resume_continues_a_failed_run_from_its_last_checkpoint(cf: Clusterflow) -> None:
    script = cf.script("resume.py", RESUME_SCRIPT)
    marker = cf.workdir / "failed-once"

    first = cf.run("start", "--", PY, str(script), str(marker))

    assert first.returncode == 3, first.stdout + first.stderr
    assert "[worker:0] restored 0" in first.stdout.splitlines()
    old = cf.only_id()
    folder = str(cf.path(old) / "checkpoints")
    assert cf.state(old)["checkpoint_dir"] == folder
    assert f"checkpoints: {folder} (newest step 10)" in cf.run("describe", old).stdout
    # --fresh would be restored over by the tasks anyway: refused, naming the step.
    refused = cf.run("start", "--resume", old, "--fresh")
    assert refused.returncode == 2 and "checkpoint at step 10" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and cf.ids() == [old]

    second = cf.run("start", "--resume", old)

    assert second.returncode == 0, second.stdout + second.stderr
    assert f"clusterflow: resuming cluster {old} from step 10" in second.stderr
    lines = second.stdout.splitlines()
    assert "[worker:0] restored 10" in lines  # the first run's checkpoint, not a fresh start
    assert "[worker:0] done 20" in lines
    new = next(i for i in cf.ids() if i != old)
    assert cf.state(new)["checkpoint_dir"] == cf.state(old)["checkpoint_dir"]
    assert cf.state(new)["command"] == cf.state(old)["command"]


NO_CHECKPOINT_SCRIPT = """
import os, sys
print("started at step 0", flush=True)
if not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    sys.exit(3)  # the first run dies having saved nothing
"""


@pytest.mark.timeout(90)
def test_resume_of_a_run_that_left_no_checkpoint_says_so_and_asks_for_fresh(
    cf: Clusterflow,
) -> None:
    """``--resume`` of a run that committed no checkpoint once started it over at step 0
    without a word. Pins ``cli/start_settings.py: resumed_settings``'s check
    (``newest_committed``): one line naming the cluster and ``--fresh``, exit 2, no
    cluster made; ``--fresh`` then starts the same settings over. And ``describe``
    (``_checkpoint_line``) names no folder that holds no committed checkpoint."""
    script = cf.script("nothing_saved.py", NO_CHECKPOINT_SCRIPT)
    marker = cf.workdir / "failed-once"
    first = cf.run("start", "--", PY, str(script), str(marker))
    assert first.returncode == 3, first.stdout + first.stderr
    old = cf.only_id()
    (cf.path(old) / "checkpoints" / "ckpt-000000000005").mkdir(parents=True)  # torn: no manifest
    described = cf.run("describe", old).stdout
    assert "checkpoints: none committed" in described
    assert str(cf.path(old) / "checkpoints") not in described

    refused = cf.run("start", "--resume", old)

    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"error: cluster {old} committed no checkpoint in ")
    assert "--fresh" in line
    assert cf.ids() == [old]  # nothing was started

    again = cf.run("start", "--resume", old, "--fresh")

    assert again.returncode == 0, again.stdout + again.stderr
    assert f"clusterflow: cluster {old} left no checkpoint; starting over" in again.stderr
    assert "[worker:0] started at step 0" in again.stdout.splitlines()
    new = next(i for i in cf.ids() if i != old)
    assert cf.state(new)["command"] == cf.state(old)["command"]
    assert cf.state(new)["checkpoint_dir"] == str(cf.path(new) / "checkpoints")


@pytest.mark.timeout(30)
def test_fresh_without_resume_is_one_line(cf: Clusterflow) -> None:
    done = cf.run("start", "--fresh", "--", PY, "-c", "pass")
    assert done.returncode == 2 and cf.ids() == []
    assert done.stderr.startswith("error: --fresh goes with --resume")


def _imported(stderr: str) -> set[str]:
    """The modules a process imported, from its ``PYTHONPROFILEIMPORTTIME`` listing."""
    prefix = "import time:"
    return {
        line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith(prefix)
    }


@pytest.mark.timeout(120)
def test_a_local_start_never_imports_the_test_harness(cf: Clusterflow) -> None:
    """Pins ``backends/kinds.py``: only a start on ``hosts`` imports ``clusterflow.testing``
    (its launcher registers itself from there). A local start does not, in the foreground
    (the CLI runs the manager) nor detached (the manager's own process, whose stderr is
    its ``manager.log``). Python lists every module each process imports."""
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    done = cf.run("start", "--workers", "1", "--", PY, "-c", "pass", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    cluster_id = cf.start_detached("--workers", "1", "--", PY, "-c", "pass", env=env)
    cf.wait_until(lambda: cf.state(cluster_id)["status"] == "succeeded", 60, "the run to end")
    # The manager writes its last state before it exits: its log is whole once it is gone.
    cf.wait_until(lambda: not cf.live(cluster_id), 30, "the manager's exit")
    manager_log = (cf.path(cluster_id) / "manager.log").read_text()
    for imported in (_imported(done.stderr), _imported(manager_log)):
        assert {"clusterflow.backends.kinds", "clusterflow.backends.local"} <= imported
        assert not {m for m in imported if m.startswith("clusterflow.testing")}


@pytest.mark.timeout(30)
def test_resume_refuses_an_unknown_cluster(cf: Clusterflow) -> None:
    done = cf.run("start", "--resume", "nosuchcluster")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "nosuchcluster" in done.stderr


@pytest.mark.timeout(60)
def test_curve_authentication_chosen_by_env_holds_for_manager_and_tasks(cf: Clusterflow) -> None:
    script = cf.script("hello.py", "print('hello over curve')\n")

    done = cf.run("start", "--ps", "1", "--", PY, str(script), env={"CLUSTERFLOW_AUTH": "curve"})

    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker:0] hello over curve" in done.stdout.splitlines()


# 5. The detached lifecycle ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_detached_ps_describe_logs_attach_stop(cf: Clusterflow) -> None:
    script = cf.script("gated.py", GATED_SCRIPT)
    go = cf.workdir / "go"
    stays = cf.start_detached("--workers", "2", "--", PY, str(script), str(cf.workdir / "never"))
    ends = cf.start_detached("--workers", "1", "--", PY, str(script), str(go), "4")
    # Printed without a flush, and seen while the tasks still run: output is unbuffered.
    cf.wait_output(stays, "[worker:0] ready worker:0", "[worker:1] ready worker:1")
    cf.wait_output(ends, "[worker:0] ready worker:0")

    listed = cf.run("ps")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert rows[stays].split()[1] == "running"
    assert "2/2 running (worker:2)" in rows[stays]
    assert "gated.py" in rows[stays]
    assert rows[ends].split()[1] == "running"

    state = cf.state(stays)
    described = cf.run("describe", cf.prefix(stays))
    assert described.returncode == 0, described.stderr
    assert f"id:       {stays}" in described.stdout
    assert "status:   running" in described.stdout
    assert f"command:  {PY} {script}" in described.stdout
    assert json.dumps(state["spec"]) in described.stdout
    assert len(state["spec"]["worker"]) == 2
    for task in ("worker:0", "worker:1"):
        assert any(line.split()[:2] == [task, "running"] for line in described.stdout.splitlines())

    logs = cf.run("logs", cf.prefix(stays))
    assert logs.returncode == 0, logs.stderr
    assert sorted(logs.stdout.splitlines()) == [
        "[worker:0] ready worker:0",
        "[worker:1] ready worker:1",
    ]
    one = cf.run("logs", cf.prefix(stays), "--task", "worker:1")
    assert (one.returncode, one.stdout) == (0, "ready worker:1\n"), one.stderr

    attach = cf.popen("attach", cf.prefix(ends))
    assert attach.stdout is not None
    reader = cf.LineReader(attach.stdout)
    reader.wait_for("[worker:0] ready worker:0")  # replays the stream so far
    go.touch()
    assert attach.wait(60) == 4  # the cluster's exit code: its only task exited 4
    assert "[worker:0] final worker:0" in reader.join()
    assert cf.state(ends)["exit_code"] == 4

    stopped = cf.run("stop", cf.prefix(stays), "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"{stays}: stopped"
    assert not cf.live(stays)
    state = cf.state(stays)
    assert state["status"] == "stopped"
    assert not cf.alive(cf.recorded_pids(state))

    running = cf.run("ps").stdout
    assert stays not in running and ends not in running
    assert _statuses(cf.run("ps", "-a").stdout) == {stays: "stopped", ends: "failed"}


# 6. A manager that died ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_stale_manager_is_shown_and_stop_cleans_up(cf: Clusterflow) -> None:
    script = cf.script("gated.py", GATED_SCRIPT)
    never = str(cf.workdir / "never")
    # Default manager timeout (15 s): the jobs are still there when `stop` comes.
    killed = cf.start_detached("--workers", "2", "--", PY, str(script), never)
    # A short one: the supervisors stop their jobs by themselves.
    orphaned = cf.start_detached(
        "--workers", "2", "--", PY, str(script), never, env={"CLUSTERFLOW_MANAGER_TIMEOUT": "1"}
    )
    for cluster_id in (killed, orphaned):
        cf.wait_output(cluster_id, "[worker:0] ready worker:0", "[worker:1] ready worker:1")
        manager = cf.state(cluster_id)["manager"]["pid"]
        os.kill(manager, signal.SIGKILL)
        cf.wait_until(lambda pid=manager: not cf.alive([pid]), 30, "the manager to die")

    assert _statuses(cf.run("ps", "-a").stdout) == {killed: "stale", orphaned: "stale"}

    cf.wait_until(lambda: not cf.live(orphaned), 60, "supervisors to stop their jobs")
    assert cf.live(killed), "the jobs should outlive their manager for a while"
    for cluster_id in (killed, orphaned):
        stopped = cf.run("stop", cluster_id, "--grace", "5")
        assert stopped.returncode == 0, stopped.stderr
        assert "forced" in stopped.stdout
        assert not cf.live(cluster_id)
        state = cf.state(cluster_id)
        assert state["status"] == "stopped"
        assert not cf.alive(cf.recorded_pids(state))
        assert all(t["status"] == "stopped" for t in state["tasks"])
    assert "stopped" in cf.run("describe", killed).stdout


# 7. Ctrl-C -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ctrl_c_stops_a_foreground_run(cf: Clusterflow) -> None:
    script = cf.script("gated.py", GATED_SCRIPT)
    start = cf.popen("start", "--workers", "2", "--", PY, str(script), str(cf.workdir / "never"))
    assert start.stdout is not None
    reader = cf.LineReader(start.stdout)
    reader.wait_for("[worker:0] ready worker:0")
    reader.wait_for("[worker:1] ready worker:1")

    start.send_signal(signal.SIGINT)

    assert start.wait(60) == 130
    cluster_id = cf.only_id()
    assert not cf.live(cluster_id)
    state = cf.state(cluster_id)
    assert state["status"] == "stopped"
    assert not cf.alive(cf.recorded_pids(state))


@pytest.mark.timeout(60)
def test_ctrl_c_while_tasks_still_register(cf: Clusterflow) -> None:
    # worker:1's supervisor is held before it registers (a sitecustomize on its path),
    # so worker:0's registration waits at the barrier when Ctrl-C comes.
    site = cf.workdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_REGISTRATION)
    release = cf.workdir / "release"
    script = cf.script("gated.py", GATED_SCRIPT)
    start = cf.popen(
        "start",
        "--workers",
        "2",
        "--grace",
        "30",
        "--",
        PY,
        str(script),
        str(cf.workdir / "never"),
        env={
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "TEST_RELEASE_FILE": str(release),
            # A sitecustomize runs when an interpreter starts: a supervisor forked from
            # the warm server (backends/forkserver.py) starts none, so it is held only
            # when every supervisor starts its own Python.
            ENV_WARM_FORK: "0",
        },
    )
    try:

        def registered() -> bool:
            ids = cf.ids()
            if not ids or not (cf.path(ids[0]) / "state.json").exists():
                return False
            tasks = _task_states(cf.state(ids[0]))
            return bool(tasks) and tasks["worker:0"]["status"] == "registered"

        cf.wait_until(registered, 60, "worker:0 to register")

        start.send_signal(signal.SIGINT)

        # Neither the held registration nor a supervisor at the barrier may keep the
        # run from ending: the registered one stops at SIGTERM (no waiting out the
        # 30 s grace), the manager does not wait out the registration timeout.
        assert start.wait(20) == 130
    finally:
        release.touch()
    cluster_id = cf.only_id()
    assert not cf.live(cluster_id)
    state = cf.state(cluster_id)
    assert state["status"] == "stopped"
    assert _task_states(state)["worker:0"]["exit_code"] == -signal.SIGTERM
