"""The peak-memory estimate, memory limits in the spec, and Auto's choice under them
(no processes: estimated costs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import ResourceSpecError, StratagemError
from stratagem.planner import estimate_memory, plan_from_profile
from stratagem.planner.memory import (
    BACKWARD_UNITS,
    activation_bytes,
    check_rescale_fits,
    rescale_memory,
    state_per_element,
)
from stratagem.resource import ResourceSpec, parse_size
from stratagem.strategy import AllReduce, Auto
from stratagem.strategy.builders import ZeRO


class Blocks(nn.Module):
    """``n`` equal blocks of one ``width`` x ``width`` matrix each (16 KiB each in fp32
    at 64)."""

    def __init__(self, n: int = 4, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


P = 4 * 64 * 64 * 4  # parameter bytes
UNIT = 64 * 64 * 4


def spec(world: int, **node: object) -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": world,
                                              **node}]})


def test_sizes_parse_and_bad_ones_name_the_field() -> None:
    assert parse_size("6GiB") == 6 * 2**30
    assert parse_size("512 MB") == 512 * 10**6
    assert parse_size("1.5KiB") == 1536
    assert parse_size(4096) == 4096
    s = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": 2,
                                           "memory": "1GiB"}], "memory_budget": "1GiB"})
    assert s.memory_limit() == (2**29, "memory_budget")
    assert ResourceSpec.from_dict(s.to_dict()).memory_limit() == s.memory_limit()
    assert spec(2).memory_limit() is None
    for bad, what in (("lots", "not a size"), (-5, "negative"), ("-1GiB", "negative"),
                      (0, "zero"), (True, "not a size"), ("1e3GiB", "not a size")):
        with pytest.raises(ResourceSpecError, match=what) as err:
            spec(1, memory=bad)
        assert "nodes[0].memory" in str(err.value)
    with pytest.raises(ResourceSpecError, match="memory_budget"):
        ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1"}], "memory_budget": "x"})


def test_an_in_process_rescale_keeps_the_users_memory_limits() -> None:
    # the spec an in-process rescale rebuilds for its new world keeps the limits: without
    # them Auto would re-plan a memory-limited job as if it had no limit
    two = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "workers": 1, "memory": "3GiB", "chief": True},
        {"address": "10.0.0.2", "workers": 1, "memory": "2GiB"}]})
    one = ResourceSpec.of_job(1, 1)
    assert one.memory_limit() is None
    assert one.with_memory_of(two).memory_limit() == (2 * 2**30, "nodes[0].memory")
    budget = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": 4}],
                                     "memory_budget": "8GiB"})
    # a budget is the whole job's: each of fewer workers may use a larger share
    assert ResourceSpec.of_job(2, 1).with_memory_of(budget).memory_limit() == (
        4 * 2**30, "memory_budget")
    assert two.with_memory_of(spec(2)).memory_limit() is None  # no limit stays no limit


def test_estimate_by_stage_known_answers() -> None:
    profile = analyze(Blocks())
    w = 4
    rep = estimate_memory(AllReduce().build(profile, spec(w)), profile, w,
                          state_elements=2, activations=100)
    assert rep.items == {"parameters": P, "gradients": P, "optimizer state": 2 * P,
                         "activations": 100, "gathered units": 0, "comm buffers": P}
    z1 = estimate_memory(ZeRO(stage=1).build(profile, spec(w)), profile, w)
    assert (z1.items["parameters"], z1.items["gradients"], z1.items["optimizer state"]) == (
        P, P, 2 * UNIT)  # four equal parameters: one each
    z2 = estimate_memory(ZeRO(stage=2).build(profile, spec(w)), profile, w)
    assert z2.items["gradients"] == UNIT + 2 * UNIT  # own + one reduce in flight
    z3 = estimate_memory(ZeRO(stage=3).build(profile, spec(w)), profile, w)
    assert (z3.items["parameters"], z3.items["gradients"], z3.items["optimizer state"]) == (
        P // w, P // w, 2 * P // w)
    assert z3.items["gathered units"] == BACKWARD_UNITS * UNIT
    kept = estimate_memory(ZeRO(stage=3, reshard_after_forward=False).build(
        profile, spec(w)), profile, w)
    assert kept.items["gathered units"] == P + BACKWARD_UNITS * UNIT
    assert rep.peak > z1.peak > z2.peak


def test_optimizer_kinds_and_activations() -> None:
    m = Blocks()
    assert state_per_element(torch.optim.Adam(m.parameters())) == 2
    assert state_per_element(torch.optim.SGD(m.parameters(), lr=0.1)) == 0
    assert state_per_element(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == 1
    assert state_per_element(None) == 2
    # tanh saves its output (8 x 64 floats) per block; the weights' views are not counted.
    assert activation_bytes(m, torch.randn(8, 64)) == 4 * 8 * 64 * 4 + 8 * 64 * 4


def test_no_limit_leaves_auto_unchanged() -> None:
    profile = analyze(Blocks())
    base = plan_from_profile(Auto(), profile, spec(4))
    roomy = plan_from_profile(Auto(), profile, spec(4, memory="1GiB"))
    assert base.builder == roomy.builder
    assert [nc.to_dict() for nc in base.node_config] == [nc.to_dict()
                                                         for nc in roomy.node_config]


@pytest.mark.parametrize("units, builder", [(40, "ZeRO-2"), (26, "ZeRO-3")])
def test_auto_picks_the_fastest_that_fits(units: int, builder: str) -> None:
    big = 2**20  # 512 x 512 fp32 blocks: 1 MiB units, so that the reserve is 2 units
    profile = analyze(Blocks(16, width=512))
    # 16 units on 4 workers: replicated 80 units; ZeRO-1 16 + 16 + 8 + 16 (buffer) = 56;
    # ZeRO-2 16 + (4 + 2) + 8 = 30; ZeRO-3 4 + 4 + 8 + 5 gathered = 21. A candidate fits
    # when 1.05 x its estimate + 2 (the reserve) is within the limit: ZeRO-2 33.5 units,
    # ZeRO-3 24.05.
    s = plan_from_profile(Auto(), profile, spec(4, memory=units * big))
    assert s.builder == builder and s.sharded_parameters == sorted(profile.names)


def test_margin_and_reserve_known_answer() -> None:
    from stratagem.planner.memory import MARGIN, RESERVE, MemoryEstimate, fits

    e = MemoryEstimate(items={"parameters": 100 * 2**20})
    edge = int(100 * 2**20 * (1 + MARGIN)) + RESERVE
    assert fits(e, edge) and not fits(e, edge - 1)
    # 24.05 units fit 25 MiB; the estimate alone (21 units) would have fitted 22 MiB too.
    profile = analyze(Blocks(16, width=512))
    with pytest.raises(StratagemError, match="no strategy fits"):
        plan_from_profile(Auto(), profile, spec(4, memory=22 * 2**20))


def test_nothing_fits_names_peak_limit_items_and_what_would() -> None:
    profile = analyze(Blocks(width=512))  # 4 MiB of parameters
    # 2 workers' ZeRO-3: 2 + 2 + 4 + 5 gathered = 13 MiB; 4 workers': 9 MiB, which fits
    # 12 MiB with the margin and reserve (11.45)
    with pytest.raises(StratagemError) as err:
        plan_from_profile(Auto(), profile, spec(2, memory=12 * 2**20))
    text = str(err.value)
    assert "nodes[0].memory" in text and "no strategy fits" in text
    assert "limit 12.0 MiB" in text and "optimizer state" in text
    assert "4 workers with ZeRO-3" in text


def test_limit_below_one_shard_is_refused() -> None:
    profile = analyze(Blocks())
    with pytest.raises(StratagemError, match="less than one worker's shard") as err:
        plan_from_profile(Auto(), profile, spec(2, memory=UNIT // 4))
    assert "nodes[0].memory" in str(err.value)


def test_max_zero_stage_keeps_auto_to_stages_that_rescale_within_the_limit() -> None:
    # (an in-process elastic job gets 2: a stage-3 rescale gathers everything whole)
    # the 26-unit limit of test_auto_picks_the_fastest_that_fits: only ZeRO-3 fits there
    big = 2**20
    profile = analyze(Blocks(16, width=512))
    assert plan_from_profile(Auto(), profile, spec(4, memory=26 * big)).builder == "ZeRO-3"
    with pytest.raises(StratagemError, match="no strategy fits"):
        plan_from_profile(Auto(max_zero_stage=2), profile, spec(4, memory=26 * big))
    # where ZeRO-2 fits, the cap changes nothing
    assert plan_from_profile(Auto(max_zero_stage=2), profile,
                             spec(4, memory=40 * big)).builder == "ZeRO-2"


@pytest.mark.parametrize("bad", [0, 4, True, "3"])
def test_max_zero_stage_must_be_a_stage(bad: object) -> None:
    with pytest.raises(StratagemError, match="max_zero_stage"):
        Auto(max_zero_stage=bad)  # type: ignore[arg-type]


def test_rescale_gather_known_answer() -> None:
    """Stage 3 on 4 workers, Adam, at a step boundary: each worker's quarter of the
    parameters, gradients and state, then the whole parameters and whole state gathered."""
    profile = analyze(Blocks())
    s = ZeRO(stage=3).build(profile, ResourceSpec.local(1))
    got = rescale_memory(s, profile, 4, state_elements=2)
    assert got.items == {"parameters": P // 4 + P, "gradients": P // 4,
                         "optimizer state": 2 * P, "comm buffers": 0}
    # stages 1/2 gather no parameters: the owners' state, whole on every worker
    s2 = ZeRO(stage=2).build(profile, ResourceSpec.local(1))
    assert rescale_memory(s2, profile, 4, state_elements=2).items["parameters"] == P


def test_stage3_rescale_that_does_not_fit_is_refused_naming_both_figures() -> None:
    profile = analyze(Blocks())
    s = ZeRO(stage=3).build(profile, ResourceSpec.local(1))
    adam = torch.optim.Adam(Blocks().parameters())
    # the gather's peak is 3.5 P (known answer above), with Auto's margin and reserve
    need = int(3.5 * P * 1.05) + 2 * 2**20
    tight = spec(4, memory=need - 1024)
    with pytest.raises(StratagemError, match="in-process rescale") as err:
        check_rescale_fits(s, profile, tight, 4, adam)
    assert "nodes[0].memory" in str(err.value) and "optimizer state" in str(err.value)
    assert "ZeRO(stage=2)" in err.value.fix and "checkpoint-restart" in err.value.fix
    check_rescale_fits(s, profile, spec(4, memory=need + 1024), 4, adam)  # room: fine
    check_rescale_fits(s, profile, spec(4), 4, adam)  # no limit: nothing to check
    s2 = ZeRO(stage=2).build(profile, ResourceSpec.local(1))
    check_rescale_fits(s2, profile, tight, 4, adam)  # no stage 3: not this check's
