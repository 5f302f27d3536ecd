"""Meta-device construction (runtime/materialize.py): values equal eager construction
under the same seed, tied parameters stay tied, the optimizer follows, and a model that
cannot be materialized is refused with a StratagemError (one process, no group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import StratagemError
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, MetaInit, compile_plan
from stratagem.strategy import AllReduce


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight  # tied

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.body(self.emb(x) * self.scale)))


def wrap(model: nn.Module, opt: torch.optim.Optimizer, **kw: object) -> DistributedModel:
    profile = analyze(model)
    plan = compile_plan(AllReduce().build(profile, ResourceSpec.local(1)), profile, rank=0,
                        world_size=1, device=torch.device("cpu"))
    return DistributedModel(model, plan, optimizer=opt, **kw)


def test_values_equal_eager_construction_and_the_optimizer_follows() -> None:
    torch.manual_seed(7)
    eager = Net()
    torch.manual_seed(123)  # (the generator's state before does not matter: seeded)
    with torch.device("meta"):
        lazy = Net()
    opt = torch.optim.Adam(lazy.parameters(), lr=0.1)
    dm = wrap(lazy, opt, materialize=MetaInit(seed=7))
    assert eager.state_dict().keys() == lazy.state_dict().keys()
    for k, v in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[k], v), k
    assert lazy.out.weight is lazy.emb.weight
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in lazy.parameters()]
    x = torch.randint(0, 50, (4,))
    before = lazy.body[0].weight.detach().clone()
    dm(x).sum().backward()
    opt.step()
    assert not torch.equal(lazy.body[0].weight, before)  # the optimizer updates the model


def test_refusals_name_the_module_and_the_fix() -> None:
    with torch.device("meta"):
        lazy = Net()
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    with pytest.raises(StratagemError, match="meta device") as err:
        wrap(lazy, opt)
    assert "MetaInit" in err.value.fix

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    with torch.device("meta"):
        bad = NoReset()
    with pytest.raises(StratagemError, match="no reset_parameters") as err:
        wrap(bad, torch.optim.SGD(bad.parameters(), lr=0.1), materialize=MetaInit())
    assert "NoReset.reset_parameters" in err.value.fix


def test_init_callback_replaces_reset_parameters() -> None:
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen = []

    def init(name: str, m: nn.Module) -> None:
        seen.append(name)
        for p in m.parameters(recurse=False):
            p.fill_(0.5)

    wrap(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1),
         materialize=MetaInit(seed=None, init=init))
    assert seen == ["0", "1"]
    assert all(torch.all(p == 0.5) for p in lazy.parameters())


def test_autodist_refuses_a_meta_model_with_the_recipe() -> None:
    import stratagem as sg

    ad = sg.AutoDist(strategy_builder="AllReduce", verbose=False)
    with torch.device("meta"):
        lazy = Net()
    with pytest.raises(StratagemError, match="meta device") as err:
        ad.distribute(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1))
    assert "materialize=MetaInit" in err.value.fix
