"""Fuzzing the loaders of user-written files (hypothesis): whatever a resource spec, a
strategy or a checkpoint's meta.json holds, loading it either works or raises the module's
StratagemError with a fix, within a second (hypothesis' deadline): never another exception,
a hang or unbounded memory."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratagem import checkpoint
from stratagem.errors import CheckpointError, ResourceSpecError, StrategyError
from stratagem.resource import NODE_FIELDS, SSH_FIELDS, TOP_FIELDS, ResourceSpec
from stratagem.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=100, deadline=timedelta(seconds=1),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

STRATEGY_FIELDS = ("version", "id", "builder", "graph_config", "replicas", "node_config",
                   "var_name", "synchronizer", "partitioner", "part_sizes", "part_config",
                   "type", "AllReduce", "PS", "spec", "compressor", "group", "powersgd_rank",
                   "reduction_destination", "local_replication", "sync", "staleness")
META_FIELDS = ("format", "world_size", "time", "sha256", "states", "metadata", "seq",
               "model.pt", "per_rank")

scalars = (st.none() | st.booleans() | st.integers(-3, 70_000) | st.integers()
           | st.floats() | st.text(max_size=12)
           | st.sampled_from(["10.0.0.1", "-V", "127.0.0.1", "a" * 64, "2,1", "0" * 64]))


def values(field_names: tuple[str, ...]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(field_names) | st.text(max_size=6) | st.integers(-2, 2)
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(keys, kids, max_size=5), max_leaves=25)


def paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    out = [prefix]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) \
        if isinstance(tree, list) else []
    for key, child in items:
        out += paths(child, (*prefix, key))
    return out


def mutated(base: Any, data: st.DataObject, field_names: tuple[str, ...]) -> Any:
    """``base`` with one value (anywhere, or the whole) replaced by a random one."""
    tree = copy.deepcopy(base)
    path = data.draw(st.sampled_from(paths(tree)))
    new = data.draw(values(field_names))
    if not path:
        return new
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return tree


def yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True)


def assert_clean(error: Exception, kind: type[Exception]) -> None:
    assert isinstance(error, kind), repr(error)
    assert getattr(error, "fix", None), repr(error)


# -- resource specs ------------------------------------------------------------------------
SPEC = yaml.safe_load((ROOT / "examples" / "specs" / "gpu-cluster.yml").read_text())
SPEC_FIELDS = NODE_FIELDS + SSH_FIELDS + TOP_FIELDS + ("gpu",)


def load_spec(text: str) -> None:
    try:
        ResourceSpec.from_yaml(text, source="fuzz.yml")
    except Exception as exc:  # noqa: BLE001 - the point: which exception
        assert_clean(exc, ResourceSpecError)


@FUZZ
@given(st.text(max_size=300))
def test_spec_from_any_text(text: str) -> None:
    load_spec(text)


@FUZZ
@given(st.data())
def test_spec_with_one_value_changed(data: st.DataObject) -> None:
    load_spec(yaml_text(mutated(SPEC, data, SPEC_FIELDS)))


@FUZZ
@given(st.text(alphabet="[]{}&*!|>-: ,\n'\"#abc0129.", max_size=120))
def test_spec_from_yaml_syntax_soup(text: str) -> None:
    load_spec("nodes:\n  - address: 10.0.0.1\n    ssh_config: " + text)


# -- strategies ----------------------------------------------------------------------------
MIXED = yaml.safe_load((ROOT / "examples" / "strategies" / "mlp-mixed.yaml").read_text())


def load_strategy(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    try:
        Strategy.load(path)
    except Exception as exc:  # noqa: BLE001
        assert_clean(exc, StrategyError)


@FUZZ
@given(st.text(max_size=300))
def test_strategy_from_any_text(tmp_path: Path, text: str) -> None:
    load_strategy(tmp_path, text)


@FUZZ
@given(st.data())
def test_strategy_with_one_value_changed(tmp_path: Path, data: st.DataObject) -> None:
    changed = mutated(MIXED, data, STRATEGY_FIELDS)
    load_strategy(tmp_path, yaml_text(changed))
    try:
        Strategy.from_dict(changed)
    except Exception as exc:  # noqa: BLE001
        assert_clean(exc, StrategyError)


# -- checkpoint meta.json ------------------------------------------------------------------
def check_meta(directory: Path, raw: bytes) -> None:
    (directory / "meta.json").write_bytes(raw)
    try:
        checkpoint.verify(directory)
    except Exception as exc:  # noqa: BLE001
        assert_clean(exc, CheckpointError)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from torch import nn

    path = tmp_path_factory.mktemp("ck") / "ck"
    checkpoint.save(path, nn.Linear(2, 2), metadata={"step": 1})
    return path, json.loads((path / "meta.json").read_text())


@FUZZ
@given(st.binary(max_size=300))
def test_meta_json_from_any_bytes(saved: tuple[Path, dict[str, Any]], raw: bytes) -> None:
    check_meta(saved[0], raw)


@FUZZ
@given(st.data())
def test_meta_json_with_one_value_changed(saved: tuple[Path, dict[str, Any]],
                                          data: st.DataObject) -> None:
    changed = mutated(saved[1], data, META_FIELDS)
    text = json.dumps(changed, allow_nan=True)
    check_meta(saved[0], text.encode())


def test_fuzzing_the_spec_would_catch_a_raw_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property is not vacuous: a loader that lets a raw error through fails it."""
    def broken(text: str, source: str = "") -> None:
        raise KeyError("raw")

    monkeypatch.setattr(ResourceSpec, "from_yaml", staticmethod(broken))
    with pytest.raises(AssertionError):
        load_spec("nodes: []")
