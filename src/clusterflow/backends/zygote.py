"""A warm Python process that becomes a job: torch already imported, command not yet known.

``python -m clusterflow.backends.zygote``: started by a standby supervisor (see
``supervisor.py``) long before anything fails. It imports torch and clusterflow's
training modules (about 2.5 s of CPU on a small machine: most of a replacement
worker's start), then waits for one line on stdin: the JSON ``{"argv", "env", "cwd"}``
of the job a dead task ran. It then takes that environment and runs the command in this
process, as ``python`` would have. EOF instead of a line ends it with status 0.

Only commands this interpreter can run in-process qualify (:func:`runnable`):
``python SCRIPT ARGS``, ``python -m MODULE ARGS`` and ``python -c CODE ARGS``, with this
very interpreter and at most ``-u`` before them. Variables read once at import (such as
``OMP_NUM_THREADS`` for torch's thread pool) take the zygote's values, which are the
same cluster environment.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Sequence

from clusterflow.cluster.contract import ENV_ZYGOTE_READY_FD

PRELOAD = ("torch", "clusterflow.strategies", "clusterflow.strategies.parameter_server.strategy")
FLAGS_OK = frozenset({"-u"})


def runnable(command: Sequence[str], executable: str = sys.executable) -> bool:
    """Whether a zygote of ``executable`` can run ``command`` in-process."""
    if not command or not _same_interpreter(command[0], executable):
        return False
    rest = list(command[1:])
    while rest and rest[0] in FLAGS_OK:
        rest.pop(0)
    if not rest:
        return False
    if rest[0] in ("-m", "-c"):
        return len(rest) >= 2
    return not rest[0].startswith("-")


def _same_interpreter(program: str, executable: str) -> bool:
    if program == executable:
        return True
    try:
        return os.path.samefile(program, executable)
    except OSError:
        return False


def _run(argv: list[str]) -> None:
    rest = argv[1:]
    while rest and rest[0] in FLAGS_OK:
        rest.pop(0)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    elif rest[0] == "-c":
        sys.argv = ["-c", *rest[2:]]
        sys.path[0] = ""
        code = compile(rest[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(rest)
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


def _warm_up() -> None:
    """One tiny training step: torch imports more on first use (an optimizer's first
    construction alone pulls in torch._dynamo, seconds on a small machine). The RNG
    state is put back, so the job draws what it would have drawn in a fresh process."""
    import torch

    state = torch.get_rng_state()
    layer = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.set_rng_state(state)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    _warm_up()
    ready = os.environ.pop(ENV_ZYGOTE_READY_FD, None)
    if ready:  # tell the standby supervisor: warm now
        os.write(int(ready), b"1")
        os.close(int(ready))
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    request = json.loads(line)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the job's stdin, as the supervisor gives it
    _run(list(request["argv"]))


if __name__ == "__main__":
    main()
