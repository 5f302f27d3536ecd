"""The global-batch loader: batch t holds the same samples whatever the world size."""

import pytest
import torch
from torch.utils.data import TensorDataset

from stratagem.data import DistributedDataLoader, epoch_permutation, split_evenly
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


def test_split_evenly() -> None:
    assert split_evenly(7, 3) == [(0, 3), (3, 2), (5, 2)]


def test_batch_smaller_than_world_is_an_error() -> None:
    with pytest.raises(StratagemError, match="batch_size >= 4"):
        DistributedDataLoader(_dataset(10), 2, rank=0, world_size=4)
