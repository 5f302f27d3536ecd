"""The auto-strategy benchmark's zoo and harness (bench/zoo.py, bench/auto_strategy.py):
models train, every built-in builder accepts them, the ratios are computed right, and the
quick loopback mode runs end to end (no wall-time assertions: see bench/)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _load import patience

from stratagem.analysis import analyze
from stratagem.errors import StratagemError
from stratagem.resource import ResourceSpec
from stratagem.strategy import AllReduceSynchronizer, PSSynchronizer, validate

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import auto_strategy  # noqa: E402
from zoo import MODEL_NAMES, zoo  # noqa: E402

TINY = zoo(tiny=True)
TWO_NODES = ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "workers": 1, "chief": True},
                                              {"address": "10.0.0.2", "workers": 1}]})


def test_zoo_has_the_issue_models() -> None:
    assert set(MODEL_NAMES) == {"cnn", "transformer_lm", "dlrm", "lstm_lm", "wide_deep",
                                "many_small", "hybrid"}
    assert set(TINY) == set(MODEL_NAMES)
    assert len(list(analyze(zoo()["many_small"].make()).params)) >= 200  # hundreds of tensors


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_zoo_model_trains_one_step_on_deterministic_data(name: str) -> None:
    z = TINY[name]
    first, again = z.data(2, 7).batches(3), z.data(2, 7).batches(3)
    for a, b in zip(first, again, strict=True):  # the same batch from (seed, step, rank)
        assert all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs, strict=True))
        assert torch.equal(a.target, b.target)
    assert not torch.equal(first[0].inputs[0], first[1].inputs[0])  # ranks differ
    torch.manual_seed(0)
    model = z.make()
    before = {k: t.clone() for k, t in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = z.loss(model(*first[0].inputs), first[0].target)
    loss.backward()
    opt.step()
    assert math.isfinite(float(loss.detach()))
    assert all(p.grad is not None for p in model.parameters())
    assert any(not torch.equal(before[k], t) for k, t in model.state_dict().items())


def test_tied_and_sampled_models_are_what_the_issue_asks() -> None:
    lm = analyze(TINY["transformer_lm"].make())
    assert any(p.aliases for p in lm.params)  # input and output embedding tied
    z = zoo(tiny=False)["lstm_lm"]
    assert z.config["vocab"] == 200_000 and z.config["output_layer_bytes"] > 100e6


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_builtin_builder_accepts_the_zoo_model(name: str) -> None:
    profile = analyze(TINY[name].make())
    builders = auto_strategy.builtin_builders()
    assert {"AllReduce", "PS", "PartitionedPS", "Parallax", auto_strategy.FP16} <= set(builders)
    ddp_engine = (auto_strategy.DDP_ENGINE, auto_strategy.DDP_ENGINE_FP16)
    for label, builder in builders.items():
        if label in ddp_engine and any(p.sparse for p in profile.params):
            # torch's DDP reducer takes no sparse gradient: refused, naming the fix
            with pytest.raises(StratagemError, match="sparse"):
                validate(builder.build(profile, TWO_NODES), profile, TWO_NODES)
            continue
        strategy = validate(builder.build(profile, TWO_NODES), profile, TWO_NODES)
        assert {nc.var_name for nc in strategy.node_config} == {p.name for p in profile.params}, \
            label
    parallax = builders["Parallax"].build(profile, TWO_NODES)
    hybrid = auto_strategy.with_compressor(parallax, "fp16", auto_strategy.HYBRID)
    validate(hybrid, profile, TWO_NODES)


def _leaf_syncs(strategy: Any, name: str) -> list[Any]:
    return [leaf.synchronizer for leaf in strategy.config_for(name).leaves()]


def test_hybrid_model_needs_what_no_builtin_gives() -> None:
    """Parallax sends the hybrid model's embedding to servers but all-reduces the tower
    uncompressed; the hand-made reference compresses the tower and keeps the servers."""
    profile = analyze(TINY["hybrid"].make())
    parallax = auto_strategy.builtin_builders()["Parallax"].build(profile, TWO_NODES)
    assert all(isinstance(s, PSSynchronizer) for s in _leaf_syncs(parallax, "embedding.weight"))
    tower = _leaf_syncs(parallax, "tower.0.weight")
    assert all(isinstance(s, AllReduceSynchronizer) and s.compressor == "none" for s in tower)
    hybrid = auto_strategy.with_compressor(parallax, "fp16", auto_strategy.HYBRID)
    assert all(s.compressor == "fp16" for s in _leaf_syncs(hybrid, "tower.0.weight"))
    assert all(isinstance(s, PSSynchronizer) for s in _leaf_syncs(hybrid, "embedding.weight"))
    keys = {auto_strategy.strategy_key(b.build(profile, TWO_NODES))
            for b in auto_strategy.builtin_builders().values()}
    assert auto_strategy.strategy_key(hybrid) not in keys


def test_case_ratios_known_answer() -> None:
    recs = {
        "AllReduce": {"median_step_s": 0.4, "prediction_error": 0.1},
        "Parallax": {"median_step_s": 0.2, "prediction_error": 0.3},
        "PartitionedAR": {"median_step_s": 0.4, "prediction_error": 0.1, "same_as": "AllReduce"},
        "PS": {"status": "unavailable: boom"},
        "DDP": {"median_step_s": 0.5},
        "HybridRef": {"median_step_s": 0.1, "prediction_error": 0.2},
        "Auto": {"median_step_s": 0.15, "prediction_error": 0.05},
        "AllReduce_fp16": {"median_step_s": 0.16},
        "Auto_fp16": {"median_step_s": 0.12},
    }
    r = auto_strategy.case_ratios(recs)
    assert r["best_builtin"] == "AllReduce_fp16" and r["best_builtin_step_s"] == 0.16
    assert r["best_lossless_builtin"] == "Parallax" and r["auto_over_best_lossless"] == 0.75
    assert r["auto_fp16_over_best_builtin"] == 0.75
    del recs["AllReduce_fp16"], recs["Auto_fp16"]
    r = auto_strategy.case_ratios(recs)
    assert r["best_builtin"] == "Parallax" and r["best_builtin_step_s"] == 0.2
    assert r["auto_fp16_over_best_builtin"] is None
    assert r["auto_over_best_builtin"] == 0.75 and r["auto_over_ddp"] == 0.3
    assert r["hybrid_ref_over_best_builtin"] == 0.5 and r["ddp_over_best_builtin"] == 2.5
    # duplicates (same_as) count once: errors 0.1, 0.3, 0.2, 0.05
    assert r["prediction_error_median"] == 0.15 and r["prediction_error_max"] == 0.3


def test_merge_adds_cases_and_replaces_remeasured(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    auto_strategy.merge(out, {"commit": "a", "cases": {"x/2n/1gbit": {"v": 1},
                                                       "y/2n/1gbit": {"v": 2}}}, {})
    res = auto_strategy.merge(out, {"commit": "b", "cases": {"x/2n/1gbit": {"v": 3}}}, {})
    assert res["cases"]["x/2n/1gbit"] == {"v": 3, "commit": "b", "date": None}
    assert res["cases"]["y/2n/1gbit"]["v"] == 2 and json.loads(out.read_text()) == res


@pytest.mark.slow
def test_quick_mode_runs_on_loopback(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "auto_strategy.py"), "--loopback", "2", "--tiny",
         "--models", "many_small", "hybrid", "--builders", "AllReduce", "Parallax",
         "HybridRef", "--steps", "2", "--warmup", "1", "--out", str(out),
         "--auto-builder", "PartitionedPS",  # stands in for the planner: the Auto path runs
         "--confirm-s", "1"],
        capture_output=True, text=True, timeout=patience(240))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["cases"]) == {"many_small/2n/loopback", "hybrid/2n/loopback"}
    hybrid = res["cases"]["hybrid/2n/loopback"]
    for name in ("AllReduce", "Parallax", "HybridRef", "DDP"):
        v = hybrid["variants"][name]
        assert v["status"] == "ok" and v["median_step_s"] > 0 and len(v["step_s"]) == 2, name
    assert hybrid["best_builtin"] in ("AllReduce", "Parallax")
    small = res["cases"]["many_small/2n/loopback"]
    assert small["variants"]["Parallax"]["same_as"] == "AllReduce"  # no sparse parameter
    auto = hybrid["variants"]["Auto"]
    assert auto["status"] == "ok" and auto["median_step_s"] > 0
    assert hybrid["auto_over_best_builtin"] == pytest.approx(
        auto["median_step_s"] / hybrid["best_builtin_step_s"], rel=1e-3)
    assert hybrid["auto_build_s"] > 0 and res["planner"]["auto_builder"] == "PartitionedPS"
    if not res["planner"]["predict_step_time"]:
        assert auto["predicted_step_s"] is None and auto["prediction"] == "planner not available"
    for case in res["cases"].values():  # a slower Auto re-measured: at least the case's steps
        for pair in (case.get("confirm") or {}).get("pairs", []):
            assert case["confirm"]["steps"] >= 2
            lo, hi = pair["ratio_ci90"]
            assert 0 < lo <= hi and len(pair["step_s"][pair["builtin"]]) >= 2


def test_predict_all_keeps_good_predictions_and_reports_bad_ones() -> None:
    def fake(model: Any, strategy: str, spec: Any, batch: int, sample_input: Any = None
             ) -> float:
        assert model == "m" and spec == "spec" and batch == 8 and sample_input == ("x",)
        return {"a": 0.25, "b": float("nan")}[strategy]

    preds, errors = auto_strategy.predict_all(fake, "m", {"A": "a", "B": "b", "C": "c"},
                                              "spec", 8, ("x",))
    assert preds == {"A": 0.25, "B": None, "C": None}
    assert set(errors) == {"B", "C"} and "nan" in errors["B"] and "KeyError" in errors["C"]


def test_targets_known_answer() -> None:
    def case(model: str, nodes: int, ratio: float | None, ddp: float | None,
             errs: list[float], build: float | None) -> dict[str, Any]:
        return {"model": model, "nodes": nodes, "auto_over_best_lossless": ratio,
                "auto_fp16_over_best_builtin": None if ratio is None else ratio - 0.1,
                "auto_over_ddp": ddp, "auto_build_s": build,
                "variants": {f"v{i}": {"prediction_error": e} for i, e in enumerate(errs)}}

    cases = {"a": case("cnn", 2, 0.9, 1.0, [0.1, 0.2], 5.0),
             "b": case("hybrid", 2, 0.8, 0.7, [0.05], 12.0),
             "c": case("lstm_lm", 4, 1.1, 0.5, [0.4], 41.0)}
    got = {t["target"]: (t["value"], t["met"]) for t in auto_strategy.targets(cases)}
    assert got["Auto / best lossless built-in, worst case"] == (1.1, False)
    assert got["Auto_fp16 / best built-in (fp16 included), worst case"] == (
        pytest.approx(1.0), True)
    assert got["cases with Auto / best lossless built-in < 0.95"] == (2, False)
    assert got["LSTM LM, 4 nodes: DDP / Auto"] == (2.0, True)
    assert got["prediction error, median"] == (0.15, True)
    assert got["prediction error, worst"] == (0.4, False)
    assert got["Auto build (calibration + planning) s, worst"] == (41.0, False)
    # a slower case re-measured alone on fresh steps is judged by the confirmed ratio
    cases["c"]["confirm"] = {"pairs": [{"auto": "Auto", "builtin": "PS", "ratio": 1.02}]}
    got = {t["target"]: (t["value"], t["met"]) for t in auto_strategy.targets(cases)}
    assert got["Auto / best lossless built-in, worst case"] == (1.1, False)
    assert got["Auto / best lossless built-in, worst case, slower cases confirmed on "
               "fresh steps"] == (1.02, True)
    assert got["Auto_fp16 / best built-in, worst case, slower cases confirmed on fresh "
               "steps"] == (pytest.approx(1.0), True)  # none confirmed: the main run's
    assert "1.10 → 1.02" in auto_strategy.summary_markdown(
        {"cases": {k: {**c, "link": "1gbit", "best_builtin": "PS", "auto_over_ddp": 1.0,
                       "hybrid_ref_over_best_builtin": None, "ddp_over_best_builtin": None,
                       "prediction_error_median": None, "prediction_error_max": None}
                   for k, c in cases.items()}})
    none = {t["target"]: t["met"] for t in auto_strategy.targets(
        {"a": case("cnn", 2, None, None, [], None)})}
    assert set(none.values()) == {None}  # no planner: nothing claimed


def test_repeat_errors_compare_a_trial_with_the_same_strategys_benchmark_steps() -> None:
    case = {"planner": {"Auto": {"trials": [
        {"name": "PS", "predicted_s": 0.01, "measured_s": 0.012},
        # measured as AllReduce (the same strategy)
        {"name": "Parallax", "predicted_s": 0.01, "measured_s": 0.030},
        {"name": "hybrid", "predicted_s": 0.01, "measured_s": 0.02},  # no such variant
        {"name": "PartitionedPS", "predicted_s": 0.01, "measured_s": None}]}},  # not run
        "variants": {"PS": {"median_step_s": 0.010},
                     "AllReduce": {"median_step_s": 0.040},
                     "Parallax": {"same_as": "AllReduce"},
                     "PartitionedPS": {"median_step_s": 0.02}}}
    assert auto_strategy.repeat_errors(case) == [pytest.approx(0.2), pytest.approx(0.25)]
    ref = next(t for t in auto_strategy.targets({"c": case})
               if t["target"].startswith("for reference"))
    assert ref["value"] == 0.25 and ref["met"] is None


def test_ratio_interval_brackets_the_ratio_of_medians() -> None:
    # constant steps: every resample has the same medians, so the interval is the ratio
    assert auto_strategy.ratio_interval([2.0] * 30, [1.0] * 30) == (2.0, 2.0)
    # the same steps on both sides (a tie): the interval holds 1, symmetric in log
    steps = [1.0 + 0.01 * (i % 7) for i in range(40)]
    lo, hi = auto_strategy.ratio_interval(steps, list(reversed(steps)))
    assert lo < 1.0 < hi
    assert lo == pytest.approx(1 / hi, rel=0.02)
    # a tenfold slower pair is outside any tie, and seeded: the same steps, the same answer
    slow = [10 * s for s in steps]
    assert auto_strategy.ratio_interval(slow, steps)[0] > 9
    assert auto_strategy.ratio_interval(slow, steps) == auto_strategy.ratio_interval(slow, steps)


def test_run_to_run_compares_strategies_measured_in_both_runs() -> None:
    def case(nodes: int, link: str, **variants: Any) -> dict[str, Any]:
        return {"nodes": nodes, "link": link, "variants": variants}

    earlier = {"a": case(2, "1gbit", PS={"median_step_s": 0.014},
                         AllReduce={"median_step_s": 0.020},
                         Parallax={"same_as": "AllReduce"},
                         Auto={"median_step_s": 0.010},
                         Auto_fp16={"median_step_s": 0.020}),
               "gone": case(4, "1gbit", PS={"median_step_s": 1.0})}
    later = {"a": case(2, "1gbit", PS={"median_step_s": 0.010, "prediction_error": 0.5},
                       AllReduce={"median_step_s": 0.025, "prediction_error": 0.1},
                       Parallax={"median_step_s": 0.020},  # '=' in the earlier run
                       Auto={"same_as": "PS"},  # '=' in the later one
                       Auto_fp16={"median_step_s": 0.010},  # Auto's: may differ
                       DDP={"median_step_s": 0.010}),  # not in the earlier run
             "new": case(4, "10gbit", PS={"median_step_s": 1.0})}
    rows = auto_strategy.run_to_run(earlier, later)
    assert [(r["variant"], round(r["difference"], 6)) for r in rows] == [("PS", 0.4),
                                                                        ("AllReduce", 0.2)]
    table = auto_strategy.run_to_run_markdown(rows)
    assert "| 2 nodes 1gbit | 2 | 0.30 | 0.40 | 1 | 0.30 | 0.50 | 1 |" in table
    assert "| all | 2 |" in table


def test_planner_record_of_a_real_choice() -> None:
    """What the workers record of Auto's choice (its groups, its engine and why) is built
    from a planner Choice without error: an exception there made rank 0 alone drop the
    Auto variant, and the ranks' variant lists parted (the job died)."""
    from stratagem.planner.calibrate import estimate
    from stratagem.planner.search import search

    profile = analyze(TINY["cnn"].make())
    choice = search(profile, TWO_NODES, estimate(profile, 8))
    groups = auto_strategy._chosen_groups(choice)
    covered = {p for g in groups for p in g.get("params", ())}
    assert covered == {p.name for p in profile.params}
    assert auto_strategy._engine_why(choice).startswith("engine: ")
