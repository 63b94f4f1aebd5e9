"""The ``clusterflow`` command line: argument parsing and printing only."""

import sys

from clusterflow.backends import forkserver

# Here, not in cli/main.py: this runs before the CLI's own imports (a fifth of a second),
# so the warm fork server's ``import torch`` overlaps them (backends/forkserver.py).
forkserver.start_early(sys.argv)
