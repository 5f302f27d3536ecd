"""Global-batch data loading: each replica takes its slice of every global batch.

``batch_size`` is the GLOBAL batch. Batch ``t`` of an epoch is the same set of samples
whatever the number of replicas, so distributed training matches single-process training
with the same batch size. Shuffling is a deterministic permutation of (seed, epoch).

With ``accum_steps = a > 0`` every global batch is handed out as ``a + 1`` consecutive
micro-batches (each again split across replicas); the step's gradient is accumulated over
them (see ``stratagem.adapt.loop``, which AutoDist attaches as the loader's ``hooks``).

The loader's position is ``ShardPosition(epoch, offset)``: ``offset`` counts the samples of
the epoch's permutation handed out so far. It is a sample count, not a batch count, so a
restart with another number of replicas -- or a batch size changed mid-epoch -- continues
with the very next sample: nothing is skipped or repeated within the epoch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from stratagem.elastic import MembershipChange, current_epoch, current_job, exit_point
from stratagem.errors import StratagemError


@dataclass
class ShardPosition:
    """Where an epoch stands: how many samples of its permutation were consumed."""

    epoch: int = 0
    offset: int = 0


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: its place in the epoch and this rank's share of it."""

    start: int
    size: int
    indices: list[int]
    weight: float  # local_n * world_size / size: averaged over ranks gives the global mean
    micro: int = 0  # index of this micro-batch within the global batch
    micros: int = 1  # micro-batches of the global batch (accumulation steps + 1)
    next_local: int = 0  # this rank's samples in the next micro-batch (0: this is the last)

    @property
    def final(self) -> bool:
        """Whether this micro-batch completes the global batch (the synced step)."""
        return self.micro == self.micros - 1


class LoaderHooks(Protocol):
    """What a training loop (``stratagem.adapt.loop``) plugs into a loader."""

    def start(self, loader: DistributedDataLoader) -> None:
        """Before batches are planned (an iteration begins or resumes); collective."""

    def scope(self, loader: DistributedDataLoader,
              info: GlobalBatch) -> contextlib.AbstractContextManager[Any]:
        """Entered around the hand-out of each (micro-)batch."""

    def end(self, loader: DistributedDataLoader) -> None:
        """After the epoch's last batch; collective."""


def epoch_permutation(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The sample order of ``epoch``: identical on every replica and every world size."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` contiguous slices of ``n`` items, sizes differing by <= 1."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


class GlobalBatchSampler:
    """This rank's share of each global batch of the epoch, from ``position`` onwards.

    ``plan()`` lists the remaining batches; iterating yields their index lists (the
    ``batch_sampler`` protocol of torch's DataLoader). Each (micro-)batch is dealt out in
    contiguous slices, or with ``interleave=True`` strided: replica ``r`` takes every
    ``world_size``-th sample from the ``r``-th (AdaptDL's deal, which its drop-in keeps so
    that every replica sees the samples it sees under AdaptDL; shares have the same sizes).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, *,
                 shuffle: bool, seed: int, drop_last: bool, interleave: bool = False) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.interleave = interleave
        self.accum_steps = 0
        self.position = ShardPosition()
        self.batches: list[GlobalBatch] = []  # what the next iteration yields

    def plan(self, warn: bool = True) -> list[GlobalBatch]:
        """The global batches from ``position`` to the end of its epoch."""
        order = epoch_permutation(self.num_samples, self.position.epoch, self.seed,
                                  self.shuffle)
        out, start = [], self.position.offset
        while start < self.num_samples:
            size = min(self.batch_size, self.num_samples - start)
            if size < self.batch_size and self.drop_last:
                break
            if size < self.world_size:
                if warn:
                    warnings.warn(
                        f"the last {size} samples of the epoch are skipped: fewer than the "
                        f"{self.world_size} replicas (use drop_last=True to silence, or a "
                        "dataset size that leaves at least one sample per replica)",
                        stacklevel=3)
                break
            # Micro-batches of at least one sample per replica; one without accumulation.
            micros = max(min(self.accum_steps + 1, size // self.world_size), 1)
            shares = []
            for chunk_start, chunk_len in split_evenly(size, micros):
                if self.interleave:
                    first = start + chunk_start
                    shares.append(order[first + self.rank:first + chunk_len:self.world_size])
                    continue
                local_start, local_len = split_evenly(chunk_len, self.world_size)[self.rank]
                first = start + chunk_start + local_start
                shares.append(order[first:first + local_len])
            for k, indices in enumerate(shares):
                following = len(shares[k + 1]) if k + 1 < micros else 0
                out.append(GlobalBatch(start, size, indices,
                                       len(indices) * self.world_size / size, k, micros,
                                       following))
            start += size
        return out

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([b.indices for b in self.batches])


def elastic_loaders() -> list[DistributedDataLoader]:
    """The live loaders made with ``elastic=True`` (AutoDist's and AdaptDL's): the ones an
    in-process rescale moves to the new world (participants of the job context)."""
    return [p for p in current_job().participants() if isinstance(p, DistributedDataLoader)]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (in tuples, named tuples, lists and dicts) on
    ``device``, copied without blocking; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class DistributedDataLoader:
    """A torch DataLoader over this rank's share of each global batch.

    Iterating it runs the rest of the current epoch; when the epoch ends the position moves
    to the next epoch (a new permutation). Breaking out of the loop ends the pass too: the
    next ``for`` starts a fresh one (as with AdaptDL and a torch DataLoader); only a
    checkpoint-restart resumes mid-epoch. A checkpoint saved inside the loop body resumes
    at the batch in hand (it is replayed). Inside ``remaining_epochs_until`` the loader follows
    that loop's epoch. ``on_batch`` (set by AutoDist) receives each batch's gradient
    weight. With ``elastic=True`` (AutoDist's loaders) a pending SIGTERM is acted on after
    each step: the job state is saved and the process exits (see ``stratagem.elastic``), and
    an in-process rescale moves the loader to the new world (:meth:`on_rescale`). With a
    ``device`` other than the CPU (AutoDist's loaders: the worker's GPU) every tensor of a
    batch arrives there, read into pinned memory and copied without blocking, as the model
    that AutoDist placed on it expects.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 on_batch: Any = None, elastic: bool = False,
                 device: torch.device | str | None = None, **loader_kwargs: Any) -> None:
        if not isinstance(dataset, Sized):
            raise StratagemError("the dataset has no len()", where="data_loader",
                                 fix="pass a map-style dataset (with __len__ and __getitem__)")
        for bad in ("sampler", "batch_sampler", "shuffle"):
            loader_kwargs.pop(bad, None)
        self.dataset = dataset
        self.base_batch_size = batch_size
        self.sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world_size,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size  # validates
        self.elastic = elastic
        self.hooks: LoaderHooks | None = None  # set by AutoDist (stratagem.adapt.loop)
        self.max_batch_size: int | None = None  # autoscaling limits, see autoscale_batch_size
        self.local_bsz_bounds: tuple[int | None, int | None] = (None, None)
        self.gradient_accumulation = False
        self._on_batch = on_batch
        self.device = None if device is None or torch.device(device).type == "cpu" else \
            torch.device(device)
        if self.device is not None and self.device.type == "cuda":
            loader_kwargs.setdefault("pin_memory", True)
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_kwargs)
        if elastic:
            current_job().add_participant(self)

    def before_membership_change(self) -> None:
        """Nothing to flush: the position is job state, handed over by the lifecycle."""

    def on_membership_change(self, change: MembershipChange) -> None:
        """An in-process rescale happened: follow it (:meth:`on_rescale`)."""
        self.on_rescale(change.rank, change.world_size)

    def on_rescale(self, rank: int, world_size: int) -> None:
        """Follow an in-process rescale (:mod:`stratagem.elastic.rescale`): this replica's new
        rank and the new number of replicas. A running iteration re-plans the epoch's
        remaining global batches from the current sample offset after the step in progress,
        so no sample is lost or repeated."""
        self.sampler.rank, self.sampler.world_size = int(rank), int(world_size)

    # -- position ------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """The global batch size; a change takes effect from the next batch, mid-epoch too."""
        return self.sampler.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        value = int(value)
        world = self.sampler.world_size
        if value < world:
            raise StratagemError(
                f"global batch_size {value} is smaller than the {world} replicas",
                where="data_loader", fix=f"use batch_size >= {world}")
        self.sampler.batch_size = value

    @property
    def accum_steps(self) -> int:
        """Micro-batches accumulated before the synchronising one (0: none); a change takes
        effect from the next global batch."""
        return self.sampler.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        value = int(value)
        if value < 0:
            raise StratagemError(f"accum_steps must be >= 0, got {value}", where="data_loader",
                                 fix="use 0 for no gradient accumulation")
        self.sampler.accum_steps = value

    @property
    def current_local_bsz(self) -> int:
        """The (largest) micro-batch per replica of the current configuration."""
        parts = self.sampler.world_size * (self.accum_steps + 1)
        return -(-self.batch_size // parts)

    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int | None, int | None] = (None, None),
                             gradient_accumulation: bool = False) -> None:
        """Let the job choose the goodput-optimal global batch (from ``batch_size`` up to
        ``max_batch_size``), micro-batch per replica (within ``local_bsz_bounds``; the upper
        end is the memory limit) and, if allowed, gradient accumulation. The learning rate
        follows the model's scaling rule. Needs a loader from ``AutoDist.data_loader``."""
        if self.hooks is None or not hasattr(self.hooks, "enable_autoscale"):
            raise StratagemError("this loader has no adaptive training loop attached",
                                 where="autoscale_batch_size",
                                 fix="create it with ad.data_loader(...) after "
                                     "ad.distribute(model, optimizer)")
        lo, hi = local_bsz_bounds
        if max_batch_size < self.base_batch_size or (lo and hi and lo > hi):
            raise StratagemError(
                f"max_batch_size {max_batch_size} < batch_size {self.base_batch_size}, or "
                f"local_bsz_bounds {local_bsz_bounds} empty", where="autoscale_batch_size",
                fix="use max_batch_size >= batch_size and lower bound <= upper bound")
        self.max_batch_size = int(max_batch_size)
        self.local_bsz_bounds = (lo, hi)
        self.gradient_accumulation = bool(gradient_accumulation)
        self.hooks.enable_autoscale(self)

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write batch size, accumulation, LR factor, goodput... to a TensorBoard
        ``SummaryWriter`` (rank 0; nothing without an adaptive loop)."""
        if self.hooks is not None and hasattr(self.hooks, "to_tensorboard"):
            self.hooks.to_tensorboard(self, writer, global_step, tag_prefix)

    @property
    def position(self) -> ShardPosition:
        return self.sampler.position

    @property
    def epoch(self) -> int:
        return self.sampler.position.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.position = ShardPosition(epoch=epoch, offset=0)

    def _follow_epoch_loop(self) -> None:
        epoch = current_epoch()
        if epoch is not None and epoch != self.position.epoch:
            self.set_epoch(epoch)

    def __len__(self) -> int:
        self._follow_epoch_loop()
        return len(self.sampler.plan(warn=False))

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._follow_epoch_loop()
        job = current_job()
        job.loader_iterations += 1  # (see adapt.Accumulator: syncs inside a loop)
        finished = False
        try:
            yield from self._iterate()
            finished = True
        finally:
            job.loader_iterations -= 1
            if not finished:
                self._end_pass()

    def _end_pass(self) -> None:
        """A loop left early (``break``) ends its pass: the next ``for`` starts a fresh one
        (the next epoch's order; inside ``remaining_epochs_until``, that epoch again)."""
        self.sampler.position = ShardPosition(epoch=self.position.epoch + 1, offset=0)

    def _iterate(self) -> Iterator[Any]:
        hooks = self.hooks
        while True:
            if hooks is not None:
                hooks.start(self)
            config = (self.batch_size, self.accum_steps, self.sampler.world_size,
                      self.sampler.rank)  # world: changed by an in-process rescale
            plan = self.sampler.plan()
            self.sampler.batches = plan
            resized = False
            for info, batch in zip(plan, self._loader, strict=True):
                if self._on_batch is not None:
                    self._on_batch(info.weight)
                if self.device is not None:
                    batch = to_device(batch, self.device)
                with hooks.scope(self, info) if hooks is not None else contextlib.nullcontext():
                    yield batch
                if not info.final:
                    continue
                # Consumed once the loop asks for the next batch: a checkpoint saved inside
                # the loop body replays the batch in hand; the exit point's (SIGTERM) save
                # below, after the step, resumes after it.
                self.position.offset = info.start + info.size
                if self.elastic:
                    exit_point(step=True)
                if (self.batch_size, self.accum_steps, self.sampler.world_size,
                        self.sampler.rank) != config:
                    resized = True  # re-plan from the position (prefetched batches dropped)
                    break
            if not resized:
                break
        if hooks is not None:
            hooks.end(self)
        self.sampler.position = ShardPosition(epoch=self.position.epoch + 1, offset=0)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position and batch size, JSON-serializable."""
        s = self.sampler
        return {"epoch": s.position.epoch, "offset": s.position.offset,
                "batch_size": s.batch_size, "base_batch_size": self.base_batch_size,
                "accum_steps": s.accum_steps,
                "num_samples": s.num_samples, "seed": s.seed, "shuffle": s.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position (written with any number of replicas)."""
        s = self.sampler
        same_order = (state["num_samples"], state["seed"], bool(state["shuffle"])) == (
            s.num_samples, s.seed, s.shuffle)
        offset = int(state["offset"])
        if not same_order:
            warnings.warn("the dataset size, seed or shuffle changed since the checkpoint: "
                          "restarting its epoch from the first sample", stacklevel=2)
            offset = 0
        s.position = ShardPosition(int(state["epoch"]), offset)
        if int(state["base_batch_size"]) == self.base_batch_size:
            self.batch_size = int(state["batch_size"])
            self.accum_steps = int(state.get("accum_steps", 0))
        else:
            warnings.warn(f"batch_size changed from {state['base_batch_size']} to "
                          f"{self.base_batch_size} since the checkpoint; using the new one",
                          stacklevel=2)
