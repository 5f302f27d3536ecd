"""The Auto builder: what it must and must not choose, and that its strategies train to
what one process trains (2 gloo workers)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import _spawn
import planner_workers as pw
import pytest
import torch
from _load import patience

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.planner import choose, explain_json, explain_text
from stratagem.planner.calibrate import estimate
from stratagem.planner.cost_model import predict
from stratagem.planner.links import LinkModel
from stratagem.planner.search import Hybrid, all_reduce_only, build_hybrid, search
from stratagem.planner.trial import (
    ALL_REDUCE,
    DOMINATED,
    FACTOR_RANGE,
    RACED,
    SERVERS,
    Trial,
    family,
    fastest,
    fit,
    passed_over,
    prefer_all_reduce,
    prefer_named,
    pull_factor,
    raced,
    second_look,
    shortlist,
)
from stratagem.resource import ResourceSpec
from stratagem.strategy import (
    AllReduceSynchronizer,
    Auto,
    NodeConfig,
    PSSynchronizer,
    Strategy,
    builder_from_name,
)


def spec(nodes: int, gbps: float = 1.0, workers: int = 1) -> ResourceSpec:
    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i + 1}", "chief": i == 0, "workers": workers,
         "network_bandwidth": gbps, "cpus": [0]} for i in range(nodes)]})


def syncs(strategy: Strategy, name: str) -> list:
    return [leaf.synchronizer for leaf in strategy.config_for(name).leaves()]


def dense_sample() -> torch.Tensor:
    return pw.batch("dense", 0)[0][0][:4]


@pytest.mark.parametrize(("nodes", "gbps"), [(2, 1.0), (4, 1.0), (2, 10.0), (4, 10.0)])
def test_dense_only_model_never_goes_to_parameter_servers(nodes: int, gbps: float) -> None:
    choice = choose(pw.make("dense"), spec(nodes, gbps), sample_input=dense_sample())
    for nc in choice.strategy.node_config:
        for leaf in nc.leaves():
            assert isinstance(leaf.synchronizer, AllReduceSynchronizer), nc.var_name


@pytest.mark.parametrize("nodes", [2, 4])
def test_embedding_dominated_model_never_all_reduces_the_dense_embedding(nodes: int) -> None:
    torch.manual_seed(0)
    model = pw.EmbeddingHeavy()
    ids = torch.randint(0, 20000, (32, 4))
    choice = choose(model, spec(nodes), sample_input=ids)
    assert all(isinstance(s, PSSynchronizer) for s in syncs(choice.strategy, "emb.weight"))
    access = choice.profile.access_of("emb.weight")
    assert access is not None and access.rows_touched <= 128  # found in calibration
    # the all-reduce of the whole table sends more and waits longer
    alt = {a["name"]: a for a in explain_json(choice)["alternatives"]}["AllReduce"]
    best = explain_json(choice)["predicted"]
    assert alt["predicted"]["exposed_comm_s"] > best["exposed_comm_s"]
    assert alt["why_lost"]


def test_sampled_output_layer_goes_as_rows_when_bytes_matter() -> None:
    """The output layer is declared dense (an nn.Linear) but a sampled softmax touches few
    of its rows: calibration finds that, and on a slow link Auto sends it as rows."""
    model = pw.make("sampled")
    (ids, cand), _ = pw.batch("sampled", 0)
    choice = choose(model, spec(2, gbps=0.001), sample_input=(ids[:4], cand))
    out = syncs(choice.strategy, "out.weight")
    assert all(isinstance(s, PSSynchronizer) and s.row_sparse and s.local_replication
               for s in out)
    assert choice.profile.access_of("out.weight").rows_touched < pw.VOCAB


@pytest.mark.parametrize("name,slow", [("sampled", True), ("dense", False)])
def test_auto_without_a_sample_plans_on_the_first_training_batch(tmp_path, name: str,  # noqa: ANN001
                                                                 slow: bool) -> None:
    """The model all-reduces until its first training batch, then switches to Auto's
    choice on it -- to parameter servers for the sampled softmax on slow links -- and
    trains to single-process SGD's parameters. (The dense model's steps take about a
    millisecond: there a parameter server's may measure faster than a ring's, and then
    the trials rightly keep it.)"""
    results = _spawn.run(pw.first_batch_case, 2, tmp_path, {"name": name, "slow": slow},
                         _spawn.Setup(args=(2,), local_rank=True, init_group=True))
    for r in results:
        assert r["before"] == "AllReduce"  # until the first training batch
        assert "after the first training step" in r["early"]
        assert not r["planned_early"]  # an evaluation forward does not plan
        assert r["strategy"] == results[0]["strategy"]
        assert "predicted step" in r["explain"]
        if slow or not r["ps"]:
            assert r["ps"] == slow, r["explain"]
        else:  # servers for a dense model only where its trial steps ran faster: in the
            # second look's race where one ran (it re-times the first trials' winner and
            # decides), else in the first trials
            final = [t for t in r["trial_s"] if t[2] == RACED] or r["trial_s"]
            best = {f: min(t for g, t, _ in final if g == f) for f, _, _ in final}
            assert best["parameter servers"] < best.get("all-reduce", float("inf")), \
                r["explain"]
        assert r["trials"] == 0 if slow else r["trials"] >= 2
        if r["ps"]:  # the announcement says what servers mean for .grad
            assert any(".grad stays None" in line for line in r["log"]), r["log"]
    assert json.loads(results[0]["strategy"])["builder"].startswith("Auto")
    if slow:  # the rows touched measured on the first batch: the sampled output layer
        assert "out.weight" in results[0]["rows"], results[0]["rows"]
    want = pw.reference(name)
    for r in results:
        for k, v in want.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)


def test_auto_keeps_to_all_reduce_when_the_adaptive_loop_reads_gradient_statistics(
        tmp_path) -> None:  # noqa: ANN001
    """The slow-link case above sends rows to parameter servers; with gradient statistics
    on (what batch size autoscaling reads, from all-reduced gradients), Auto plans
    all-reduce strategies only, says so, and training is still single-process SGD."""
    results = _spawn.run(pw.first_batch_case, 2, tmp_path,
                         {"name": "sampled", "slow": True, "stats": True},
                         _spawn.Setup(args=(2,), local_rank=True, init_group=True))
    for r in results:
        assert not r["ps"], r["explain"]
        assert any("gradient noise scale" in line for line in r["log"]), r["log"]
        assert not any("go to parameter servers" in line for line in r["log"])
    want = pw.reference("sampled")
    for k, v in want.items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)


def test_auto_is_the_default_builder() -> None:
    from stratagem.strategy import AllReduce, Auto
    from stratagem.strategy.resolve import resolve_builder

    assert resolve_builder(None) == Auto()
    assert resolve_builder("AllReduce") == AllReduce()  # pinned by name


def test_autodist_with_auto_agrees_across_ranks_and_explains(tmp_path) -> None:  # noqa: ANN001
    results = _spawn.run(pw.autodist_case, 2, tmp_path, {"name": "sampled"},
                         _spawn.Setup(args=(2,), local_rank=True, init_group=True))
    first = json.loads(results[0]["strategy"])
    second = json.loads(results[1]["strategy"])
    assert first["node_config"] == second["node_config"]
    assert "predicted step" in results[0]["explain"]
    # measured links and trial steps, the same on every rank (averaged / slowest rank)
    links = [{k: v for k, v in r["json"]["links_measured"].items() if k != "seconds"}
             for r in results]
    assert links[0] == links[1] and links[0]["world"] == 2
    assert links[0]["bus_bps"] > 0 and 0 < links[0]["collective_s"] < 1
    assert 0 < links[0]["all_to_all_s"] < 1
    trials = [r["json"]["trials"] for r in results]
    assert trials[0] == trials[1] and len(trials[0]) >= 2
    assert all(t["measured_s"] > 0 for t in trials[0])
    # each step's forward timed apart (the pulls' own rounds: the refinement's pull factor)
    assert all(0 < t["measured_forward_s"] <= t["measured_s"] for t in trials[0])
    assert "trial steps" in results[0]["explain"]
    assert "with one owner" in results[0]["explain"]  # both pull rounds probed
    assert 0 < links[0]["pull_round_one_s"] < 1
    # a cost model rigged to rank AllReduce of a 25 MB embedding first is corrected
    rigged = [r["rigged"] for r in results]
    assert rigged[0]["strategy"] == rigged[1]["strategy"]
    assert rigged[0]["trials"][0]["name"] == "AllReduce"
    assert rigged[0]["chosen"] != "AllReduce", rigged[0]["trials"]
    assert "interleaved" in rigged[0]["notes"][-1]
    # one rank's host short of memory for a copy: no rank runs trials, the prediction decides
    for r in rigged:
        assert r["starved"]["trials"] == 0 and r["starved"]["chosen"] == "AllReduce"
        assert "does not fit beside it on cpu" in r["starved"]["note"]
    assert "in turn" in results[0]["json"]["notes"][-1]
    want = pw.reference("sampled")
    for r in results:
        for k, v in want.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)


def test_auto_by_name_builds_from_the_profile_alone() -> None:
    import stratagem.planner  # noqa: F401  (installs the planner)

    model = pw.make("dense")
    s = builder_from_name("Auto").build(analyze(model), spec(2))
    assert s.builder.startswith("Auto")
    again = builder_from_name("Auto").build(analyze(model), spec(2))
    assert [nc.to_dict() for nc in s.node_config] == [nc.to_dict() for nc in again.node_config]


def test_trials_pick_the_fastest_and_keep_the_better_predicted_on_ties() -> None:
    assert fastest([0.30, 0.10, 0.20]) == 1
    assert fastest([0.100, 0.096, 0.2]) == 0  # within 5%: the better predicted stays
    assert fastest([None, 0.5]) == 1
    assert fastest([0.2, 0.2, 0.2]) == 0
    # faster by 10%, but the steps spread by 0.02 s each: within the noise
    assert fastest([0.20, 0.18], [0.02, 0.02]) == 0
    assert fastest([0.20, 0.10], [0.02, 0.02]) == 1


def test_servers_must_beat_all_reduce_by_more_than_the_tie() -> None:
    fam = [SERVERS, ALL_REDUCE, SERVERS, ALL_REDUCE]
    # PSLoadBalancing 40.8 ms against AllReduce's 41.0 (the CNN's trials): all-reduce
    assert prefer_all_reduce(0, fam, [0.0408, 0.0410, 0.0400, 0.0500]) == 1
    # of the all-reduce candidates level with it, the better predicted (earlier) one...
    assert prefer_all_reduce(0, fam, [0.0408, 0.0420, 0.0400, 0.0410]) == 1
    # ...unless a later one is faster than it by more than the tie
    assert prefer_all_reduce(0, fam, [0.0408, 0.0428, 0.0400, 0.0405]) == 3
    # faster by more than the tie: servers stay; an all-reduce winner stays; no timing
    assert prefer_all_reduce(0, fam, [0.0300, 0.0410, 0.0400, 0.0500]) == 0
    assert prefer_all_reduce(1, fam, [0.0400, 0.0410, 0.0400, 0.0500]) == 1
    assert prefer_all_reduce(0, fam, [None, 0.0410, 0.0400, 0.0500]) == 0


def test_a_race_is_decided_on_the_standard_error_of_the_medians() -> None:
    # 30 steps each, MAD 3 ms: the medians' difference has a standard error of ~1.4 ms
    assert raced([0.0340, 0.0311], [0.003, 0.003], [30, 30]) == 1  # 3 ms: > 5%, > 2 se
    assert raced([0.0340, 0.0311], [0.003, 0.003], [3, 3]) == 0  # 3 steps: se ~4 ms
    assert raced([0.0340, 0.0330], [0.0, 0.0], [30, 30]) == 0  # within 5%: winner stays
    # of those that beat the winner, the fastest; one that did not run is passed over
    assert raced([0.10, 0.08, 0.07, None], [0.001] * 4, [30] * 4) == 2
    assert raced([None, 0.2, 0.1], [0.0] * 3, [5] * 3) == 2  # no winner timing: fastest


def test_a_hybrid_must_beat_every_named_builder_by_more_than_the_tie() -> None:
    names = ["hybrid", "Parallax", "PS", "AllReduce"]
    # Parallax and PS within 5% of the hybrid: a named one is taken, the better
    # predicted (earlier) one, PS being faster by less than the tie
    assert prefer_named(0, names, [0.0100, 0.0104, 0.0102, 0.08]) == 1
    # ...unless the later one is faster by more than the tie
    assert prefer_named(0, names, [0.0100, 0.0104, 0.0098, 0.08]) == 2
    # every named one more than 5% slower: the hybrid stays
    assert prefer_named(0, names, [0.0100, 0.0106, 0.0110, 0.08]) == 0
    # a named winner is never displaced, nor one without a timing
    assert prefer_named(1, names, [0.0099, 0.0100, 0.0102, 0.08]) == 1
    assert prefer_named(0, names, [None, 0.0100, 0.0102, 0.08]) == 0


def test_second_look_races_what_the_refined_model_puts_level_with_the_winner() -> None:
    """Known answer: the trials ran 2x the model's CPU part (wire 0), so an untried
    candidate predicted at 0.0105 s refines to 0.021 s, within 1.3 of the winner's
    measured 0.020 s; one at 0.014 s (0.028 s) is not; one with the winner's strategy under
    another name (Parallax = AllReduce without embeddings) is not raced again."""

    from stratagem.planner.cost_model import StepCost
    from stratagem.planner.search import Candidate
    from stratagem.planner.trial import SECOND_MAX, SECOND_STEPS

    profile = analyze(pw.make("dense"))
    base = search(profile, spec(2), estimate(profile, 8))

    def cand(name: str, cpu: float) -> Candidate:
        strategy = builder_from_name(name).build(profile, spec(2))
        return Candidate(name, strategy, StepCost(cpu, 0.0, 0.0))

    cands = (cand("AllReduce", 0.010), cand("PS", 0.020), cand("PartitionedPS", 0.0105),
             cand("PSLoadBalancing", 0.014), cand("Parallax", 0.0101))
    choice = replace(base, best=cands[0], candidates=cands)
    trials = [_trial("AllReduce", 0.010, 0.0, 0.020), _trial("PS", 0.020, 0.0, 0.040)]
    winner = {"name": "AllReduce", "predicted_s": 0.010, "steps": 10, "split": [0.010, 0.0],
              "strategy": cands[0].strategy.to_dict()}
    race = second_look(choice, trials, winner, 0.020, left_s=60.0)
    assert [e["name"] for e in race] == ["AllReduce", "PartitionedPS"]
    assert {e["steps"] for e in race} == {SECOND_STEPS[1]}  # 1 s at 20 ms: capped at 30
    # too little time left for even the fewest steps: no race
    assert second_look(choice, trials, winner, 0.020, left_s=0.1) == []
    # many level candidates: the closest SECOND_MAX
    many = (*cands, cand("UnevenPartitionedPS", 0.0102), cand("PartitionedAR", 0.0103),
            cand("RandomAxisPartitionAR", 0.0104))
    race = second_look(replace(choice, candidates=many), trials, winner, 0.020, 60.0)
    assert len(race) == 1 + SECOND_MAX and race[1]["name"] == "UnevenPartitionedPS"


def _trial(name: str, cpu_s: float, wire_s: float, measured_s: float | None) -> Trial:
    return Trial(name, cpu_s + wire_s, measured_s, cpu_s=cpu_s, wire_s=wire_s)


def test_trials_fit_separate_factors_for_cpu_and_wire() -> None:
    # Steps made by a known rule: CPU parts 1.8x as modelled, the wire 1.05x.
    made = [(0.010, 0.080), (0.020, 0.004), (0.015, 0.020), (0.030, 0.001)]
    trials = [_trial(str(i), c, w, 1.8 * c + 1.05 * w) for i, (c, w) in enumerate(made)]
    r = fit([*trials, _trial("not run", 0.1, 0.1, None)])
    assert r is not None and r.trials == 4
    assert (r.cpu, r.wire) == pytest.approx((1.8, 1.05), rel=0.02)
    # an untried, mostly-wire strategy is priced by the same rule; one common factor (the
    # trials' median ratio, 1.52) would put it 35% too slow
    truth = 1.8 * 0.01 + 1.05 * 0.09
    assert r.seconds(0.01, 0.09) == pytest.approx(truth, rel=0.02)
    common = statistics.median(t.measured_s / t.predicted_s for t in trials)
    assert common * 0.1 > 1.3 * truth


def test_trials_price_sparse_pulls_by_their_timed_forward() -> None:
    # Steps made by a known rule: CPU 1.2x as modelled, the pull rounds 0.5x (the probe
    # read its chain slow), the rest of the wire 1.0x; each PS trial's forward is its
    # compute (as calibrated, 2 ms) plus its pulls as they ran.
    def ps(name: str, cpu: float, wire: float, pull: float) -> Trial:
        return Trial(name, cpu + wire, 1.2 * cpu + (wire - pull) + 0.5 * pull,
                     cpu_s=cpu, wire_s=wire, forward_s=0.002, pull_s=pull,
                     measured_forward_s=0.002 + 0.5 * pull)

    trials = [ps("PS", 0.002, 0.010, 0.004), ps("Parallax", 0.004, 0.006, 0.002),
              _trial("AllReduce", 0.003, 0.050, 0.003 * 1.2 + 0.050)]
    assert pull_factor(trials) == pytest.approx(0.5)
    r = fit(trials)
    assert r is not None and r.pull == pytest.approx(0.5)
    assert (r.cpu, r.wire) == pytest.approx((1.2, 1.0), rel=0.03)
    # an untried PS strategy with 8 ms of pulls: priced at half of them; the two-factor
    # fit (no pull factor) misprices it by more than a fifth
    truth = 1.2 * 0.002 + 0.004 + 0.5 * 0.008
    assert r.seconds(0.002, 0.012, 0.008) == pytest.approx(truth, rel=0.03)
    old = fit([replace(t, pull_s=0.0, measured_forward_s=None) for t in trials])
    assert old is not None and old.pull is None
    assert abs(old.seconds(0.002, 0.012) - truth) > truth / 5
    # no trial timed pulls (none had any, or none timed its forward): the pulls go with
    # the rest of the wire, as in the two-factor fit
    assert pull_factor([_trial("a", 0.01, 0.01, 0.02)]) is None
    untimed = [replace(t, measured_forward_s=None) for t in trials]
    assert pull_factor(untimed) is None
    two = fit(untimed)
    assert two is not None and two.pull is None
    assert two.seconds(0.002, 0.012, 0.008) == pytest.approx(two.seconds(0.002, 0.012))
    # bounded like the others
    slow = replace(trials[0], measured_forward_s=1.0)
    assert pull_factor([slow]) == FACTOR_RANGE[1]
    # the JSON round trip keeps every field (the benchmark refits from it)
    assert Trial.from_dict(trials[0].to_dict()) == trials[0]
    assert Trial.from_dict({"name": "x", "predicted_s": 0.1}) == Trial("x", 0.1, None)


def test_trials_fit_falls_back_to_its_priors() -> None:
    assert fit([]) is None and fit([_trial("a", 0.1, 0.1, None)]) is None
    # no trial waits on the wire: its factor stays at 1 (the links are probed)
    flat = fit([_trial("a", 0.10, 0.0, 0.15), _trial("b", 0.20, 0.0, 0.31)])
    assert flat is not None and flat.cpu == pytest.approx(1.53, rel=0.03)
    assert flat.wire == pytest.approx(1.0, rel=0.05)
    # one trial: explained (mostly by the CPU factor, the wire's prior being 1)
    one = fit([_trial("a", 0.10, 0.02, 0.18)])
    assert one is not None and one.seconds(0.10, 0.02) == pytest.approx(0.18, rel=0.03)
    # a split not recorded (both 0): the whole prediction counts as CPU
    legacy = fit([Trial("a", 0.2, 0.3)])
    assert legacy is not None and legacy.cpu == pytest.approx(1.5, rel=0.02)
    # bounds: a trial "twice as fast as measured parts say" is not believed
    fast = fit([_trial("a", 0.10, 0.0, 0.02)])
    assert fast is not None and fast.cpu == FACTOR_RANGE[0]
    profile = analyze(pw.make("dense"))
    ar = builder_from_name("AllReduce").build(profile, spec(2))
    ps = builder_from_name("PS").build(profile, spec(2))
    assert (family(ar), family(ps)) == (ALL_REDUCE, SERVERS)


def test_shortlist_has_distinct_strategies_and_a_builtin() -> None:
    model = pw.make("dense")  # no embedding: Parallax's strategy is AllReduce's
    profile = analyze(model)
    choice = search(profile, spec(2), estimate(profile, 8))
    short = shortlist(choice, 3)
    keys = [json.dumps([nc.to_dict() for nc in c.strategy.node_config], sort_keys=True)
            for c in short]
    assert len(set(keys)) == len(keys) and any(c.name != "hybrid" for c in short)
    assert any(all_reduce_only(c.strategy) for c in short)
    assert short[0] is choice.best and len(short) <= 5
    assert not {"AllReduce", "Parallax"} <= {c.name for c in short}


def test_shortlist_passes_over_candidates_predicted_far_slower() -> None:
    """A candidate predicted over ``DOMINATED`` times the best is not tried, even as the
    best built-in or all-reduce one; the passed-over guards are named with their ratio."""
    profile = analyze(pw.make("dense"))
    choice = search(profile, spec(2), estimate(profile, 8))
    best = choice.best.cost.total_s

    def priced(c, ratio: float):
        return replace(c, cost=replace(c.cost, compute_s=c.cost.compute_s
                                       + best * ratio - c.cost.total_s))

    # every candidate but the chosen one predicted 2.5x the best, or just under the bound
    for ratio, tried in ((2.5, False), (DOMINATED * 0.99, True)):
        others = tuple(priced(c, ratio) for c in choice.candidates if c is not choice.best)
        # the chosen one a hybrid with servers: both guards (built-in, all-reduce) wanted
        ps = next(c for c in choice.candidates if not all_reduce_only(c.strategy))
        first = replace(priced(ps, 1.0), name="hybrid")
        # (the search's own hybrid goes too: the rig's "hybrid" stands for it)
        others = tuple(c for c in others if c.name not in (ps.name, "hybrid"))
        rigged = replace(choice, best=first, candidates=(first, *others))
        short = shortlist(rigged, 3)
        assert short[0] is rigged.best
        assert (len(short) > 1) is tried
        named = passed_over(rigged, short)
        if tried:
            assert named == []
        else:
            assert short == [rigged.best]
            # the best built-in here all-reduces everything: one name serves both guards
            builtin = next(c for c in rigged.candidates if c.name != "hybrid")
            assert all_reduce_only(builtin.strategy)
            assert named == [f"{builtin.name} (2.5x)"]


def test_gathered_rows_are_not_a_group_to_compress() -> None:
    from stratagem.planner.search import group_count

    s = pw.gather_strategy()
    assert group_count(s) == 1  # the head's group; the table's gathered rows are not one
    summed = NodeConfig("emb.weight", AllReduceSynchronizer(group=1))  # the table summed
    assert group_count(replace(s, node_config=(summed, *s.node_config[1:]))) == 2


def test_lossy_allowed_adds_allreduce_with_each_compressor() -> None:
    profile = analyze(pw.make("dense"))
    names = {c.name for c in search(profile, spec(2), estimate(profile, 8),
                                    Auto(compressors=("none", "fp16"))).candidates}
    assert "AllReduce(fp16)" in names
    names = {c.name for c in search(profile, spec(2), estimate(profile, 8)).candidates}
    assert not any("(" in n for n in names)


def test_auto_options_are_checked() -> None:
    with pytest.raises(StrategyError, match="trials"):
        Auto(trials=-1)
    with pytest.raises(StrategyError, match="compressor"):
        Auto(compressors=("zip",))
    with pytest.raises(StrategyError, match="batch_size"):
        Auto(batch_size=0)


def test_search_is_bounded_for_200_tensors() -> None:
    """A model of 200 parameter tensors: every builder plus a bounded number of hybrids."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(100)])
    profile = analyze(layers)
    assert len(profile.params) == 200
    choice = search(profile, spec(4), estimate(profile, 32), Auto(compressors=("none", "fp16")))
    priced = int(choice.notes[-1].split()[0])
    assert priced <= 8 + 2 * 5 + 2 * 1 * 200  # builders, caps twice, group compressors
    assert choice.search_s < patience(60)  # a hang guard; the 10 s bound is the benchmark's


def test_explanation_fits_80_columns() -> None:
    torch.manual_seed(0)
    model = pw.EmbeddingHeavy()
    choice = choose(model, spec(4), sample_input=torch.randint(0, 20000, (32, 4)))
    text = explain_text(choice)
    assert max(len(line) for line in text.splitlines()) <= 80
    for needle in ("predicted step", "parameter groups", "bytes per step per link",
                   "best alternatives", "exposed comm"):
        assert needle in text


def test_rows_off_means_no_candidate_sends_rows() -> None:
    """An optimizer without a sparse rule (AutoDist turns rows off): neither the hybrids
    nor a built-in builder that puts the embedding on servers may be chosen."""
    from stratagem.planner.search import sends_rows

    torch.manual_seed(0)
    model = pw.EmbeddingHeavy()
    choice = choose(model, spec(2), sample_input=torch.randint(0, 20000, (32, 4)),
                    options=Auto(rows=False))
    assert not any(sends_rows(c.strategy, choice.profile) for c in choice.candidates)


def test_servers_off_keeps_every_candidate_to_all_reduce() -> None:
    torch.manual_seed(0)
    choice = choose(pw.EmbeddingHeavy(), spec(2), sample_input=torch.randint(0, 20000, (32, 4)),
                    options=Auto(servers=False))
    assert all(all_reduce_only(c.strategy) for c in choice.candidates)


class ManyTables(torch.nn.Module):
    """Eight embedding tables of 1.28 MB, each read in a batch's 32 rows, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(20000, 16) for _ in range(8))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(sum(t(ids[:, i]) for i, t in enumerate(self.tables)))


def test_rows_that_pay_only_together_are_found() -> None:
    """The sparse exchange's fixed cost per step (6 ms of push) is more than one table's
    all-reduce saves (1.28 MB at ~0.6 GB/s: 2 ms), less than eight tables' (16 ms): adding
    tables one at a time keeps none; all at once, then one back at a time, keeps all."""
    profile = analyze(ManyTables())
    s = spec(2, gbps=5.0)
    cal = estimate(profile, 32)
    links = LinkModel.from_spec(s, all_to_all_s=1e-3, pull_round_s=6e-3,
                                sparse_push_s=6e-3)
    choice = search(profile, s, cal, Auto(), links)
    on_servers = [nc.var_name for nc in choice.strategy.node_config
                  if all(isinstance(leaf.synchronizer, PSSynchronizer) for leaf in nc.leaves())]
    assert sorted(on_servers) == [f"tables.{i}.weight" for i in range(8)], \
        choice.strategy.summary()

    def cost(h: Hybrid) -> float:
        return predict(build_hybrid(h, profile, s, cal), profile, s, cal, links).total_s

    one = profile.params[0].name
    # one table alone does not pay, in either mode
    for replicate in (set(), {one}):
        assert cost(Hybrid(rows={one}, cap=None, replicate=replicate)) > \
            cost(Hybrid(rows=set(), cap=None))


def test_a_group_without_gloo_is_not_probed_or_trialled(monkeypatch) -> None:  # noqa: ANN001
    """Probes, trials and calibration together exchange CPU tensors: over a default group
    of NCCL alone Auto must not start them (it plans from calibration alone)."""
    import torch.distributed as dist

    from stratagem.planner import collective_ready, measured_links

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert not collective_ready(spec(2))
    assert measured_links(spec(2))[1] is None  # no probe started
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collective_ready(spec(2))


def test_trial_copies_fit_in_the_room_every_rank_has(monkeypatch) -> None:  # noqa: ANN001
    """Trial steps run copies of the model on its own device: on the CPU, half the host's
    available memory shared by the workers on this machine; on a GPU, half its free memory
    and at most that host share (tests/gpu); on a device a copy cannot run on (meta here),
    no room, no trials."""
    from stratagem.planner import trial

    linear = torch.nn.Linear(256, 256)  # 257 KiB of parameters
    free = trial.host_available_bytes()
    assert free is not None and 0 < free < 2 ** 50  # this Linux host says
    monkeypatch.setattr(trial, "host_available_bytes", lambda: 8 * 2 ** 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert trial.trial_room(linear) == 4 * 2 ** 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four workers make their copies at once
    assert trial.trial_room(linear) == 2 ** 30
    # on a GPU: half its free memory, and no more than the host's share (PS staging)
    monkeypatch.setattr(trial, "model_device", lambda m: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (16 * 2 ** 30, 80 * 2 ** 30))
    assert trial.trial_room(linear) == 2 ** 30  # the host's share of 8 GiB over 4 workers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert trial.trial_room(linear) == 4 * 2 ** 30
    monkeypatch.setattr(trial, "host_available_bytes", lambda: 64 * 2 ** 30)
    assert trial.trial_room(linear) == 8 * 2 ** 30  # now the GPU's half is the bound
    monkeypatch.setattr(trial, "host_available_bytes", lambda: None)
    assert trial.trial_room(linear) == 8 * 2 ** 30
    monkeypatch.undo()
    monkeypatch.setattr(trial, "host_available_bytes", lambda: None)
    assert trial.trial_room(linear) == trial.UNKNOWN_ROOM
    assert trial.trial_room(torch.nn.Linear(2, 2, device="meta")) == 0
    plan = [{}] * 4
    one = trial.model_bytes(linear) * trial.COPIES
    assert trial.model_bytes(linear) == 257 * 256 * 4
    assert trial._interleave(plan, linear, 4 * one)
    assert not trial._interleave(plan, linear, 4 * one - 1)  # the room binds
    assert trial._interleave(plan, linear, trial.UNKNOWN_ROOM)  # 3 MiB < INTERLEAVE_BYTES


@pytest.mark.slow
def test_the_first_step_s_record_says_how_long_auto_planned(tmp_path) -> None:  # noqa: ANN001
    """Issue 49: an Auto run's first step waits while Auto plans; the record of that step
    says for how long (``auto_plan_s``), and ``stratagem report`` shades the gap."""
    run = tmp_path / "run"
    results = _spawn.run(pw.auto_metrics_case, 2, tmp_path, {"run_dir": str(run)},
                         _spawn.Setup(args=(2,), local_rank=True, init_group=True))
    assert all(r["planned"] for r in results)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert 0 < records[0]["auto_plan_s"] <= records[0]["step_time_s"]
    assert all("auto_plan_s" not in r for r in records[1:])


def test_the_ddp_engine_is_a_candidate_and_explained() -> None:
    """Auto prices AllReduce on torch's DDP reducer beside everything else, and the
    explanation says which engine runs the groups and what the other engine lost by."""
    from stratagem.planner.explain import engine_of, explain_json, explain_text
    from stratagem.planner.search import DDP_ENGINE

    profile = analyze(pw.make("dense"))
    choice = search(profile, spec(2), estimate(profile, 8))
    names = {c.name: c for c in choice.candidates}
    ddp = names.get(DDP_ENGINE) or next(c for c in choice.candidates
                                        if c.name.endswith(DDP_ENGINE))
    assert engine_of(ddp.strategy) == "ddp"
    plain = next(c for c in choice.candidates if c.name in ("AllReduce", "Auto(AllReduce)"))
    # the same groups, less runtime work per tensor on DDP's C++ reducer
    assert ddp.cost.parts["runtime"] < plain.cost.parts["runtime"]
    text = explain_text(choice)
    assert "engine: " in text and all(len(line) <= 80 for line in text.splitlines())
    engine = engine_of(choice.best.strategy)
    assert explain_json(choice)["engine"] == engine
    assert f"engine: {engine}" in text and "ms for" in text


def test_no_ddp_engine_where_calibration_saw_a_parameter_without_gradient() -> None:
    """The ddp engine needs a gradient for every parameter in every step: a parameter
    calibration never saw one for (an unused branch) keeps Auto on Stratagem's engine."""
    from stratagem.planner.explain import engine_of

    profile = analyze(pw.make("dense"))
    cal = estimate(profile, 8)
    first = profile.params[0].name
    cal = replace(cal, grad_ready_s={k: v for k, v in cal.grad_ready_s.items() if k != first})
    choice = search(profile, spec(2), cal)
    assert all(engine_of(c.strategy) != "ddp" for c in choice.candidates)


def test_the_ddp_engine_gets_small_buckets_where_backward_ends_in_small_gradients() -> None:
    """A CNN's last gradients of backward (its first conv layers, ~1 MiB) make one DDP
    bucket with plain DDP's 25 MiB limit, all of it sent after backward. The search prices
    smaller buckets on the ddp engine (named candidates ``AllReduceDDP@<size>``, DDP's
    ``bucket_cap_mb``, and the hybrid's caps on that engine): on a 1 Gbit/s link Auto picks
    the ddp engine with more, smaller buckets, the last one smaller than AllReduceDDP's, and
    predicts it faster by what that bucket no longer exposes; on a fast link the gain is
    within the search's tolerance, and of the candidates within it the one with the fewest
    collectives wins: the ddp engine with one bucket (no DDP first bucket apart)."""
    from stratagem.planner.cost_model import plan_for
    from stratagem.planner.explain import engine_of
    from stratagem.planner.search import DDP_ENGINE, DDP_NO_FIRST, HYBRID, ddp_bucket_name

    w = 32
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, w, 3), torch.nn.Conv2d(w, 2 * w, 3), torch.nn.Conv2d(2 * w, 4 * w, 3),
        torch.nn.Conv2d(4 * w, 4 * w, 3), torch.nn.Flatten(), torch.nn.Linear(4 * w * 16, 256),
        torch.nn.Linear(256, 10))
    profile = analyze(model)
    names = [p.name for p in profile.params]
    backward = 0.05  # the classifier's gradients at once, then the convs', last layer first
    ready = {n: backward * (1 - (i // 2) / 6) if i < 8 else 0.001 for i, n in enumerate(names)}
    cal = replace(estimate(profile, 16), backward_s=backward, grad_ready_s=ready)

    def buckets(c: object, sp: ResourceSpec) -> list[int]:
        return [g.nbytes for g in plan_for(c.strategy, profile, sp).groups]

    def base(name: str) -> str:
        return name.removeprefix("Auto(").removesuffix(")")

    slow, fast = spec(2, 1.0), spec(2, 100.0)
    choice = search(profile, slow, cal)
    by_name = {base(c.name): c for c in choice.candidates}
    best, ddp = choice.best, by_name[DDP_ENGINE]
    assert ddp_bucket_name(2**18) in by_name and engine_of(by_name[HYBRID].strategy) == "ddp"
    assert engine_of(best.strategy) == "ddp" and base(best.name) != DDP_ENGINE
    assert len(buckets(best, slow)) > len(buckets(ddp, slow))
    assert buckets(best, slow)[-1] < buckets(ddp, slow)[-1]
    assert best.cost.parts["backward_tail"] < ddp.cost.parts["backward_tail"]
    assert best.cost.total_s < ddp.cost.total_s * 0.95  # more than the search's tolerance
    assert len(buckets(ddp, slow)) == 2  # DDP's own layout: its 1 MiB first bucket apart
    quick = search(profile, fast, cal).best
    assert base(quick.name) == DDP_NO_FIRST and engine_of(quick.strategy) == "ddp"
    assert len(buckets(quick, fast)) == 1
