"""Process exit with threads still waiting on parameter-server groups.

A thread inside a torch call that returns while the interpreter finalizes (its peer left)
is ended by a forced unwind that C++ turns into ``std::terminate``: the process aborts
("terminate called without an active exception") after a run that succeeded. The cluster
wakes and joins such threads at exit (``Cluster.quiesce``); these tests make the peer leave
exactly then, which aborted every time before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _spawn import free_port

SCRIPT = Path(__file__).with_name("ps_exit_blocked.py")


@pytest.mark.parametrize("attempt", range(2))
def test_a_rank_exits_cleanly_while_its_threads_wait_on_a_peer_that_leaves(
        attempt: int, tmp_path: Path) -> None:
    port = str(free_port())
    flag = tmp_path / "finalizing"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "STRATAGEM_PG_TIMEOUT_S": "60"}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(flag)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert "rank 0 leaving" in outs[0], outs[0]
    assert procs[0].returncode == 0, f"rank 0 exited with {procs[0].returncode}:\n{outs[0]}"
    assert "terminate called" not in outs[0], outs[0]
    assert procs[1].returncode == 0, outs[1]
