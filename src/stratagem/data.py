"""Global-batch data loading: each replica takes its slice of every global batch.

``batch_size`` is the GLOBAL batch. Batch ``t`` of an epoch is the same set of samples
whatever the number of replicas, so distributed training matches single-process training
with the same batch size. Shuffling is a deterministic permutation of (seed, epoch).

The loader's position is ``ShardPosition(epoch, offset)``: ``offset`` counts the samples of
the epoch's permutation handed out so far. It is a sample count, not a batch count, so a
restart with another number of replicas -- or a batch size changed mid-epoch -- continues
with the very next sample: nothing is skipped or repeated within the epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

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
    ``batch_sampler`` protocol of torch's DataLoader).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, *,
                 shuffle: bool, seed: int, drop_last: bool) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
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
            local_start, local_len = split_evenly(size, self.world_size)[self.rank]
            first = start + local_start
            out.append(GlobalBatch(start, size, order[first:first + local_len],
                                   local_len * self.world_size / size))
            start += size
        return out

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([b.indices for b in self.batches])


class DistributedDataLoader:
    """A torch DataLoader over this rank's share of each global batch.

    Iterating it runs the rest of the current epoch; when the epoch ends the position moves
    to the next epoch (a new permutation). Breaking out of the loop keeps the position, so
    the next iteration resumes there. Inside ``remaining_epochs_until`` the loader follows
    that loop's epoch. ``on_batch`` (set by AutoDist) receives each batch's gradient
    weight. With ``elastic=True`` (AutoDist's loaders) a pending SIGTERM is acted on after
    each step: the job state is saved and the process exits (see ``stratagem.adapt``).
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 on_batch: Any = None, elastic: bool = False, **loader_kwargs: Any) -> None:
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
        self._on_batch = on_batch
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_kwargs)

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
    def position(self) -> ShardPosition:
        return self.sampler.position

    @property
    def epoch(self) -> int:
        return self.sampler.position.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.position = ShardPosition(epoch=epoch, offset=0)

    def _follow_epoch_loop(self) -> None:
        from stratagem.adapt.epoch import current_epoch

        epoch = current_epoch()
        if epoch is not None and epoch != self.position.epoch:
            self.set_epoch(epoch)

    def __len__(self) -> int:
        self._follow_epoch_loop()
        return len(self.sampler.plan(warn=False))

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        from stratagem.adapt.elastic import exit_point

        self._follow_epoch_loop()
        while True:
            batch_size = self.batch_size
            plan = self.sampler.plan()
            self.sampler.batches = plan
            resized = False
            for info, batch in zip(plan, self._loader, strict=True):
                # Handed out = consumed: a checkpoint taken during this step resumes after it.
                self.position.offset = info.start + info.size
                if self._on_batch is not None:
                    self._on_batch(info.weight)
                yield batch
                if self.elastic:
                    exit_point()
                if self.batch_size != batch_size:
                    resized = True  # re-plan from the position (prefetched batches dropped)
                    break
            if not resized:
                break
        self.sampler.position = ShardPosition(epoch=self.position.epoch + 1, offset=0)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position and batch size, JSON-serializable."""
        s = self.sampler
        return {"epoch": s.position.epoch, "offset": s.position.offset,
                "batch_size": s.batch_size, "base_batch_size": self.base_batch_size,
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
        else:
            warnings.warn(f"batch_size changed from {state['base_batch_size']} to "
                          f"{self.base_batch_size} since the checkpoint; using the new one",
                          stacklevel=2)
