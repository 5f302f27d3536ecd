"""Rank 0 exits while two of its threads wait on gloo receives from rank 1, and rank 1
leaves while rank 0's interpreter finalizes (test_ps_exit.py).

Rank 0 runs an owner's fetch service (a thread waiting for rank 1's next request) and a
background job blocked in a receive from rank 1, then ends with ``sys.exit(0)``. Its last
exit handler (registered first) touches ``argv[1]``; rank 1 waits for that file and ends
at once, so rank 0's receives fail while its interpreter finalizes -- unless its cluster
woke and joined those threads at exit. Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import atexit
import os
import sys
import time
from pathlib import Path

import torch

FLAG = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
if RANK == 0:
    atexit.register(FLAG.touch)  # the last exit handler: finalization comes next

from stratagem.runtime.ps.background import Background  # noqa: E402
from stratagem.runtime.ps.cluster import join_cluster  # noqa: E402
from stratagem.runtime.ps.fetch import FetchService  # noqa: E402

cluster = join_cluster(["cpu", "cpu"], [])
fetch_group = cluster.make_group("exit/fetch", [0, 1])
job_group = cluster.make_group("exit/job", [0, 1])
if RANK == 0:
    service = FetchService(fetch_group, [], {}, {}, 2, lambda pid: {})
    job = Background("exit-job", cluster.track)
    job.submit(lambda: job_group.wait(job_group.recv(torch.empty(1), 1, 5)))
    time.sleep(0.3)  # both threads are in their receives
    print("rank 0 leaving", flush=True)
    sys.exit(0)
deadline = time.monotonic() + 60
while not FLAG.exists():
    assert time.monotonic() < deadline, "rank 0 never reached its last exit handler"
    time.sleep(0.001)
os._exit(0)
