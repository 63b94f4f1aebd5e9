"""CentralStorageStrategy: TensorFlow's one-process parameter server.

Its own module so ``parameter_server/strategy.py`` holds only the distributed strategy; this one
is that strategy over an in-process store (``ps.local.LocalPS``), synchronous.
"""

from __future__ import annotations

from clusterflow.ps.local import LocalPS
from clusterflow.strategies.parameter_server import ParameterServerStrategy


class CentralStorageStrategy(ParameterServerStrategy):
    """One local ps holding the variables, synchronous updates (TensorFlow's name).

    The variables and the optimizer's slots live in an in-process store rather than in
    the module itself, exactly as on a ps task; nothing crosses a socket.
    """

    def __init__(self, *, reject_nonfinite: bool = True) -> None:
        from clusterflow.strategies.resolver import SimpleClusterResolver

        super().__init__(
            SimpleClusterResolver({"chief": ["127.0.0.1:1"]}, task_type="chief", task_id=0),
            mode="sync",
            reject_nonfinite=reject_nonfinite,
            _connection=LocalPS(),
        )
