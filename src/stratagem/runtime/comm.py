"""Process groups, counted collectives and coalesced broadcasts."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stratagem.distributed.gloo_threads import Yielding, new_loops, unclaimed_loops
from stratagem.distributed.process_group import hold
from stratagem.errors import DistributedError, StrategyError
from stratagem.runtime.plan import Plan
from stratagem.runtime.stats import CommStats

BROADCAST_CHUNK_BYTES = 64 * 2**20
SHARDED_BROADCAST_BYTES = 2 * 2**20  # chunks of a sharded strategy's one-at-a-time broadcast


class Comm:
    """One process group whose collectives are counted in a :class:`CommStats`."""

    def __init__(self, group: dist.ProcessGroup, backend: str, stats: CommStats,
                 io_threads: frozenset[int] = frozenset()) -> None:
        self.group: dist.ProcessGroup | None = group
        self.backend = backend
        self.stats = stats
        self.yielding = Yielding(io_threads)  # gloo's, while this process waits on them
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.root = dist.get_global_rank(group, 0)
        hold(self)  # the handle goes at exit, before the group is destroyed

    def release_groups(self) -> None:
        """Drop the group's handle (at exit: :func:`stratagem.distributed.process_group.hold`)."""
        self.group = None

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise DistributedError(
                f"the {self.backend} communicator was released at interpreter exit",
                fix="run collectives before the script ends, not from atexit handlers "
                    "registered before stratagem's")
        return self.group

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Async sum; the caller pre-scales so that the sum is the average."""
        self.stats.record(tensor.numel() * tensor.element_size(), self.world_size)
        return dist.all_reduce(tensor, group=self._group(), async_op=True)

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        """Async all-gather of equal-sized ``tensor``s into ``out`` (one per rank)."""
        self.stats.record(tensor.numel() * tensor.element_size() * self.world_size,
                          self.world_size, "all_gather")
        return dist.all_gather(out, tensor, group=self._group(), async_op=True)

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Async broadcast from the group's rank 0."""
        self.stats.record(tensor.numel() * tensor.element_size(), self.world_size, "broadcast")
        return dist.broadcast(tensor, src=self.root, group=self._group(), async_op=True)

    def wait(self, work: dist.Work) -> None:
        t0 = time.perf_counter()
        with self.yielding:
            work.wait()
        self.stats.wait_seconds += time.perf_counter() - t0


def make_comms(plan: Plan, process_group: dist.ProcessGroup | None, stats: CommStats
               ) -> tuple[Comm, dict[str, Comm]]:
    """The default comm plus one comm per backend the plan uses.

    A backend equal to the default group's reuses it; any other gets ``dist.new_group`` over
    the same ranks. Every rank compiles the same plan, so the groups are created in the same
    (sorted) order everywhere, as ``new_group`` requires.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            f"the plan is for {plan.world_size} replicas but torch.distributed is not "
            "initialized", where="DistributedModel",
            fix="launch with `stratagem run` or torchrun (or call "
                "torch.distributed.init_process_group first)")
    group = process_group if process_group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != plan.world_size or rank != plan.rank:
        raise DistributedError(
            f"the plan is for rank {plan.rank} of {plan.world_size}, but this process is rank "
            f"{rank} of {size} in its process group", where="DistributedModel",
            fix="compile the plan with this process's rank and world size")
    default_backend = str(dist.get_backend(group)).lower()
    default = Comm(group, default_backend, stats, unclaimed_loops())
    comms: dict[str, Comm] = {}
    ranks = dist.get_process_group_ranks(group)
    for backend in plan.backends:
        if backend in re.split(r"[:,]", default_backend):  # e.g. "gloo", "cpu:gloo,cuda:nccl"
            comms[backend] = default
            continue
        if backend == "nccl" and not dist.is_nccl_available():
            raise StrategyError("the plan asks for NCCL, but this PyTorch build has no NCCL",
                                where="DistributedModel",
                                fix="use spec 'gloo' or 'auto', or install a CUDA build")
        made, loops = new_loops(lambda b=backend: dist.new_group(ranks=ranks, backend=b))
        comms[backend] = Comm(made, backend, stats, loops)
    return default, comms


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same dtype/device tensors, each under ``limit`` bytes."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if (last is None or last[0].dtype != t.dtype or last[0].device != t.device
                or size + nbytes > limit):
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], comm: Comm,
                        limit: int = BROADCAST_CHUNK_BYTES, overlap: bool = True) -> None:
    """Make ``tensors`` equal to the root's, a few flat broadcasts instead of one each.
    Without ``overlap``, one chunk at a time: a chunk's bytes of extra memory, not a copy
    of every tensor (a sharded strategy's model may not fit twice)."""
    ordered = sorted(tensors, key=lambda t: (str(t.device), str(t.dtype)))
    pending = []
    for chunk in _chunks(ordered, limit):
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        pending.append((chunk, flat, comm.broadcast(flat)))
        if not overlap:
            _settle(pending.pop(), comm)
    for item in pending:
        _settle(item, comm)


def _settle(item: tuple[list[torch.Tensor], torch.Tensor, Any], comm: Comm) -> None:
    chunk, flat, work = item
    comm.wait(work)
    if comm.rank != 0:
        offset = 0
        for t in chunk:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class BufferSync:
    """Broadcast a module's buffers from rank 0 through persistent flat buffers."""

    def __init__(self, module: torch.nn.Module, comm: Comm) -> None:
        self.module = module
        self.comm = comm
        self._key: tuple = ()
        self._layout: list[tuple[list[torch.Tensor], torch.Tensor]] = []

    def _refresh(self) -> None:
        buffers = [b for b in self.module.buffers() if b.numel()]
        key = tuple((id(b), b.shape, b.dtype) for b in buffers)
        if key != self._key:  # the module replaced a buffer tensor: rebuild the layout
            self._key = key
            self._layout = []
            for chunk in _chunks(sorted(buffers, key=lambda t: (str(t.device), str(t.dtype))),
                                 BROADCAST_CHUNK_BYTES):
                n = sum(t.numel() for t in chunk)
                self._layout.append((chunk, torch.empty(n, dtype=chunk[0].dtype,
                                                        device=chunk[0].device)))

    def __bool__(self) -> bool:
        return any(b.numel() for b in self.module.buffers())

    @torch.no_grad()
    def launch(self) -> Callable[[], None]:
        """Start the broadcasts; returns the function that waits and copies them in."""
        self._refresh()
        works = []
        for chunk, flat in self._layout:
            if self.comm.rank == 0:
                torch.cat([t.reshape(-1) for t in chunk], out=flat)
            works.append(self.comm.broadcast(flat))

        @torch.no_grad()
        def finish() -> None:
            for (chunk, flat), work in zip(self._layout, works, strict=True):
                self.comm.wait(work)
                if self.comm.rank != 0:
                    offset = 0
                    for t in chunk:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

        return finish
