"""Started with this folder on ``PYTHONPATH``, a process that will be rank R of a job takes
a host id of its own for NCCL (``NCCL_HOSTID``), on loopback sockets.

NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"). The GPU tests
start several ranks on the one GPU lent, through launchers (``torchrun``, ``stratagem
run``, AdaptDL's standalone variables) that give each worker its rank in the environment
only, so the host id is set here, before the script runs. Test-only.
"""

import os

_rank = os.environ.get("RANK", os.environ.get("ADAPTDL_REPLICA_RANK"))
if _rank is not None and "NCCL_HOSTID" not in os.environ:
    os.environ.update(NCCL_HOSTID=f"stratagem-test-{_rank}", NCCL_SOCKET_IFNAME="lo",
                      NCCL_IB_DISABLE="1")
