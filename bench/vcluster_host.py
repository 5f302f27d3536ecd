"""The virtual cluster as the benchmarks use it: tools/vcluster.py's class where this machine
can host one, and the nodes pinned one core each, round-robin over this process's cores (two
nodes on two cores: a core each; four: two nodes share each core)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def virtual_cluster() -> Any | None:
    """``VirtualCluster``, or None after printing why this machine cannot host one (not root,
    no ``ip``/``tc``): a benchmark then skips its cluster cases."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    from vcluster import VirtualCluster  # type: ignore[import-not-found]

    ok, reason = VirtualCluster.available()
    if not ok:
        print(f"skipped: {reason}")
        return None
    return VirtualCluster


def pinned_cpus(nodes: int) -> list[list[int]]:
    """One core per node, round-robin over the cores this process may use."""
    ncpu = len(os.sched_getaffinity(0))
    return [[i % ncpu] for i in range(nodes)]
