"""Spawned cases for test_gloo_yield: what a gloo I/O thread's scheduling policy is while the
main thread waits on its group (see rt_common.spawn)."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from stratagem.distributed import gloo_threads
from stratagem.runtime.comm import Comm
from stratagem.runtime.ps.cluster import cluster_from_default_group
from stratagem.runtime.stats import CommStats

PEER_DELAY_S = 0.3


def policies_during_a_wait(rank: int, world: int, mode: str, waiter: str,
                           through: str = "comm") -> dict[str, set]:
    """Rank 1 joins an all-reduce ``PEER_DELAY_S`` late; rank 0 waits for it through a
    Comm (on its main thread, or on another: ``waiter``), or through a parameter-server
    group (``through="ps"``), while a sampler reads the I/O threads' policies. Returns the
    policies seen before, well inside, and after the wait."""
    os.environ["STRATAGEM_GLOO_YIELD"] = mode
    comm = Comm(dist.group.WORLD, "gloo", CommStats(), gloo_threads.unclaimed_loops())
    group = None
    if through == "ps":
        cluster = cluster_from_default_group([f"127.0.0.1:{r}" for r in range(world)])
        group = cluster.make_group("yield-test", range(world))
        assert group is not None
        tids = set(group.yielding.tids)
        assert not tids & set(comm.yielding.tids)  # the group claimed its own thread
    else:
        tids = set(comm.yielding.tids)
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.extend((time.monotonic(), os.sched_getscheduler(tid)) for tid in tids)
            time.sleep(0.002)

    t = torch.ones(4)
    marks: dict[str, float] = {}
    dist.barrier()
    if rank == 1:
        time.sleep(PEER_DELAY_S)
        if group is not None:
            group.wait(group.send(t, 0, 7))
        else:
            comm.wait(comm.all_reduce(t))
        dist.barrier()
        return {}
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(0.05)

    def wait() -> None:
        if group is not None:
            work = group.recv(t, 1, 7)
            marks["enter"] = time.monotonic()
            group.wait(work)
        else:
            work = comm.all_reduce(t)
            marks["enter"] = time.monotonic()
            comm.wait(work)
        marks["exit"] = time.monotonic()

    if waiter == "main":
        wait()
    else:
        other = threading.Thread(target=wait)
        other.start()
        other.join()
    time.sleep(0.05)
    stop.set()
    sampler.join()
    dist.barrier()
    enter, leave = marks["enter"], marks["exit"]
    return {"threads": {len(tids)},
            "before": {p for at, p in samples if at < enter},
            "during": {p for at, p in samples if enter + 0.05 < at < leave - 0.05},
            "after": {p for at, p in samples if at > leave}}
