"""Global-batch data loading: each replica takes its slice of every global batch.

``batch_size`` is the GLOBAL batch. Batch ``t`` of an epoch is the same set of samples
whatever the number of replicas, so distributed training matches single-process training
with the same batch size. Shuffling is a deterministic permutation of (seed, epoch).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
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
    """Yields this rank's index list for each global batch of the current epoch."""

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
        self.last_weight = 1.0

    def __len__(self) -> int:
        remaining = self.num_samples - self.position.offset
        full, rest = divmod(remaining, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_permutation(self.num_samples, self.position.epoch, self.seed, self.shuffle)
        while self.position.offset < self.num_samples:
            start = self.position.offset
            size = min(self.batch_size, self.num_samples - start)
            if size < self.batch_size and self.drop_last:
                break
            if size < self.world_size:
                warnings.warn(
                    f"the last {size} samples of the epoch are skipped: fewer than the "
                    f"{self.world_size} replicas (use drop_last=True to silence, or a dataset "
                    "size that leaves at least one sample per replica)", stacklevel=2)
                break
            local_start, local_len = split_evenly(size, self.world_size)[self.rank]
            # Weight so that averaging per-rank mean gradients gives the global mean.
            self.last_weight = local_len * self.world_size / size
            self.position.offset = start + size
            yield order[start + local_start: start + local_start + local_len]
        self.position = ShardPosition(epoch=self.position.epoch + 1, offset=0)


class DistributedDataLoader:
    """A torch DataLoader over this rank's share of each global batch.

    Iterating it runs one epoch; the next iteration runs the next epoch with a new
    permutation. ``on_batch`` (set by AutoDist) receives each batch's gradient weight.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 on_batch: Any = None, **loader_kwargs: Any) -> None:
        if not isinstance(dataset, Sized):
            raise StratagemError("the dataset has no len()", where="data_loader",
                                 fix="pass a map-style dataset (with __len__ and __getitem__)")
        if batch_size < world_size:
            raise StratagemError(
                f"global batch_size {batch_size} is smaller than the {world_size} replicas",
                where="data_loader", fix=f"use batch_size >= {world_size}")
        for bad in ("sampler", "batch_sampler", "shuffle"):
            loader_kwargs.pop(bad, None)
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world_size,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._on_batch = on_batch
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_kwargs)

    @property
    def epoch(self) -> int:
        return self.sampler.position.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.position = ShardPosition(epoch=epoch, offset=0)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            if self._on_batch is not None:
                self._on_batch(self.sampler.last_weight)
            yield batch
