"""runtime/skeleton.py: the copy without values an in-process rescale rebuilds stage-3
models from, and the rebuild (one process; the sharded path is test_shard_regroup.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from stratagem.errors import StratagemError
from stratagem.runtime.skeleton import assemble, skeleton


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.BatchNorm1d(3)])
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[1](self.blocks[0](self.emb(x)))) * self.scale


def test_skeleton_is_meta_keeps_ties_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skel = skeleton(model)
    assert type(skel) is Tied and skel is not model and skel.scale == 2.0
    assert all(t.is_meta for t in (*skel.parameters(), *skel.buffers()))
    assert skel.head.weight is skel.emb.weight  # tied, as in the model
    assert [n for n, _ in skel.named_parameters()] == [n for n, _ in model.named_parameters()]
    for k, v in model.state_dict().items():
        assert not v.is_meta
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_assemble_takes_whole_values_and_the_live_tensors() -> None:
    torch.manual_seed(0)
    model = Tied()
    skel = skeleton(model)
    model.blocks[1].eval()
    whole = {"emb.weight": torch.randn(5, 3), "blocks.0.weight": torch.randn(3, 3)}
    plain = assemble(skel, model, whole)
    assert plain is skel
    torch.testing.assert_close(plain.emb.weight.detach(), whole["emb.weight"])
    assert plain.head.weight is plain.emb.weight  # the tie is one new parameter
    assert isinstance(plain.blocks[0].weight, nn.Parameter)
    assert plain.blocks[0].bias is model.blocks[0].bias  # not given: the live one itself
    assert plain.blocks[1].running_mean is model.blocks[1].running_mean
    assert not plain.blocks[1].training and plain.blocks[0].training
    x = torch.tensor([0, 3, 4])
    model.emb.weight.data.copy_(whole["emb.weight"])
    model.blocks[0].weight.data.copy_(whole["blocks.0.weight"])
    torch.testing.assert_close(plain(x), model(x))


def test_a_model_that_cannot_be_copied_is_named_with_the_fix() -> None:
    model = Tied()
    model.lock = threading.Lock()
    with pytest.raises(StratagemError, match="cannot be copied") as err:
        skeleton(model)
    assert "lock" in str(err.value) and "checkpoint-restart" in err.value.fix
