"""Virtual clusters (tools/vcluster.py: one network namespace per node; needs root) for the
tests that launch jobs on several nodes through ``stratagem run``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vcluster import VirtualCluster

TOOL = Path(__file__).resolve().parents[1] / "tools" / "vcluster.py"


def cluster_fixture(nodes: int, *, tag: str, subnet: str, bandwidth: str | None = None
                    ) -> Callable[..., Iterator[VirtualCluster]]:
    """A fixture (assign it to a module-level name): a ``nodes``-node cluster, unshaped or
    shaped to ``bandwidth``, built for one test and torn down after it; skips, with the
    reason, where this machine cannot host one (not root, no ``ip``: ``need_vcluster``).

    The namespaces are named ``<tag><pid>-<i>``. Give every test module its own ``tag`` and
    ``subnet``, so that modules run at once (and other sessions) do not collide; taken:
    10.77 (the tool's default), 10.79 (tests/tools), 10.81 (launch), 10.82 (runtime PS),
    10.83 (end to end), 10.84 (PS pacing), 10.91 and 10.94 (launch --nnodes), 10.95 (launch
    over a real sshd);
    bench/auto_strategy.py uses 10.86 (prefix sgauto), bench/chaos_elastic.py 10.93,
    bench/wait_latency.py 10.87 (prefix sgwait).
    """
    prefix = f"{tag}{os.getpid() % 100000}"

    @pytest.fixture
    def cluster(need_vcluster: None) -> Iterator[VirtualCluster]:
        with VirtualCluster(nodes, bandwidth=bandwidth, delay=None, prefix=prefix,
                            subnet=subnet) as vc:
            yield vc

    return cluster


def launcher_env(cluster: VirtualCluster, **extra: str) -> dict[str, str]:
    """This environment for ``stratagem run`` on the chief, plus ``extra``: other nodes reached
    through ``vcluster.py exec``; no inherited GLOO_SOCKET_IFNAME (each node binds its eth0)."""
    shell = f"{sys.executable} {TOOL} exec --prefix {cluster.prefix} {{address}} --"
    env = {**os.environ, "STRATAGEM_REMOTE_SHELL": shell, **extra}
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env
