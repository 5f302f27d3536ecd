"""The strategy and builder reference pages say what the code does."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from torch import nn

from stratagem.analysis import ModelProfile, analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduce,
    PartitionedAR,
    RandomAxisPartitionAR,
    Strategy,
    builder_from_name,
    validate,
)
from stratagem.strategy.builders import base

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "docs" / "reference"


def blocks(page: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (REF / page).read_text(), re.S | re.M)


@pytest.fixture(scope="module")
def small() -> ModelProfile:
    return analyze(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)))


@pytest.fixture(scope="module")
def local() -> ResourceSpec:
    return ResourceSpec.from_file(ROOT / "examples" / "specs" / "local.yml")


def test_schema_json_example_is_what_the_builder_writes(small: ModelProfile,
                                                        local: ResourceSpec) -> None:
    (text,) = blocks("strategy-schema.md", "json")
    built = AllReduce(chunk_size=2).build(small, local)
    assert json.loads(text) == built.to_dict()


@pytest.mark.parametrize("lang", ["json", "yaml"])
def test_schema_examples_parse_and_validate(small: ModelProfile, local: ResourceSpec,
                                            lang: str) -> None:
    found = blocks("strategy-schema.md", lang)
    assert found
    for text in found:
        s = Strategy.from_dict(yaml.safe_load(text), source=f"strategy-schema.md ({lang})")
        assert validate(s, small, local) is s
        assert Strategy.from_dict(yaml.safe_load(s.to_yaml())) == s


def test_schema_mixed_example_is_mixed(small: ModelProfile) -> None:
    (text,) = blocks("strategy-schema.md", "yaml")
    s = Strategy.from_dict(yaml.safe_load(text))
    w = s.config_for("0.weight")
    assert w.partitioner.part_sizes(small.get("0.weight").shape) == [3, 2, 1]
    kinds = {type(leaf.synchronizer).__name__ for nc in s.node_config for leaf in nc.leaves()}
    assert kinds == {"AllReduceSynchronizer", "PSSynchronizer"}


def test_schema_error_example_is_real() -> None:
    (text,) = [b for b in blocks("strategy-schema.md", "text") if "fix:" in b]
    data = {"node_config": [{"var_name": "w", "synchronizer": {"type": "AllReduce",
                                                               "grp": 1}}]}
    with pytest.raises(StrategyError) as err:
        Strategy.from_dict(data, source="plan.yaml")
    assert str(err.value) == text.strip()


def summary_body(s: Strategy) -> str:
    return "\n".join(s.summary().splitlines()[1:])


@pytest.mark.parametrize(
    ("builder", "index"),
    [(AllReduce(chunk_size=2), 0), (PartitionedAR(), 1)],
)
def test_builder_page_summaries(small: ModelProfile, local: ResourceSpec, builder: object,
                                index: int) -> None:
    text = blocks("builders.md", "text")[index]
    s = builder.build(small, local)
    assert text.strip().splitlines()[0].endswith(f"(builder {s.builder}, 2 replicas)")
    assert "\n".join(text.strip().splitlines()[1:]) == summary_body(s)


def test_builder_page_claims(small: ModelProfile, local: ResourceSpec) -> None:
    s = PartitionedAR(chunk_size=1).build(small, local)
    assert [leaf.synchronizer.group for nc in s.node_config for leaf in nc.leaves()] == [
        0, 1, 2, 3, 4, 5]
    assert str(RandomAxisPartitionAR(seed=0).build(small, local)
               .config_for("0.weight").partitioner) == "1,2"
    for name in ("PS", "PSLoadBalancing", "PartitionedPS", "UnevenPartitionedPS",
                 "Parallax"):
        assert builder_from_name(name).build(small, local).builder == name


def test_builder_page_custom_builder_example(small: ModelProfile, local: ResourceSpec
                                             ) -> None:
    (code,) = [b for b in blocks("builders.md", "python") if "@register" in b]
    try:
        namespace: dict = {}
        exec(compile(code, "builders.md", "exec"), namespace)
        s = builder_from_name("onegroup").build(small, local)
        assert validate(s, small, local) is s
        assert {nc.synchronizer.group for nc in s.node_config} == {0}
    finally:
        base._REGISTRY.pop("OneGroup", None)


def test_schema_runtime_notes_are_true(small: ModelProfile, local: ResourceSpec) -> None:
    import torch

    from stratagem.runtime.plan import compile_plan

    def compile_(s: Strategy) -> object:
        return compile_plan(s, small, rank=0, world_size=2, device=torch.device("cpu"))

    (text,) = blocks("strategy-schema.md", "yaml")
    with pytest.raises(StrategyError, match="parts of one parameter mix AllReduce and PS"):
        compile_(Strategy.from_dict(yaml.safe_load(text)))
    s = AllReduce().build(small, local)
    first = s.node_config[0]
    mixed = replace(first, synchronizer=replace(first.synchronizer, compressor="bf16"))
    with pytest.raises(StrategyError, match="group 0 mixes compressor"):
        compile_(replace(s, node_config=(mixed, *s.node_config[1:])))
    compile_(s)
