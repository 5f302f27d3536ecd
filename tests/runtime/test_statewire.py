"""The optimizer-state wire format of the PS fetch service (runtime/ps/statewire.py)."""

from __future__ import annotations

import pytest
import torch

from stratagem.errors import DistributedError
from stratagem.runtime.ps import statewire

SHAPE = (6, 3)


def _roundtrip(state: dict) -> dict:
    manifest, blob = statewire.encode(state)
    entries = statewire.layout(manifest, SHAPE, "test")
    assert blob.numel() == statewire.blob_size(entries)
    return statewire.decode(entries, blob)


def test_every_kind_of_optimizer_state_comes_back_equal() -> None:
    """Adam's tensors and tensor step, SparseAdam's int step, SGD's sparse momentum rows."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, generator=g, dtype=torch.float64)
    momentum = torch.sparse_coo_tensor(torch.tensor([[4, 1]]), rows, SHAPE,
                                       check_invariants=True).coalesce()
    state = {"step": torch.tensor(7.0), "exp_avg": torch.randn(SHAPE, generator=g),
             "exp_avg_sq": torch.rand(SHAPE, dtype=torch.float64, generator=g),
             "momentum_buffer": momentum, "count": 12, "lr": 0.25, "flag": True}
    got = _roundtrip(state)
    assert got.keys() == state.keys()
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_sparse:
            assert torch.equal(got[k].indices(), v.indices())
            assert torch.equal(got[k].values(), v.values())
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v)
        else:
            assert type(got[k]) is type(v) and got[k] == v


def _manifest(*entries: list[int]) -> torch.Tensor:
    return torch.tensor([len(entries), *[x for e in entries for x in e]], dtype=torch.int64)


KEY = [1, ord("m")]
F64 = statewire.DTYPES.index(torch.float64)


@pytest.mark.parametrize(("manifest", "what"), [
    (_manifest(KEY + [statewire.TENSOR, F64, 2, 1 << 20, 1 << 20]), "shape"),
    (_manifest(KEY + [statewire.SPARSE, F64, 2, 6, 3, 7]), "rows"),
    (_manifest(KEY + [statewire.TENSOR, 99, 0]), "dtype"),
    (_manifest([1000, 1]), "key"),
    (torch.tensor([1 << 40], dtype=torch.int64), "entries"),
    (_manifest(KEY + [statewire.TENSOR, F64]), "truncated"),
])
def test_a_malformed_manifest_is_refused_before_allocating(manifest: torch.Tensor,
                                                           what: str) -> None:
    with pytest.raises(DistributedError, match="malformed optimizer-state reply"):
        statewire.layout(manifest, SHAPE, "test")
