"""Dense PS pieces: gradients pushed to the owner per bucket, values sent back.

One :class:`DenseBucket` per plan bucket (all pieces of one owner and dtype, in backward
order). Workers copy each pre-scaled gradient into the flat buffer as it becomes ready and
send it to the owner as soon as the bucket is complete (point-to-point: every worker's
bytes cross the network once; gloo's ``reduce`` moved up to 1.7x more); the owner sums the
workers' contributions into an accumulator (several backward passes before one optimizer
step add up, like ``.grad``). After the owner's update it sends the new values to every
worker from the same buffer; workers wait for them just before the next forward.

Receives are posted before sends, per phase and rank (:meth:`DenseBucket.expect_push`,
:meth:`DenseBucket.expect_values`): gloo sends a payload only once the receiver has
announced its receive, and that announcement travels on the same connection as the
receiver's own outgoing payloads. A receive posted after a large send therefore waits
for that send, which serialized the two directions of a link: the 51 MB shards of a 2-node
PartitionedPS exchange took 0.86 s instead of 0.43 s in about half of the steps.

An owner receives a large push from several workers one worker at a time (``pacing.py``):
together they overflowed the switch queue in front of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from stratagem.runtime.ps.cluster import Group
from stratagem.runtime.ps.pacing import ReceivePacer, pace_order
from stratagem.runtime.ps.plan import PSBucket, PSPiece
from stratagem.runtime.stats import CommStats

PULL_TAG = 1 << 20  # added to a bucket's push tag for its values


def piece_view(param: torch.Tensor, piece: PSPiece) -> torch.Tensor:
    """The slice of ``param`` that ``piece`` covers (``.data``: writes bump no version)."""
    t = param.data
    return t if piece.whole else t.narrow(piece.axis, piece.start, piece.length)


class DenseBucket:
    def __init__(self, plan: PSBucket, pieces: list[PSPiece],
                 params: dict[str, torch.nn.Parameter], group: Group, rank: int,
                 workers: int, device: torch.device, stats: CommStats,
                 pacer: ReceivePacer | None = None) -> None:
        """``pacer``: the owner's, where it receives this bucket's push one worker at a
        time (``pacing.paced_buckets``)."""
        self.plan = plan
        self.pieces = pieces
        self.group = group
        self.owner = plan.owner
        self.is_owner = rank == plan.owner
        self.workers = workers
        self.stats = stats
        # Host memory: gloo's reduce and all-to-all take CPU tensors.
        self.buf = torch.zeros(plan.size, dtype=getattr(torch, plan.dtype))
        self.views = [self.buf[p.offset:p.offset + p.numel].view(p.shape) for p in pieces]
        self.presence = self.buf[plan.numel:]
        self.params = [params[p.param] for p in pieces]
        self.targets = [piece_view(params[p.param], p) for p in pieces]
        self.acc = torch.zeros_like(self.buf) if self.is_owner else None
        self.acc_views = ([self.acc[p.offset:p.offset + p.numel].view(p.shape) for p in pieces]
                          if self.acc is not None else [])
        self.captured = [False] * len(pieces)
        self.pending = len(pieces)
        self.tag = 1000 + plan.id
        # the owner receives every other member's buffer (servers send nothing)
        self.senders = (pace_order([m for m in group.members if m != rank and m < workers],
                                   rank, workers) if self.is_owner else [])
        self.inbox = [torch.empty_like(self.buf) for _ in self.senders]
        self.work: list | None = None
        self.incoming: list | None = None  # the owner's posted receives of this push
        self.pull = None
        self.pushed = False
        self.pacer = pacer if self.is_owner else None

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    # -- push -----------------------------------------------------------------------
    def capture(self, i: int, grad: torch.Tensor | None, factor: float) -> None:
        piece = self.pieces[i]
        view = self.views[i]
        if grad is None:
            view.zero_()
            self.presence[i] = 0
        else:
            if grad.is_sparse:
                grad = grad.to_dense()
            if not piece.whole:
                grad = grad.narrow(piece.axis, piece.start, piece.length)
            if grad.device == view.device:
                torch.mul(grad, factor, out=view)
            else:  # (GPU workers: PS traffic is staged through host memory)
                view.copy_(grad)
                view.mul_(factor)
            self.presence[i] = 1
        self.captured[i] = True
        self.pending -= 1

    def fill_missing(self) -> None:
        for i, done in enumerate(self.captured):
            if not done:
                self.capture(i, None, 1.0)

    def expect_push(self) -> None:
        """Owner: post the receives of the coming push (before this rank sends anything)."""
        if self.is_owner and self.incoming is None:
            if self.pacer is None:
                self.incoming = [self.group.recv(t, m, self.tag)
                                 for m, t in zip(self.senders, self.inbox, strict=True)]
            else:
                self.incoming = [self.pacer.recv(self._poster(t, m))
                                 for m, t in zip(self.senders, self.inbox, strict=True)]
                self.stats.paced_receives += len(self.incoming)

    def _poster(self, t: torch.Tensor, src: int) -> Callable[[], dist.Work]:
        return lambda: self.group.recv(t, src, self.tag)

    def launch(self) -> None:
        """Send this rank's buffer to the owner (the owner's receives are posted)."""
        if self.is_owner:
            self.expect_push()
            self.work, self.incoming = self.incoming, None
        elif self.group.cluster.rank < self.workers:
            self.work = [self.group.send(self.buf, self.owner, self.tag)]
            self.stats.push_bytes += self.nbytes
        else:  # a server that does not own this bucket takes no part
            self.work = []
        self.stats.collectives += 1

    def finish_push(self) -> None:
        """Wait for the sends/receives; the owner adds them all to its accumulator."""
        if self.work is None:
            return
        for w in self.work:
            self.group.wait(w, f"pushing gradients to {self.describe_owner()}")
        self.work = None
        if self.is_owner:
            self.acc.add_(self.buf)
            for t in self.inbox:
                self.acc.add_(t)
            self.pushed = True

    # -- update (owner) -------------------------------------------------------------
    def attach_grads(self, shards: dict[int, torch.Tensor]) -> None:
        """Give each owned shard its summed gradient (None where no worker had one)."""
        present = self.acc[self.plan.numel:]
        for i, piece in enumerate(self.pieces):
            shard = shards[piece.id]
            grad = self.acc_views[i] if present[i] > 0 else None
            shard.grad = grad if grad is None else grad.to(shard.device)

    def clear_grads(self, shards: dict[int, torch.Tensor]) -> None:
        for piece in self.pieces:
            shards[piece.id].grad = None
        self.acc.zero_()
        self.pushed = False

    # -- pull -----------------------------------------------------------------------
    def expect_values(self) -> None:
        """Non-owner worker: post the receive of the values the owner sends after its
        update (the buffer is free once the push is finished)."""
        if not self.is_owner and self.pull is None and self.work is None:
            self.pull = [self.group.recv(self.buf, self.owner, self.tag + PULL_TAG)]
            self.stats.pull_bytes += self.nbytes
            self.stats.collectives += 1

    def post_values(self, shards: dict[int, torch.Tensor]) -> None:
        """Owner: send the values to every worker (point-to-point: gloo's broadcast took
        twice the push's time); the workers posted their receives with expect_values."""
        for piece, view in zip(self.pieces, self.views, strict=True):
            view.copy_(shards[piece.id])
        self.pull = [self.group.send(self.buf, m, self.tag + PULL_TAG)
                     for m in self.group.members if m != self.owner and m < self.workers]
        self.stats.collectives += 1

    @torch.no_grad()
    def finish_pull(self, write: bool = True) -> None:
        if self.pull is None:
            return
        for w in self.pull:
            self.group.wait(w, f"pulling values from {self.describe_owner()}")
        self.pull = None
        if write and not self.is_owner:
            for target, view in zip(self.targets, self.views, strict=True):
                target.copy_(view)

    def describe_owner(self) -> str:
        return self.group.cluster.describe(self.owner)
