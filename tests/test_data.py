"""The global-batch loader: batch t holds the same samples whatever the world size."""

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from stratagem.data import (
    DistributedDataLoader,
    ShardPosition,
    epoch_permutation,
    split_evenly,
)
from stratagem.errors import StratagemError


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _epoch_batches(n: int, batch: int, world: int, shuffle: bool, drop_last: bool = False,
                   epochs: int = 1) -> list[list[list[int]]]:
    """Per epoch: the list of global batches, each the concatenation of the ranks' slices."""
    loaders = [DistributedDataLoader(_dataset(n), batch, rank=r, world_size=world,
                                     shuffle=shuffle, seed=7, drop_last=drop_last)
               for r in range(world)]
    out = []
    for _ in range(epochs):
        per_rank = [[b[0].tolist() for b in loader] for loader in loaders]
        out.append([sum((per_rank[r][t] for r in range(world)), [])
                    for t in range(len(per_rank[0]))])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_global_batches_do_not_depend_on_world_size(world: int, shuffle: bool) -> None:
    reference = _epoch_batches(52, 8, 1, shuffle, epochs=2)
    assert _epoch_batches(52, 8, world, shuffle, epochs=2) == reference


def test_every_sample_once_per_epoch_and_epochs_reshuffle() -> None:
    first, second = _epoch_batches(51, 8, 3, shuffle=True, epochs=2)
    flat1, flat2 = sum(first, []), sum(second, [])
    assert sorted(flat1) == list(range(51)) == sorted(flat2)
    assert flat1 != flat2, "each epoch must use a new permutation"
    assert flat1 != list(range(51))


def test_tail_smaller_than_world_is_skipped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="last 2 samples of the epoch are skipped"):
        batches = _epoch_batches(50, 8, 3, shuffle=False)[0]
    assert sum(batches, []) == list(range(48))


def test_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    assert epoch_permutation(20, 3, 5, True) == epoch_permutation(20, 3, 5, True)
    assert epoch_permutation(20, 3, 5, True) != epoch_permutation(20, 4, 5, True)


def test_drop_last_and_uneven_last_batch_weights() -> None:
    assert [len(b) for b in _epoch_batches(50, 8, 2, False, drop_last=True)[0]] == [8] * 6
    loaders = [DistributedDataLoader(_dataset(11), 8, rank=r, world_size=3) for r in range(3)]
    weights = []
    for loader in loaders:
        w = []
        loader._on_batch = w.append
        list(loader)
        weights.append(w)
    # Last batch has 3 samples over 3 ranks: equal shares, weight 1 each.
    # First batch has 8 over 3 ranks: 3,3,2 -> weights 9/8, 9/8, 6/8; they average to 1.
    assert weights[0][0] == pytest.approx(9 / 8) and weights[2][0] == pytest.approx(6 / 8)
    assert sum(w[0] for w in weights) / 3 == pytest.approx(1.0)


def test_interleaved_deal_is_adaptdl_s_with_the_same_shares() -> None:
    """``interleave``: replica r takes every N-th sample of each (micro-)batch from the
    r-th (AdaptDL's deal), same share sizes and weights as the contiguous deal."""
    def deal(accum: int) -> list[list[list[int]]]:
        out = []
        for r in range(3):
            loader = DistributedDataLoader(_dataset(16), 8, rank=r, world_size=3)
            loader.sampler.interleave = True
            loader.sampler.accum_steps = accum
            out.append([b[0].tolist() for b in loader])
        return out

    assert deal(0) == [[[0, 3, 6], [8, 11, 14]], [[1, 4, 7], [9, 12, 15]],
                       [[2, 5], [10, 13]]]
    # one accumulation step: micro-batches of 4 samples, each dealt out strided
    assert deal(1) == [[[0, 3], [4, 7], [8, 11], [12, 15]], [[1], [5], [9], [13]],
                       [[2], [6], [10], [14]]]


def test_split_evenly() -> None:
    assert split_evenly(7, 3) == [(0, 3), (3, 2), (5, 2)]


def test_batch_smaller_than_world_is_an_error() -> None:
    with pytest.raises(StratagemError, match="batch_size >= 4"):
        DistributedDataLoader(_dataset(10), 2, rank=0, world_size=4)


# -- position: restart with another world size, batch size changes -----------------------
def _loaders(n: int, batch: int, world: int, **kw) -> list[DistributedDataLoader]:
    return [DistributedDataLoader(_dataset(n), batch, rank=r, world_size=world, shuffle=True,
                                  seed=3, **kw) for r in range(world)]


def _take(loaders: list[DistributedDataLoader], steps: int | None
          ) -> tuple[list[list[int]], dict | None]:
    """``steps`` global batches (all if None) and the position a checkpoint saved inside the
    loop body of the next step records (that batch in hand is replayed after a restart)."""
    out: list[list[int]] = []
    iters = [iter(lo) for lo in loaders]
    state = None
    while True:
        try:
            parts = [next(it)[0].tolist() for it in iters]
        except StopIteration:
            break
        if steps is not None and len(out) == steps:
            state = json.loads(json.dumps(loaders[0].state_dict()))  # JSON, as checkpointed
            assert all(lo.state_dict() == loaders[0].state_dict() for lo in loaders)
            break
        out.append(sum(parts, []))
    for it in iters:
        it.close()
    return out, state


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (4, 3)])
def test_restart_with_another_world_size_continues_the_epoch(before: int, after: int) -> None:
    reference, _ = _take(_loaders(53, 8, 1), None)
    head, state = _take(_loaders(53, 8, before), 3)
    assert state["offset"] == 24 and state["epoch"] == 0
    second = _loaders(53, 8, after)
    for lo in second:
        lo.load_state_dict(state)
    tail, _ = _take(second, None)
    assert head + tail == reference
    assert second[0].position == ShardPosition(epoch=1, offset=0)


def test_batch_size_change_mid_epoch_counts_samples_and_survives_restart() -> None:
    loaders = _loaders(50, 8, 2)
    iters = [iter(lo) for lo in loaders]
    got = [sum((next(it)[0].tolist() for it in iters), [])]
    for lo in loaders:
        lo.batch_size = 12  # takes effect from the next batch
    got.append(sum((next(it)[0].tolist() for it in iters), []))
    assert [len(b) for b in got] == [8, 12]
    state = loaders[0].state_dict()  # saved holding the second batch: it is replayed
    assert (state["offset"], state["batch_size"]) == (8, 12)
    restarted = _loaders(50, 8, 3)
    for lo in restarted:
        lo.load_state_dict(state)
    rest, _ = _take(restarted, None)
    assert [len(b) for b in rest] == [12, 12, 12, 6]
    assert rest[0] == got[1]
    order = epoch_permutation(50, 0, 3, True)
    assert sum(got[:1] + rest, []) == order


@pytest.mark.parametrize("persistent", [False, True])
def test_prefetching_workers_do_not_advance_the_position(persistent: bool) -> None:
    loader = DistributedDataLoader(_dataset(64), 4, rank=0, world_size=1, num_workers=2,
                                   prefetch_factor=4, persistent_workers=persistent)
    for i, _ in enumerate(loader):
        if i == 1:
            loader.batch_size = 6  # re-plans: the prefetched 4-sample batches are dropped
        if i == 3:  # holding samples 14-19: a checkpoint here resumes at sample 14
            state = loader.state_dict()
            break
    assert (state["epoch"], state["offset"]) == (0, 14)
    restarted = DistributedDataLoader(_dataset(64), 4, rank=0, world_size=1, num_workers=2,
                                      prefetch_factor=4, persistent_workers=persistent)
    restarted.load_state_dict(state)
    assert len(restarted) == 9
    rest = [b[0].tolist() for b in restarted]
    assert sum(rest, []) == list(range(14, 64))


def test_changed_dataset_restarts_the_epoch_with_a_warning() -> None:
    state = _loaders(50, 8, 1)[0].state_dict() | {"offset": 16, "epoch": 2}
    loader = _loaders(60, 8, 1)[0]
    with pytest.warns(UserWarning, match="restarting its epoch"):
        loader.load_state_dict(state)
    assert loader.position == ShardPosition(epoch=2, offset=0)
    other = _loaders(50, 16, 1)[0]
    with pytest.warns(UserWarning, match="batch_size changed from 8 to 16"):
        other.load_state_dict(state | {"batch_size": 24})
    assert other.batch_size == 16 and other.position.offset == 16


def test_follows_the_epoch_loop() -> None:
    from stratagem.adapt import remaining_epochs_until

    loader = _loaders(20, 8, 1)[0]
    firsts = [next(iter(loader))[0].tolist() for _ in remaining_epochs_until(3)]
    assert firsts == [epoch_permutation(20, e, 3, True)[:8] for e in range(3)]


def test_batches_arrive_on_the_loaders_device() -> None:
    """AutoDist's loaders hand out batches on the worker's device (the meta device stands in
    for a GPU here): every tensor of tuples, named tuples, lists and dicts, the rest as is;
    the same samples as on the CPU."""
    from collections import namedtuple

    from stratagem.data import to_device

    Pair = namedtuple("Pair", "x y")
    meta = torch.device("meta")
    batch = {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": Pair(torch.ones(1), "s")}
    moved = to_device(batch, meta)
    assert moved["a"][0].device == meta and moved["a"][1][0].device == meta
    assert moved["a"][1][1] == 3 and isinstance(moved["a"][1], list)
    assert isinstance(moved["b"], Pair) and moved["b"].x.device == meta and moved["b"].y == "s"

    ds = TensorDataset(torch.arange(8))
    on_cpu = DistributedDataLoader(ds, 4, rank=0, world_size=1, device="cpu")
    assert on_cpu.device is None
    assert [b[0].tolist() for b in on_cpu] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    on_meta = DistributedDataLoader(ds, 4, rank=0, world_size=1, device=meta)
    got = list(on_meta)
    assert [b[0].device for b in got] == [meta, meta] and [b[0].shape for b in got] == [
        torch.Size([4])] * 2
