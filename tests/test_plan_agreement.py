"""Issue 49: `stratagem plan`'s three tellings of a strategy -- Auto's table of parameter
groups, the per-parameter list and the picture -- agree with each other and with what the
runtime executes, for every builder and Auto on every example model. (The table said
"gathered rows" where the list said AllReduce and the picture drew an all-reduce.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from stratagem.analysis import analyze  # noqa: E402
from stratagem.cli.plan import compiled, listing, load_model  # noqa: E402
from stratagem.cli.plan_picture import collect_blocks  # noqa: E402
from stratagem.errors import StrategyError  # noqa: E402
from stratagem.planner import Auto, choose, explain_json, explain_text  # noqa: E402
from stratagem.resource import ResourceSpec  # noqa: E402
from stratagem.runtime.plan import Route  # noqa: E402
from stratagem.strategy import (  # noqa: E402
    AllReduceSynchronizer,
    PSSynchronizer,
    ShardedSynchronizer,
    builder_names,
    resolve_builder,
    validate,
)

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models.py"
NAMES = ("mlp", "small_mlp", "Recommender", "TinyLM")
TABLE_KEY = {"all-reduce": "allreduce {unit}", "gathered rows": "gathered rows",
             "PS": "ps dense", "PS sparse rows": "ps rows", "sharded": "sharded {stage}"}
LIST_WORDS = {"all-reduce": "all-reduce group {unit} ", "gathered rows": "rows all-gathered",
              "PS": "PS -> rank {unit} ", "PS sparse rows": "PS sparse rows -> rank {unit} ",
              "sharded": "sharded stage {stage}"}


def _key(words: dict[str, str], r: Route) -> str:
    return words[r.kind].format(unit=r.unit, stage=r.how.removeprefix("stage "))


def _label(r: Route) -> str:
    return r.param if r.axis is None else f"{r.param}/part_{r.part}"


def _check(strategy, profile, spec, choice=None) -> None:  # noqa: ANN001
    plan = compiled(strategy, profile, spec)
    routes = plan.routes()
    # The plan is the runtime's: every piece travels the way its synchronizer says.
    syncs = {nc.var_name if not nc.partitioner else f"{nc.var_name}/part_{i}": leaf
             for nc in strategy.node_config
             for i, leaf in enumerate(nc.leaves())}
    for r in routes:
        s = syncs[_label(r)].synchronizer
        if isinstance(s, AllReduceSynchronizer):
            assert r.kind == ("gathered rows" if s.gather_rows else "all-reduce"), r
        elif isinstance(s, ShardedSynchronizer):
            assert r.kind == "sharded" and r.how == f"stage {s.stage}", r
            assert (r.unit < 0) == (s.stage == 3), r
        else:
            assert isinstance(s, PSSynchronizer) and r.kind.startswith("PS"), r
    assert {_label(r) for r in routes} == set(syncs)
    # The per-parameter list: one line per parameter, each piece in its route's words.
    lines = listing(strategy, plan)
    assert lines[0].startswith(f"strategy {strategy.id} ")
    by_param = {line.split(": ", 1)[0].strip(): line for line in lines[1:]}
    assert set(by_param) == {p.name for p in profile.params}
    for r in routes:
        assert _key(LIST_WORDS, r) in by_param[r.param], (r, by_param)
    # The picture: each piece once, in its route's colour and unit.
    leaves = {leaf.label: (leaf.kind, b.key) for b in collect_blocks(strategy, profile)
              for leaf in b.leaves}
    assert {k: v[0] for k, v in leaves.items()} == {_label(r): r.kind for r in routes}
    for r in routes:
        key = leaves[_label(r)][1]
        if r.kind == "sharded":
            assert key[1] == (f"unit {r.destination or '(root)'}" if r.unit < 0
                              else f"rank {r.unit}")
        else:
            assert key[1] == (r.destination if r.kind.startswith("PS")
                              else f"group {r.unit}")
    if choice is None:
        return
    # Auto's table of parameter groups (text and JSON): one row per unit of the plan.
    expected = {_key(TABLE_KEY, r) for r in routes}
    assert {g["group"] for g in explain_json(choice, plan=plan)["groups"]} == expected
    text = explain_text(choice, plan=plan)
    rows: list[list[str]] = []
    for line in text.split("parameter groups:\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]:
        if line[2:15].strip():
            rows.append(re.split(r"\s{2,}", line.strip()))
        else:  # the first parameter's name, wrapped onto the next line
            rows[-1][-1] += line.strip()
    shown = {row[0] for row in rows}
    assert shown == expected, (shown, expected)
    for key, _, n, _, first in rows:
        kinds = {r.kind for r in routes if _key(TABLE_KEY, r) == key}
        params = {r.param for r in routes if _key(TABLE_KEY, r) == key}
        assert len(kinds) == 1 and int(n) == len(params) and first in params


@pytest.mark.parametrize("model", NAMES)
def test_table_list_and_picture_agree_for_every_builder(model: str) -> None:
    profile = analyze(load_model(f"{MODELS}:{model}"))
    spec = ResourceSpec.local(2)
    for name in builder_names():
        if name == "Auto":
            choice = choose(load_model(f"{MODELS}:{model}"), spec, options=Auto())
            _check(validate(choice.strategy, profile, spec), profile, spec, choice)
        else:
            try:
                built = resolve_builder(name).build(profile, spec)
            except StrategyError as exc:  # a builder that cannot take this model says so
                assert exc.fix, (name, exc)
                continue
            _check(validate(built, profile, spec), profile, spec)


def test_auto_recommender_embedding_is_gathered_rows_everywhere() -> None:
    """The case the issue names: the Recommender's sparse embedding under Auto."""
    model = load_model(f"{MODELS}:Recommender")
    profile, spec = analyze(model), ResourceSpec.local(2)
    choice = choose(model, spec, options=Auto())
    strategy = validate(choice.strategy, profile, spec)
    plan = compiled(strategy, profile, spec)
    (route,) = [r for r in plan.routes() if r.param == "embedding.weight"]
    assert route.kind == "gathered rows"
    assert "embedding.weight: rows all-gathered" in "\n".join(listing(strategy, plan))
    kinds = {leaf.label: leaf.kind for b in collect_blocks(strategy, profile)
             for leaf in b.leaves}
    assert kinds["embedding.weight"] == "gathered rows"


@pytest.mark.parametrize("model", NAMES)
def test_the_profile_s_sparse_count_is_what_parallax_sends_as_rows(model: str) -> None:
    """Issue 49: the profile line said "0 sparse" for TinyLM while Parallax's plan sent its
    embedding as sparse rows; both now mean the same parameters."""
    profile = analyze(load_model(f"{MODELS}:{model}"))
    spec = ResourceSpec.local(2)
    strategy = validate(resolve_builder("Parallax").build(profile, spec), profile, spec)
    rows = {r.param for r in compiled(strategy, profile, spec).routes()
            if r.kind == "PS sparse rows"}
    assert {p.name for p in profile.params if p.sparse_access} == rows
    assert f"; {len(rows)} with sparse access: " in profile.summary()
