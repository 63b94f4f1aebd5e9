"""The ``placed.*`` methods between the chief and a task running its placed modules.

One definition for both ends (``placed.py`` calls, ``placed_service.py`` serves):

* ``placed.load`` ``{id, module: bytes}``: the module, pickled by the chief.
* ``placed.forward`` ``{id, call, keep}`` with tensors ``x`` and, when they changed,
  the parameters' values ``p0..pn``: answers tensor ``y``; keeps the graph if ``keep``.
* ``placed.backward`` ``{id, call}`` with tensor ``gy``: answers ``gx`` (when the input
  takes a gradient) and the parameters' gradients ``g0..gn``; drops the graph.
* ``placed.release`` (one-way) ``{id, call}``: drops a graph no backward will use.
"""

from __future__ import annotations

from typing import Final

METHOD_LOAD: Final = "placed.load"
METHOD_FORWARD: Final = "placed.forward"
METHOD_BACKWARD: Final = "placed.backward"
METHOD_RELEASE: Final = "placed.release"

KEPT_CALLS: Final = 64
"""Graphs a task keeps per module awaiting their backward; older ones are dropped."""
