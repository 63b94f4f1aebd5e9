"""The Python blocks of README.md and docs/*.md that need a cluster run as written.

Each block a page runs under ``clusterflow start`` (its first line says with which
options, or its ``SNIPPETS`` entry does) runs here as the job of a local cluster with
those options, and the cluster must exit 0; a block that starts clusters itself
(``cf.tune.run``) runs as a program in this test's home. What each block needs that its
page leaves to the reader, and the sizes made small, are in ``tests/unit/doc_snippets.py``;
the blocks that run alone run in ``tests/unit/test_doc_snippets.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from doc_snippets import Block, prepare, python_blocks, runs_in_integration
from test_cache import caches  # noqa: F401  (the fixture that kills cache servers)

if TYPE_CHECKING:
    from conftest import Clusterflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BLOCKS = [b for b in python_blocks() if runs_in_integration(b)]


def test_the_blocks_that_need_a_cluster_are_found() -> None:
    """Pins the selection: the pages' cluster blocks (concepts.md's parameter-server and
    coordinator programs, pipeline.md's three, ...) are all here, so none is skipped by a
    marker read wrongly."""
    assert len(BLOCKS) >= 9, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs_as_written(block: Block, caches: Clusterflow) -> None:  # noqa: F811
    """Pins one block: it runs, as its page says, and exits 0 (with what its entry in
    ``SNIPPETS`` checks after it)."""
    cf = caches
    prepare(block, cf.workdir)
    script = cf.script("snippet.py", block.program())
    options = block.cluster_options()
    if options is None:  # it starts its clusters itself
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=cf.workdir,
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return
    if "--cache" in options:
        name = options[options.index("--cache") + 1]
        made = cf.run("cache", "create", name, "--from", "train.parquet", "--partitions", "1")
        assert made.returncode == 0, made.stderr
    try:
        done = cf.run("start", *options, "--", sys.executable, str(script), timeout=280)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        if "--cache" in options:
            cf.run("cache", "drop", options[options.index("--cache") + 1])
