"""With no memory limit, Auto's candidates and choice on the bench zoo are what they were
before sharding existed (issue 45): the ZeRO builder is not among the search's candidates,
and the memory fit is not applied (estimated costs, no processes)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from stratagem.analysis import analyze
from stratagem.planner import choose, estimate
from stratagem.planner.search import search
from stratagem.resource import ResourceSpec
from stratagem.strategy import Auto
from stratagem.strategy.schema import ShardedSynchronizer

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from zoo import MODEL_NAMES, zoo  # noqa: E402

search_module = importlib.import_module("stratagem.planner.search")
TINY = zoo(tiny=True)
SPECS = {
    "one node": ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "workers": 4}]}),
    "two nodes": ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "workers": 2, "chief": True},
        {"address": "10.0.0.2", "workers": 2}]}),
}


def _summary(choice: Any) -> tuple[str, list[tuple[str, list[dict], float]]]:
    return choice.best.name, [(c.name, [nc.to_dict() for nc in c.strategy.node_config],
                               c.cost.total_s) for c in choice.candidates]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_no_limit_same_candidates_and_choice_as_without_sharding(
        name: str, spec_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS[spec_name]
    model = TINY[name].make()
    profile = analyze(model)
    cal = estimate(profile, Auto().batch_size)
    with_sharding = search(profile, spec, cal, Auto())
    # The registry as it was before the ZeRO builder existed.
    names = [n for n in search_module.builder_names() if n != "ZeRO"]
    monkeypatch.setattr(search_module, "builder_names", lambda: names)
    without = search(profile, spec, cal, Auto())
    assert _summary(with_sharding) == _summary(without)
    for c in with_sharding.candidates:
        assert not any(isinstance(nc.synchronizer, ShardedSynchronizer)
                       for nc in c.strategy.node_config), c.name
    # Auto's entry point with no limit: the memory fit does not run, nothing changes.
    import stratagem.planner as planner

    def no_fit(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("fit_memory ran without a memory limit")

    monkeypatch.setattr(planner, "fit_memory", no_fit)
    chosen = choose(model, spec, batch_size=Auto().batch_size, options=Auto(probe=False,
                                                                            trials=0))
    assert chosen.memory is None
    assert _summary(chosen) == _summary(without)
