"""The job of the elastic tests: ``python elastic_job.py OUT RECORDS EPOCHS`` under
``clusterflow start --chief --ps 1 --workers MIN:MAX``.

``clusterflow.fit`` with an asynchronous ``ParameterServerStrategy`` and the data
service, on ``chaos_job.Counter`` (``counts[i]`` is how often record ``i``'s update was
applied: SGD at lr 1, a gradient of -1 at ``counts[id]``). Each step appends a line to
``OUT/steps.log``. The test paces the run with ``OUT/allow``: while it exists, a task
that finished a step waits (polling the files) until ``steps.log`` holds fewer lines
than the number it holds, so a resize happens at a point of the run the test chose,
never after the data ran out. The chief writes every record's count to
``OUT/final.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_job import Counter, progress


def steps(out: Path) -> int:
    log = out / "steps.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def hold_at(out: Path, step: int) -> None:
    """Waits while ``OUT/allow`` exists and ``step`` (the step this task just took) is at
    or past the number it holds.

    Where every replica takes the same numbered steps (sync ps, torchrun ranks), this
    pauses each of them after the same step: none starts the next, so none has a push
    or a collective in flight while the test resizes the cluster.
    """
    _hold_until_below(out, lambda: step)


def hold(out: Path) -> None:
    """Waits while ``OUT/allow`` exists and the run made as many steps as it allows.

    Counted in lines, this is not exact: a task that checks just before its peers write
    the last allowed lines goes on to one more step."""
    _hold_until_below(out, lambda: steps(out))


def _hold_until_below(out: Path, now: Callable[[], int]) -> None:
    """Polls ``OUT/allow`` (written by the test, in another process: nothing to wait on
    but the file) until it is gone or ``now()`` is below the number it holds."""
    allow = out / "allow"
    while True:
        try:
            limit = int(allow.read_text() or "0")
        except (FileNotFoundError, ValueError):
            return
        if now() < limit:
            return
        time.sleep(0.02)


def main() -> None:
    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import Hook

    torch.set_num_threads(1)
    out, records, epochs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    strategy = ParameterServerStrategy(mode="async")
    with strategy.scope():
        model = Counter(records)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = distributed_dataset(
        str(out / "records.parquet"),
        batch_size=10,
        split_size=10,
        seed=7,
        epochs=epochs,
        wait_for_all_acks=True,
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )

    class Paced(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            progress(out, f"step {info.step}")
            hold(out)

    def loss_fn(outputs: torch.Tensor, _ids: torch.Tensor) -> torch.Tensor:
        return -outputs.sum()

    clusterflow.fit(model, loss_fn, opt, data, strategy=strategy, epochs=epochs, hooks=[Paced()])
    data.close()
    if strategy.is_chief:
        (out / "final.json").write_text(json.dumps({"counts": model.counts.detach().tolist()}))
    strategy.close()


if __name__ == "__main__":
    main()
