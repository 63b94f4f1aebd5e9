"""The job of the sync ps resize test: ``python elastic_sync_ps_job.py OUT`` under
``clusterflow start --chief --ps 1 --workers MIN:MAX``.

``clusterflow.fit`` with a synchronous ``ParameterServerStrategy`` and the data service
(``BATCH`` records a batch, one split a batch), on ``elastic_allreduce_job``'s float64
linear regression trained by SGD with momentum. Each push appends
``TASK step V applied A ids I,J,..`` to ``OUT/steps.log``: ``V`` the step ps 0 took it
into (``-``: none, a late push or one from a replica that was no member of that step
yet), ``A`` 1 when its gradients were applied, 0 when it joined the step as an empty
part (its split was applied before: a leaver's split lent again). From those lines the
test rebuilds every step and replays it in one process (:func:`reference`). The test
paces the run with ``OUT/allow`` (``elastic_job.hold``). Every replica writes the
version and the parameters it ends with to ``OUT/final-TASK.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_allreduce_job import Regression, flat, loss_of, optimizer_for

BATCH = 4
RECORDS, EPOCHS = 240, 2


def reference(steps: Iterable[Sequence[tuple[Sequence[int], bool]]]) -> list[float]:
    """One process taking the same steps: each the mean of its parts' gradients (a
    part's is its batch's mean loss's; an empty part adds nothing but counts, as the
    ps averages it: ``VariableStore._apply``)."""
    model = Regression()
    opt = optimizer_for(model)
    for parts in steps:
        total = [torch.zeros_like(p) for p in model.parameters()]
        for ids, applied in parts:
            if not applied:
                continue
            batch = torch.tensor(list(ids), dtype=torch.int64)
            model.zero_grad()
            loss_of(model(batch), batch).backward()
            for t, p in zip(total, model.parameters(), strict=True):
                assert p.grad is not None
                t.add_(p.grad)
        for t, p in zip(total, model.parameters(), strict=True):
            p.grad = t.div_(len(parts))
        opt.step()
    return flat(model)


def main() -> None:
    from chaos_job import progress
    from elastic_job import hold_at

    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import Hook

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    strategy = ParameterServerStrategy(mode="sync")
    with strategy.scope():
        model = Regression()
    opt = optimizer_for(model)
    data = distributed_dataset(
        str(out / "records.parquet"),
        batch_size=BATCH,
        split_size=BATCH,
        seed=11,
        epochs=EPOCHS,
        # A replica whose data ended leaves the sync steps at once, so its peers' last
        # steps do not wait for it (it would wait for their acks, they for its push).
        wait_for_all_acks=False,
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )
    trained: list[int] = []

    def loss_fn(outputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        trained[:] = [int(i) for i in ids]
        return loss_of(outputs, ids)

    class Paced(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            step = "-" if strategy.last_step is None else str(strategy.last_step)
            applied = int(strategy.last_push_applied)
            progress(out, f"step {step} applied {applied} ids {','.join(map(str, trained))}")
            if strategy.last_step is not None:
                hold_at(out, strategy.last_step)

    clusterflow.fit(model, loss_fn, opt, data, strategy=strategy, epochs=EPOCHS, hooks=[Paced()])
    data.close()
    task = str(strategy.cluster_resolver.task)
    final = {"version": strategy.state_dict()["versions"][0], "params": flat(model)}
    (out / f"final-{task}.json").write_text(json.dumps(final))
    strategy.close()


if __name__ == "__main__":
    main()
