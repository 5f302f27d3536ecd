"""Automatic strategy ("Auto") vs every built-in builder and DDP, over the model zoo.

For each zoo model (bench/zoo.py) x node count x link bandwidth, on the virtual cluster (one
worker per node, nodes pinned round-robin to the cores as in ps_vs_ddp.py), every variant is
built in the same worker processes from the same initial weights and run on the same batches,
interleaved step by step in a seeded random order:

* every registered built-in builder with its defaults (AllReduce, PartitionedAR, PS,
  PartitionedPS, Parallax, ...), plus ``AllReduce_fp16`` (AllReduce with the fp16 compressor);
  a builder whose strategy equals one already built is measured once (``same_as``);
* ``DDP``: torch DDP on gloo, sparse gradients where the model declares them;
* ``Auto``: ``AutoDist(strategy_builder="Auto").build_strategy(model)`` when a builder of
  that name is registered, else recorded as "planner not available" (in the workers: it
  calibrates, measures the links and runs its trial steps);
* ``Auto_fp16``: the same with ``Auto(compressors=("none", "fp16"))``, lossy allowed;
* ``Auto_profile``: Auto without a sample batch (the profile and nominal rates alone: what
  ``stratagem plan`` and ``build_strategy(model)`` choose offline; ``distribute`` without a
  sample plans on the first training batch, which is the ``Auto`` variant here);
* ``HybridRef``: a hand-made reference (Parallax's placement with fp16 all-reduce) that
  shows what a per-parameter hybrid can gain; it is not a built-in and not Auto.

Per case: median step time of each variant (max over ranks per step), Auto / best lossless
built-in (AllReduce_fp16 excluded), Auto_fp16 / best built-in (fp16 included), Auto / DDP,
the planner's prediction (links measured) and its error ``|pred - meas| / meas`` per variant
(when ``stratagem.planner.predict_step_time`` exists), Auto's build time (calibration, link
probe, planning and trial steps),
the machine's load average. Results merge into bench/results/auto_strategy.json by case, so
subsets run at different times add up. Needs root (the virtual cluster), except --loopback.

    python bench/auto_strategy.py                                    # everything (long)
    python bench/auto_strategy.py --nodes 2 --bandwidth 1gbit --models cnn hybrid --steps 4
    python bench/auto_strategy.py --loopback 2 --tiny --steps 2     # seconds, no namespaces
    python bench/auto_strategy.py --summary                         # markdown from the JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ps_vs_ddp import (
    STEP_PARTS,
    Phase,
    Variant,
    Worker,
    _commit,
    _first_line,
    _gather_json,
    step_order,
)
from vcluster_host import pinned_cpus, virtual_cluster

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "auto_strategy.json"
FP16 = "AllReduce_fp16"
DDP_ENGINE = "AllReduce_DDP"
"""AllReduce (defaults) run by torch's DDP reducer (``engine: ddp``): judged against DDP."""
DDP_ENGINE_FP16 = "AllReduce_DDP_fp16"
"""The same with torch's fp16 compression hook: judged against AllReduce_fp16."""
LOSSY = (FP16, DDP_ENGINE_FP16)
HYBRID = "HybridRef"
AUTO_FP16 = "Auto_fp16"
"""Auto allowed the lossy fp16 compressor (``Auto(compressors=("none", "fp16"))``): judged
against every built-in, AllReduce_fp16 included; plain Auto (lossless) against the
lossless built-ins only."""
AUTO_PROFILE = "Auto_profile"
"""Auto without a sample batch (``build_strategy(model)``, ``stratagem plan``): from the
profile and nominal rates alone, nothing measured. Judged like Auto, against the lossless
built-ins. Not the default path: ``distribute(model, opt)`` without ``sample_input`` plans
on the first training batch (calibration, probe and trials on it: the ``Auto`` variant)."""
NOT_BUILTIN_VARIANTS = ("Auto", AUTO_FP16, AUTO_PROFILE, "DDP", HYBRID)
DDP_PAIRS = (("Auto/DDP", "Auto", "DDP"), (f"{DDP_ENGINE}/DDP", DDP_ENGINE, "DDP"),
             (f"{DDP_ENGINE_FP16}/{FP16}", DDP_ENGINE_FP16, FP16))
"""Issue 44's pairs, confirmed like Auto's (label, variant, baseline): plain torch DDP with
its defaults is the baseline of the first two."""
DENSE_44 = ("cnn", "transformer_lm", "many_small")  # issue 44's dense cases
CONFIRMED_KEYS = {"Auto/DDP": "auto_over_ddp", f"{DDP_ENGINE}/DDP": "ddp_engine_over_ddp",
                  f"{DDP_ENGINE_FP16}/{FP16}": "ddp_engine_fp16_over_fp16"}
NOT_AVAILABLE = "planner not available"
# Builders that are neither baselines nor candidates here: ZeRO trades step time for memory
# and has its own benchmark (bench/sharding.py); it refuses sparse-gradient models.
NOT_BUILTIN = {"auto", "zero"}


# ----------------------------------------------------------------------------- planner hooks
def auto_registered(name: str = "Auto") -> bool:
    """Whether a strategy builder named ``name`` ("Auto": the planner) is registered."""
    from stratagem.strategy import builder_names

    return any(n.lower() == name.lower() for n in builder_names())


def predictor() -> Any:
    """``stratagem.planner.predict_step_time``, or None when the planner lacks it."""
    try:
        import stratagem.planner as planner
    except ImportError:
        return None
    fn = getattr(planner, "predict_step_time", None)
    return fn if callable(fn) else None


def builtin_builders() -> dict[str, Any]:
    """Variant name -> builder: every registered built-in with defaults, plus fp16 AllReduce."""
    from stratagem.strategy import AllReduce, builder_from_name, builder_names

    out = {n: builder_from_name(n) for n in builder_names() if n.lower() not in NOT_BUILTIN}
    out[FP16] = AllReduce(compressor="fp16")
    out[DDP_ENGINE] = AllReduce(engine="ddp")
    out[DDP_ENGINE_FP16] = AllReduce(compressor="fp16", engine="ddp")
    return out


def with_compressor(strategy: Any, compressor: str, name: str) -> Any:
    """``strategy`` with every all-reduce synchronizer using ``compressor``."""
    from stratagem.strategy import AllReduceSynchronizer

    def fix(nc: Any) -> Any:
        sync = nc.synchronizer
        if isinstance(sync, AllReduceSynchronizer):
            nc = replace(nc, synchronizer=replace(sync, compressor=compressor))
        if nc.part_config:
            nc = replace(nc, part_config=tuple(fix(p) for p in nc.part_config))
        return nc

    return replace(strategy, node_config=tuple(fix(nc) for nc in strategy.node_config),
                   builder=name)


def predict_all(fn: Any, model: Any, strategies: dict[str, Any], spec: Any, batch_size: int,
                sample: Any, **options: Any) -> tuple[dict[str, float | None], dict[str, str]]:
    """``fn(model, strategy, spec, batch_size, sample_input=..., **options)`` for every
    strategy: the predicted seconds per step (None where it raised or gave no finite
    positive number), and the errors."""
    import math

    preds: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    for name, s in strategies.items():
        try:
            value = float(fn(model, s, spec, batch_size, sample_input=sample, **options))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"predicted {value!r} s")
            preds[name] = value
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            preds[name] = None
            errors[name] = _first_line(exc)
    return preds, errors


def predicted_parts(model: Any, strategies: dict[str, Any], spec: Any, sample: Any
                    ) -> tuple[dict[str, dict[str, float]], dict[str, Any] | None]:
    """The cost model's split of each strategy's predicted step (``StepCost.to_dict()``,
    links probed) and the calibration it used, for reading the prediction errors. Every
    rank calls it after ``predict_all`` (calibration and probe come from their caches)."""
    try:
        import stratagem.planner as planner
        from stratagem.analysis.profile import analyze
        from stratagem.strategy.validate import validate
    except ImportError:
        return {}, None
    try:
        cal = planner.calibrate(model, sample)
        profile = analyze(model).with_access(cal.access)
        links = planner.measured_links(spec)[0]
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}, None
    out: dict[str, dict[str, float]] = {}
    for name, s in strategies.items():
        try:
            cost = planner.predict(validate(s, profile, spec), profile, spec, cal, links)
        except Exception:  # noqa: BLE001 - diagnostics only
            continue
        d = cost.to_dict()
        out[name] = {k: round(float(v), 5) for k, v in
                     {**{k: d[k] for k in ("total_s", "compute_s", "exposed_comm_s",
                                           "overhead_s")}, **d["parts"]}.items()}
    c = cal.to_dict()
    c.pop("access", None)
    return out, c


def job_steps(per_rank: list[list[float]]) -> list[float]:
    """Each step's time for the job: the slowest rank's."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def strategy_key(strategy: Any) -> str:
    """The strategy's content without its id and builder name (to spot duplicates)."""
    d = strategy.to_dict()
    d.pop("id", None)
    d.pop("builder", None)
    return json.dumps(d, sort_keys=True)


# ----------------------------------------------------------------------------- worker side
class AutoWorker(Worker):
    """Runs the zoo's cases on one rank (ps_vs_ddp's worker: its timed step, sync flag and
    runtime wrapping); rank 0 writes the JSON."""

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[auto_strategy {self.world} nodes] {msg}", flush=True)

    def strategies(self, base: Any, names: list[str]) -> tuple[dict[str, Any], dict[str, str],
                                                                 dict[str, str]]:
        """(name -> validated strategy, name -> error, duplicate name -> first name)."""
        import stratagem as sg

        spec = self.ad.resource_spec
        profile = sg.analyze(base)
        builders = builtin_builders()
        out: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name in names:
            try:
                if name == HYBRID:
                    parallax = builders["Parallax"].build(profile, spec)
                    s = with_compressor(parallax, "fp16", HYBRID)
                else:
                    s = builders[name].build(profile, spec)
                out[name] = sg.strategy.validate(s, profile, spec)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                errors[name] = f"unavailable: {_first_line(exc)}"
        seen: dict[str, str] = {}
        same: dict[str, str] = {}
        for name, s in list(out.items()):
            key = strategy_key(s)
            if key in seen:
                same[name] = seen[key]
                del out[name]
            else:
                seen[key] = name
        return out, errors, same

    def auto_strategy(self, model: Any, sample: Any, lossy: bool = False
                      ) -> tuple[Any, float, str | None]:
        """(Auto's strategy, seconds to build it, error) via the public AutoDist path, with
        one worker's batch as the sample input (so the planner calibrates on this machine,
        measures the links and runs its trial steps, as ``distribute(sample_input=...)``
        does in a user's script). ``lossy``: Auto allowed fp16 (Auto_fp16). ``sample``
        None: Auto_profile."""
        import stratagem as sg

        name = self.args.auto_builder
        if not auto_registered(name):
            return None, 0.0, f"{NOT_AVAILABLE} (no builder named {name})"
        builder: Any = name
        if lossy:
            if name != "Auto":
                return None, 0.0, f"unavailable: {AUTO_FP16} needs the planner's Auto"
            builder = sg.strategy.Auto(compressors=("none", "fp16"))
        t0 = time.perf_counter()
        try:
            ad = sg.AutoDist(strategy_builder=builder, resource_spec=self.ad.resource_spec,
                             verbose=False)
            strategy = ad.build_strategy(model, sample_input=sample)
            choice = getattr(ad, "choice", None)
            if choice is not None and self.rank == 0:  # what the planner measured
                probe = getattr(choice, "link_probe", None)
                label = AUTO_FP16 if lossy else "Auto" if sample is not None else AUTO_PROFILE
                self.planner_info[label] = {
                    "chosen": choice.best.name,
                    "engine_why": _engine_why(choice),
                    "links_measured": probe.to_dict() if probe is not None else None,
                    "trials": [t.to_dict() for t in getattr(choice, "trials", ())],
                    "groups": _chosen_groups(choice)}
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            if self.args.verbose_errors:
                traceback.print_exc()
            return None, time.perf_counter() - t0, f"unavailable: {_first_line(exc)}"
        return strategy, time.perf_counter() - t0, None

    def build_variant(self, name: str, z: Any, base_state: dict[str, Any], strategy: Any,
                      warmup: int) -> Variant:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        v = Variant(name, warmup=warmup, strategy=strategy)
        failed = False
        try:
            model = z.make()
            model.load_state_dict(base_state)
            opt = torch.optim.SGD(model.parameters(), lr=self.args.lr)
            if name == "DDP":
                model = DDP(model)
            else:
                model, v.strategy = self.stratagem(model, opt, strategy)
            v.model, v.opt = model, opt
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            failed = True
            v.error = f"unavailable: {_first_line(exc)}"
            if self.args.verbose_errors:
                traceback.print_exc()
        if self.agree(failed) and not failed:
            v.error = "unavailable: failed on another rank"
        if v.error:
            v.model = v.opt = None
            self.log(f"{z.name}/{name}: {v.error}")
        return v

    def predict(self, z: Any, base_state: dict[str, Any], strategies: dict[str, Any],
                sample: Any) -> tuple[dict[str, float | None], dict[str, str], float]:
        """The planner's predicted step time per strategy (every rank calls it: it may
        calibrate with collectives), errors, and the seconds all predictions took."""
        fn = predictor()
        if fn is None:
            return {}, {}, 0.0
        import inspect

        model = z.make()
        model.load_state_dict(base_state)
        t0 = time.perf_counter()
        probe = {"probe": True} if "probe" in inspect.signature(fn).parameters else {}
        preds, errors = predict_all(fn, model, strategies, self.ad.resource_spec,
                                    z.local_batch, sample, **probe)
        seconds = time.perf_counter() - t0
        self.pred_parts, self.calibration = predicted_parts(model, strategies,
                                                            self.ad.resource_spec, sample)
        return preds, errors, seconds

    def run_case(self, z: Any) -> dict[str, Any]:
        import torch

        a = self.args
        steps = {"lstm_lm": a.lm_steps,
                 "dlrm": a.steps if a.tiny else max(a.steps, a.dlrm_steps)}.get(z.name, a.steps)
        warmup = a.lm_warmup if z.name == "lstm_lm" else a.warmup
        load0 = os.getloadavg()[0]
        torch.manual_seed(a.seed)
        base = z.make()
        base_state = {k: t.clone() for k, t in base.state_dict().items()}
        data = z.data(self.world, a.seed)
        names = [n for n in [*builtin_builders(), HYBRID]
                 if not a.builders or n in a.builders]
        strategies, errors, same = self.strategies(base, names)
        sample = data.batches(0)[self.rank].inputs
        self.planner_info: dict[str, Any] = {}
        auto, plan_s, auto_error = self.auto_strategy(base, sample)
        auto16, plan16_s, auto16_error = self.auto_strategy(base, sample, lossy=True)
        autop, planp_s, autop_error = self.auto_strategy(base, None)
        keys = {strategy_key(s): n for n, s in strategies.items()}
        for name, s in (("Auto", auto), (AUTO_FP16, auto16), (AUTO_PROFILE, autop)):
            if s is None:
                continue
            if strategy_key(s) in keys:  # a built-in's strategy: measured once, as theirs
                same[name] = keys[strategy_key(s)]
            else:
                strategies[name] = s
                keys[strategy_key(s)] = name
        preds, pred_errors, predict_s = self.predict(z, base_state, strategies, sample)
        del base
        self.log(f"{z.name}: building {', '.join(strategies)} + DDP"
                 + (f" (same strategy: {same})" if same else ""))
        variants = [self.build_variant(n, z, base_state, s, warmup)
                    for n, s in strategies.items()]
        variants.append(self.build_variant("DDP", z, base_state, None, warmup))
        phase = Phase(z.name, lambda sparse: None, data.batches, z.loss, [], steps, warmup)
        t0 = time.perf_counter()
        for step in range(warmup + steps):
            batches = data.batches(step)
            active = [v for v in variants if v.error is None]
            for v in step_order(active, a.seed, step):
                self.visit(v, step, batches[self.rank], phase)
            if step % 5 == 4 or step == warmup + steps - 1:
                self.log(f"{z.name}: step {step + 1}/{warmup + steps} "
                         f"({time.perf_counter() - t0:.0f} s)")
        every = _gather_json({v.name: (v.times, v.tx) for v in variants}, self.world)
        confirm = self.confirm(z, variants, every, same, steps, warmup, data, phase)
        for v in variants:
            close = getattr(v.model, "close", None)
            if v.error is None and callable(close):
                close()
        result: dict[str, Any] = {}
        if self.rank == 0:
            result = self.case_record(z, variants, every, errors, same, preds, pred_errors,
                                      auto_error, plan_s, predict_s, steps, warmup)
            if auto16_error and AUTO_FP16 not in result["variants"]:
                result["variants"][AUTO_FP16] = {"status": auto16_error}
            if autop_error and AUTO_PROFILE not in result["variants"]:
                result["variants"][AUTO_PROFILE] = {"status": autop_error}
            result["auto_fp16_build_s"] = round(plan16_s, 3) if plan16_s else None
            result["planner"] = self.planner_info
            if confirm:
                result["confirm"] = confirm
            result["calibration"] = getattr(self, "calibration", None)
            result["host"] = {"loadavg_1m_start": round(load0, 2),
                              "loadavg_1m_end": round(os.getloadavg()[0], 2)}
        for v in variants:
            v.model = v.opt = None
        gc.collect()
        return result

    def visit(self, v: Variant, step: int, batch: Any, phase: Phase) -> None:
        """One timed step of ``v``, after ``--settle`` untimed steps of it on the same batch:
        the variants share the processes, and the first step after another variant's pays
        for that one's after-effects (its freed buffers faulted in again, caches refilled),
        which a job training one strategy never sees."""
        for _ in range(self.args.settle):
            if v.error is None:
                self.timed_step(v, -1, batch, phase)  # step -1: before warm-up, not recorded
        if v.error is None:
            self.timed_step(v, step, batch, phase)

    def confirm(self, z: Any, variants: list[Variant], every: list[Any], same: dict[str, str],
                steps: int, warmup: int, data: Any, phase: Phase) -> dict[str, Any]:
        """Re-measure Auto (and Auto_fp16, Auto_profile) against the best built-in it is
        judged by, when slower in the main run: the pair alone, interleaved, at least as
        many steps again and more while within ``--confirm-s`` (at most
        ``--confirm-max-steps``), with a 90% bootstrap interval of the ratio (Auto as the
        built-in whose strategy it chose, when it chose one's). The best
        of eight built-ins measured once is the minimum of eight noisy medians -- biased low
        when several lie within the noise (at 4 workers on 2 cores a median of 30 DLRM steps
        moves by about 3%) -- so the pick is confirmed on fresh steps, as a selection is
        tested on data it was not made on. Every rank computes the same pairs from the
        gathered times. Empty: nothing to confirm."""
        live = {v.name: v for v in variants if v.error is None and v.times}
        medians = {n: statistics.median(job_steps([every[r][n][0] for r in range(self.world)]))
                   for n in live}
        builtin = {n: t for n, t in medians.items() if n not in NOT_BUILTIN_VARIANTS}
        lossless = {n: t for n, t in builtin.items() if n not in LOSSY}
        pairs = []  # (variant, the name it was measured as, the built-in it is judged by)
        for auto, pool in (("Auto", lossless), (AUTO_FP16, builtin), (AUTO_PROFILE, lossless)):
            measured = same.get(auto, auto)  # a built-in's strategy: measured as that one
            if measured not in medians or not pool:
                continue  # not run
            best = min(pool, key=lambda n: pool[n])
            if measured != best and medians[measured] > pool[best]:
                pairs.append((auto, measured, best))
        # Issue 44's comparisons with plain DDP (and the ddp engine's fp16 with this
        # runtime's), where the first pass read them slower: the same re-measurement.
        for label, measured, base in DDP_PAIRS:
            measured = same.get(measured, measured)
            if measured in medians and base in medians and measured != base \
                    and medians[measured] > medians[base]:
                pairs.append((label, measured, base))
        if not pairs:
            return {}
        from stratagem.planner.trial import over_budget

        names = sorted({n for _, *pair in pairs for n in pair})
        self.log(f"{z.name}: confirming {[(a, b) for _, a, b in pairs]} on at least {steps} "
                 f"fresh steps (up to {self.args.confirm_s:g} s)")
        start = {n: len(live[n].times) for n in names}
        t0 = time.perf_counter()
        done = 0
        while done < steps or (done < self.args.confirm_max_steps
                               and not over_budget(t0, self.args.confirm_s)):
            step = warmup + steps + done
            batches = data.batches(step)
            for v in step_order([live[n] for n in names], self.args.seed, step):
                if v.error is None:
                    self.visit(v, step, batches[self.rank], phase)
            done += 1
        fresh = _gather_json({n: live[n].times[start[n]:] for n in names}, self.world)
        out: dict[str, Any] = {"steps": done, "pairs": []}
        if self.rank != 0:  # the record is rank 0's (and the bootstrap intervals take time)
            return out
        for auto, measured, best in pairs:
            job = {n: job_steps([fresh[r][n] for r in range(self.world)])
                   for n in (measured, best)}
            if not job[measured] or not job[best]:
                continue
            a, b = statistics.median(job[measured]), statistics.median(job[best])
            out["pairs"].append({"auto": auto, "measured_as": measured, "builtin": best,
                                 "first_ratio": round(medians[measured] / medians[best], 4),
                                 "median_s": {measured: round(a, 5), best: round(b, 5)},
                                 "ratio": round(a / b, 4),
                                 "ratio_ci90": [round(x, 4) for x in
                                                ratio_interval(job[measured], job[best])],
                                 "step_s": {n: [round(t, 5) for t in job[n]] for n in job}})
        return out

    def case_record(self, z: Any, variants: list[Variant], every: list[Any],
                    errors: dict[str, str], same: dict[str, str],
                    preds: dict[str, float | None], pred_errors: dict[str, str],
                    auto_error: str | None, plan_s: float, predict_s: float, steps: int,
                    warmup: int) -> dict[str, Any]:
        have_pred = predictor() is not None
        recs: dict[str, dict[str, Any]] = {}
        for v in variants:
            rec: dict[str, Any] = {"status": "ok" if v.error is None else v.error}
            if v.times and v.error is None:
                job = job_steps([every[r][v.name][0] for r in range(self.world)])
                rec["median_step_s"] = round(statistics.median(job), 5)
                rec["step_s"] = [round(t, 5) for t in job]
                rec["tx_bytes_per_step_rank0"] = int(statistics.median(every[0][v.name][1]))
                if v.parts:  # rank 0's own step split (ps_vs_ddp.STEP_PARTS), medians
                    rec["parts_rank0_s"] = {k: round(statistics.median(x), 5) for k, x
                                            in zip(STEP_PARTS, zip(*v.parts, strict=True),
                                                   strict=True)}
            if v.name != "DDP":
                rec["predicted_step_s"] = preds.get(v.name) if have_pred else None
                if v.name in getattr(self, "pred_parts", {}):
                    rec["predicted_parts_s"] = self.pred_parts[v.name]
                if not have_pred:
                    rec["prediction"] = NOT_AVAILABLE
                elif v.name in pred_errors:
                    rec["prediction"] = f"failed: {pred_errors[v.name]}"
                meas, pred = rec.get("median_step_s"), rec.get("predicted_step_s")
                rec["prediction_error"] = (round(abs(pred - meas) / meas, 4)
                                           if meas and pred is not None else None)
            recs[v.name] = rec
        for name, err in errors.items():
            recs[name] = {"status": err}
        for name, first in same.items():
            recs[name] = {**recs.get(first, {}), "same_as": first}
        if "Auto" not in recs:
            recs["Auto"] = {"status": auto_error or NOT_AVAILABLE, "predicted_step_s": None,
                            "prediction_error": None}
        return {"model": z.name, "summary": z.summary, "nodes": self.world,
                "link_gbps": self.args.link_gbps or None, "local_batch": z.local_batch,
                "config": z.config, "steps": steps, "warmup": warmup, "settle": self.args.settle,
                "variants": recs, "auto_build_s": round(plan_s, 3) if plan_s else None,
                "predict_s_all_strategies": round(predict_s, 3) if have_pred else None,
                **case_ratios(recs)}


def case_ratios(recs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Best built-in (any, and lossless only), Auto's ratios to them and to DDP, Auto_fp16's
    to the best built-in, prediction error summary."""
    def med(name: str) -> float | None:
        return (recs.get(name) or {}).get("median_step_s")

    builtin = {n: med(n) for n in recs if n not in NOT_BUILTIN_VARIANTS and med(n)}
    best = min(builtin, key=lambda n: builtin[n]) if builtin else None
    lossless = {n: t for n, t in builtin.items() if n not in LOSSY}
    best_ll = min(lossless, key=lambda n: lossless[n]) if lossless else None
    auto, ddp, hyb, auto16 = med("Auto"), med("DDP"), med(HYBRID), med(AUTO_FP16)
    autop = med(AUTO_PROFILE)
    errs = [r["prediction_error"] for r in recs.values()
            if r.get("prediction_error") is not None and "same_as" not in r]
    return {
        "best_builtin": best,
        "best_builtin_step_s": builtin.get(best) if best else None,
        "auto_over_best_builtin": round(auto / builtin[best], 4) if auto and best else None,
        "best_lossless_builtin": best_ll,
        "auto_over_best_lossless": (round(auto / lossless[best_ll], 4)
                                    if auto and best_ll else None),
        "auto_fp16_over_best_builtin": (round(auto16 / builtin[best], 4)
                                        if auto16 and best else None),
        "auto_profile_over_best_lossless": (round(autop / lossless[best_ll], 4)
                                            if autop and best_ll else None),
        "auto_over_ddp": round(auto / ddp, 4) if auto and ddp else None,
        "hybrid_ref_over_best_builtin": round(hyb / builtin[best], 4) if hyb and best else None,
        "ddp_over_best_builtin": round(ddp / builtin[best], 4) if ddp and best else None,
        "ddp_engine_over_ddp": (round(med(DDP_ENGINE) / ddp, 4)
                                if med(DDP_ENGINE) and ddp else None),
        "ddp_engine_fp16_over_fp16": (round(med(DDP_ENGINE_FP16) / med(FP16), 4)
                                      if med(DDP_ENGINE_FP16) and med(FP16) else None),
        "prediction_error_median": round(statistics.median(errs), 4) if errs else None,
        "prediction_error_max": round(max(errs), 4) if errs else None,
    }


def ratio_interval(a: list[float], b: list[float], resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of ``median(a) / median(b)`` (seeded: the same steps give
    the same interval). How far the confirmed ratio could move on other steps of the same
    pair: two strategies that tie read anywhere inside it."""
    import random

    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a)))
                    / statistics.median(rng.choices(b, k=len(b))) for _ in range(resamples))
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def _engine_why(choice: Any) -> str | None:
    """Which engine runs the chosen strategy's all-reduce groups, and why (explain)."""
    try:
        from stratagem.planner.explain import engine_line
    except ImportError:  # (an older planner)
        return None
    return engine_line(choice)


def _chosen_groups(choice: Any) -> list[dict[str, Any]]:
    """The chosen strategy by parameter group, as the explanation shows it (how each group
    is synchronized, its parameters, bytes and owners)."""
    from stratagem.planner.explain import chosen_plan, groups

    return groups(chosen_plan(choice))


def refined_errors(case: dict[str, Any]) -> list[float]:
    """Prediction errors of the built-in variants (and HybridRef) after the low-shot
    refinement (``planner.fit`` of Auto's trial steps in this case: a factor for the
    predicted CPU part, one for the wire part, one for the sparse pulls), leave-one-out:
    a variant's own trial, if it had one, is left out of the fit that rescales it."""
    from stratagem.planner.trial import Trial, fit

    info = (case.get("planner") or {}).get("Auto") or {}
    trials = [Trial.from_dict(t) for t in info.get("trials", [])]
    if not trials:
        return []
    errs = []
    for name, v in case.get("variants", {}).items():
        meas, pred = v.get("median_step_s"), v.get("predicted_step_s")
        if name in ("Auto", AUTO_FP16, AUTO_PROFILE, "DDP") or "same_as" in v or not meas \
                or pred is None:
            continue
        parts = v.get("predicted_parts_s") or {}
        cpu = parts.get("compute_s", pred) + parts.get("overhead_s", 0.0)
        wire = parts.get("exposed_comm_s", 0.0)
        r = fit([t for t in trials if t.name != name])
        refined = r.seconds(cpu, wire, parts.get("sparse_pull", 0.0)) if r else pred
        errs.append(abs(refined - meas) / meas)
    return errs


def repeat_errors(case: dict[str, Any]) -> list[float]:
    """How far one measurement of a strategy is from another of the same strategy in the
    same run: ``|trial - benchmark| / benchmark`` for every trial of Auto's whose strategy
    is a measured variant (the trial steps, minutes before, on one sample batch, in the
    same worker processes). What no prediction can be expected to beat: a model that
    predicted the trial exactly would err by this much on the benchmark's number."""
    info = (case.get("planner") or {}).get("Auto") or {}
    variants = case.get("variants", {})
    errs = []
    for t in info.get("trials", []):
        v = variants.get(t.get("name"))
        if v is not None and "same_as" in v:
            v = variants.get(v["same_as"])
        meas = (v or {}).get("median_step_s")
        if meas and t.get("measured_s"):
            errs.append(abs(t["measured_s"] - meas) / meas)
    return errs


AUTOS = ("Auto", AUTO_FP16, AUTO_PROFILE)


def run_to_run(earlier: dict[str, Any], later: dict[str, Any]) -> list[dict[str, Any]]:
    """Every strategy measured in two runs' cases (the same case key and variant, measured
    in its own right in both, not ``= name``; not Auto's, whose strategy may differ from
    run to run): its median step in each, how far the earlier measurement lies from the
    later one, ``|earlier - later| / later`` -- the error of a prediction that matched the
    earlier run exactly, judged as the later run judges the model -- and the model's own
    prediction error in the later run."""
    rows = []
    for key, case in later.items():
        before = earlier.get(key)
        if before is None:
            continue
        for name, v in case.get("variants", {}).items():
            u = before.get("variants", {}).get(name) or {}
            a, b = u.get("median_step_s"), v.get("median_step_s")
            if not a or not b or "same_as" in v or "same_as" in u or name in AUTOS:
                continue
            rows.append({"case": key, "group": f"{case['nodes']} nodes {case['link']}",
                         "variant": name, "earlier_s": a, "later_s": b,
                         "difference": abs(a - b) / b,
                         "prediction_error": v.get("prediction_error")})
    return rows


def run_to_run_markdown(rows: list[dict[str, Any]]) -> str:
    """Per (nodes, link) and over all: how many strategies, the run-to-run difference's
    median and worst and how many above 0.30, beside the model's prediction errors."""
    groups = list(dict.fromkeys(r["group"] for r in rows)) + ["all"]
    lines = ["| group | strategies | run to run: median | worst | > 0.30 |"
             " prediction error: median | worst | > 0.30 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for g in groups:
        rs = [r for r in rows if g in ("all", r["group"])]
        diff = [r["difference"] for r in rs]
        pred = [r["prediction_error"] for r in rs if r["prediction_error"] is not None]
        cells = [f"{_r(statistics.median(x))} | {_r(max(x))} | {sum(e > 0.30 for e in x)}"
                 if x else "– | – | –" for x in (diff, pred)]
        lines.append(f"| {g} | {len(rs)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def confirmed_ratio(case: dict[str, Any], auto: str, key: str) -> float | None:
    """``auto``'s ratio to the best built-in it is judged by: re-measured on fresh steps
    where the case confirmed it (:meth:`AutoWorker.confirm`), else the main run's."""
    for pair in (case.get("confirm") or {}).get("pairs", []):
        if pair.get("auto") == auto and pair.get("ratio") is not None:
            return pair["ratio"]
    return case.get(key)


def targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's benchmark targets over the measured cases: value, goal and whether met
    (None: not measurable, e.g. no planner)."""
    def vals(key: str) -> list[float]:
        return [c[key] for c in cases.values() if c.get(key) is not None]

    ratios = vals("auto_over_best_lossless")
    ratios16 = vals("auto_fp16_over_best_builtin")
    def confirmed_vals(auto: str, key: str) -> list[float]:
        return [r for c in cases.values() if (r := confirmed_ratio(c, auto, key)) is not None]

    confirmed = confirmed_vals("Auto", "auto_over_best_lossless")
    confirmed16 = confirmed_vals(AUTO_FP16, "auto_fp16_over_best_builtin")
    profiled = confirmed_vals(AUTO_PROFILE, "auto_profile_over_best_lossless")
    errs = [v["prediction_error"] for c in cases.values()
            for v in c.get("variants", {}).values()
            if v.get("prediction_error") is not None and "same_as" not in v]
    med_err = round(statistics.median(errs), 4) if errs else None
    refined = [e for c in cases.values() for e in refined_errors(c)]
    med_ref = round(statistics.median(refined), 4) if refined else None
    max_ref = round(max(refined), 4) if refined else None
    repeats = [e for c in cases.values() for e in repeat_errors(c)]
    lstm4 = [round(1 / c["auto_over_ddp"], 4) for c in cases.values()
             if c.get("model") == "lstm_lm" and c.get("nodes") == 4 and c.get("auto_over_ddp")]
    build = vals("auto_build_s")
    dense = {k: c for k, c in cases.items() if c.get("model") in DENSE_44}

    def issue44(label: str) -> tuple[list[float], list[float]]:
        """The main run's ratios and the confirmed ones, over the dense cases."""
        key = CONFIRMED_KEYS[label]
        return ([c[key] for c in dense.values() if c.get(key) is not None],
                [r for c in dense.values() if (r := confirmed_ratio(c, label, key)) is not None])

    a_first, a_conf = issue44("Auto/DDP")
    e_first, e_conf = issue44(f"{DDP_ENGINE}/DDP")
    f_first, f_conf = issue44(f"{DDP_ENGINE_FP16}/{FP16}")
    dlrm = [c["auto_over_ddp"] for c in cases.values()
            if c.get("model") == "dlrm" and c.get("nodes") == 4 and c.get("auto_over_ddp")]

    def rec(name: str, goal: str, value: Any, ok: bool | None) -> dict[str, Any]:
        return {"target": name, "goal": goal, "value": value,
                "met": ok, "cases": len(cases)}

    return [
        rec("Auto / best lossless built-in, worst case", "<= 1.05", max(ratios, default=None),
            max(ratios) <= 1.05 if ratios else None),
        rec("Auto_fp16 / best built-in (fp16 included), worst case", "<= 1.05",
            max(ratios16, default=None), max(ratios16) <= 1.05 if ratios16 else None),
        rec("Auto / best lossless built-in, worst case, slower cases confirmed on fresh "
            "steps", "<= 1.05", max(confirmed, default=None),
            max(confirmed) <= 1.05 if confirmed else None),
        rec("Auto_fp16 / best built-in, worst case, slower cases confirmed on fresh steps",
            "<= 1.05", max(confirmed16, default=None),
            max(confirmed16) <= 1.05 if confirmed16 else None),
        rec("Auto_profile (offline plan, no sample batch) / best lossless built-in, worst "
            "case, slower cases confirmed (not an issue target)", "<= 1.05",
            max(profiled, default=None), max(profiled) <= 1.05 if profiled else None),
        rec("cases with Auto / best lossless built-in < 0.95", ">= 3",
            sum(r < 0.95 for r in ratios) if ratios else None,
            sum(r < 0.95 for r in ratios) >= 3 if ratios else None),
        rec("LSTM LM, 4 nodes: DDP / Auto", ">= 1.5", min(lstm4, default=None),
            min(lstm4) >= 1.5 if lstm4 else None),
        rec("prediction error, median", "<= 0.15", med_err,
            med_err <= 0.15 if med_err is not None else None),
        rec("prediction error, worst", "<= 0.30", max(errs, default=None),
            max(errs) <= 0.30 if errs else None),
        rec("prediction error after the trials' refinement (leave-one-out), median",
            "<= 0.15", med_ref, med_ref <= 0.15 if med_ref is not None else None),
        rec("prediction error after the trials' refinement (leave-one-out), worst",
            "<= 0.30", max_ref, max_ref <= 0.30 if max_ref is not None else None),
        rec("for reference: the same strategy measured twice in one run (Auto's trial "
            "steps vs the benchmark's), worst difference (not a target)", "–",
            round(max(repeats), 4) if repeats else None, None),
        rec("Auto build (calibration + planning) s, worst", "<= 40 (30 + 10)",
            max(build, default=None), max(build) <= 40 if build else None),
        *[rec(f"issue 44: {name}, dense cases, worst{how}", goal, max(v, default=None),
              max(v) <= bound if v else None)
          for name, goal, bound, first, conf in (
              ("Auto / DDP", "<= 1.00", 1.00, a_first, a_conf),
              (f"{DDP_ENGINE} / DDP", "<= 1.02", 1.02, e_first, e_conf),
              (f"{DDP_ENGINE_FP16} / {FP16}", "<= 1.00", 1.00, f_first, f_conf))
          for how, v in (("", first), (", slower cases confirmed on fresh steps", conf))],
        rec("issue 44: Auto / DDP, dense cases, median", "<= 0.97",
            round(statistics.median(a_first), 4) if a_first else None,
            statistics.median(a_first) <= 0.97 if a_first else None),
        rec("issue 44: Auto / DDP, dense cases, median, slower cases confirmed", "<= 0.97",
            round(statistics.median(a_conf), 4) if a_conf else None,
            statistics.median(a_conf) <= 0.97 if a_conf else None),
        rec("issue 44: DLRM, 4 nodes: Auto / DDP", "<= 0.95", min(dlrm, default=None),
            min(dlrm) <= 0.95 if dlrm else None),
    ]


def worker(args: argparse.Namespace) -> None:
    import torch
    from zoo import zoo

    w = AutoWorker(args)
    w.calibrate()
    models = zoo(tiny=args.tiny, lstm_vocab=args.lstm_vocab)
    cases: dict[str, Any] = {}
    for name in args.models:
        rec = w.run_case(models[name])
        if w.rank == 0:  # after every model: a run cut short keeps the cases it finished
            rec["link"] = args.link_text
            cases[case_key(name, w.world, args.link_text)] = rec
            out = {"commit": args.commit, "torch": torch.__version__,
                   "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "pinning": args.pinning, "tiny": args.tiny, "cases": cases}
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


def case_key(model: str, nodes: int, link: str) -> str:
    return f"{model}/{nodes}n/{link}"


# ----------------------------------------------------------------------------- summary
def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _confirmed_cell(case: dict[str, Any], auto: str, key: str) -> str:
    """The main run's ratio, and "-> the confirmed one" where the pair was re-measured."""
    first, again = case.get(key), confirmed_ratio(case, auto, key)
    return _r(first) if again == first else f"{_r(first)} → {_r(again)}"


def summary_markdown(result: dict[str, Any]) -> str:
    """Markdown: median step (ms) per model and variant, one column per (nodes, link); then
    per model and case the ratios, prediction errors, Auto's build time and the load."""
    cases = result.get("cases", {})
    gbps = {c["link"]: c.get("link_gbps") or 0.0 for c in cases.values()}
    cols = sorted({(c["nodes"], c["link"]) for c in cases.values()},
                  key=lambda x: (x[0], gbps[x[1]], x[1]))
    by = {(c["model"], c["nodes"], c["link"]): c for c in cases.values()}
    models = list(dict.fromkeys(c["model"] for c in cases.values()))
    head = " | ".join(f"{n} nodes {link}" for n, link in cols)
    lines = [f"| model | variant | {head} |", "|---|---|" + "---:|" * len(cols)]
    for m in models:
        names: list[str] = []
        for n, link in cols:
            for v in (by.get((m, n, link)) or {"variants": {}})["variants"]:
                if v not in names:
                    names.append(v)
        last = ("DDP", HYBRID, "Auto", AUTO_FP16, AUTO_PROFILE)
        for name in [n for n in names if n not in last] + [n for n in last if n in names]:
            cells = []
            for n, link in cols:
                v = (by.get((m, n, link)) or {"variants": {}})["variants"].get(name)
                if v is None:
                    cells.append("not run")
                elif v.get("median_step_s") is not None:
                    cells.append(_ms(v["median_step_s"])
                                 + (f" (= {v['same_as']})" if "same_as" in v else ""))
                else:
                    cells.append("n/a")
            lines.append(f"| {m} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "(→: the pair re-measured alone on fresh steps, where Auto was slower; "
              "see AutoWorker.confirm)",
              "", "| model | case | best lossless built-in | Auto / it | best built-in |"
              " Auto_fp16 / it | Auto_profile / lossless | Auto / DDP | HybridRef / best |"
              " DDP / best |"
              " pred. error median / max | refined | Auto build (s) | load 1 min |",
              "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cases.values():
        h = c.get("host", {})
        ref = refined_errors(c)
        refined = (f"{_r(statistics.median(ref))} / {_r(max(ref))}" if ref else "–")
        lines.append(
            f"| {c['model']} | {c['nodes']} nodes {c['link']} | "
            f"{c.get('best_lossless_builtin') or '–'} | "
            f"{_confirmed_cell(c, 'Auto', 'auto_over_best_lossless')} | "
            f"{c['best_builtin'] or '–'} | "
            f"{_confirmed_cell(c, AUTO_FP16, 'auto_fp16_over_best_builtin')} | "
            f"{_confirmed_cell(c, AUTO_PROFILE, 'auto_profile_over_best_lossless')} | "
            f"{_r(c['auto_over_ddp'])} | "
            f"{_r(c['hybrid_ref_over_best_builtin'])} | {_r(c['ddp_over_best_builtin'])} | "
            f"{_r(c['prediction_error_median'])} / {_r(c['prediction_error_max'])} | "
            f"{refined} | {_r(c['auto_build_s'])} | "
            f"{h.get('loadavg_1m_start')}–{h.get('loadavg_1m_end')} |")
    lines += ["", "| model | case | AllReduce_DDP / DDP | AllReduce_DDP_fp16 / AllReduce_fp16 |"
              " Auto / DDP | Auto's engine |", "|---|---|---:|---:|---:|---|"]
    for c in cases.values():
        if c.get("ddp_engine_over_ddp") is None:
            continue
        engines = {g.get("how", "").endswith("DDP")
                   for g in ((c.get("planner") or {}).get("Auto") or {}).get("groups", [])
                   if str(g.get("group", "")).startswith("allreduce")}
        engine = {frozenset({True}): "ddp", frozenset({False}): "stratagem"}.get(
            frozenset(engines), "–")
        cells = [_confirmed_cell(c, label, key) for label, key in CONFIRMED_KEYS.items()]
        lines.append(f"| {c['model']} | {c['nodes']} nodes {c['link']} | "
                     f"{cells[1]} | {cells[2]} | {cells[0]} | {engine} |")
    lines += ["", "| target (issue 12) | goal | value | met |", "|---|---|---:|---|"]
    for t in targets(cases):
        met = {True: "yes", False: "**no**",
               None: "not measured" if t["goal"] != "–" else "–"}[t["met"]]
        value = "–" if t["value"] is None else t["value"]
        lines.append(f"| {t['target']} | {t['goal']} | {value} | {met} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver side
def merge(out: Path, part: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Add ``part``'s cases to the results file (a case measured again replaces the old)."""
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    result.setdefault("benchmark", "auto_strategy")
    result.setdefault("cases", {})
    for key, case in part.get("cases", {}).items():
        case["commit"], case["date"] = part.get("commit"), part.get("date")
        result["cases"][key] = case
    result.update(meta)
    result["targets"] = targets(result["cases"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _worker_argv(args: argparse.Namespace, model: str, out: Path, link_gbps: float,
                 link_text: str, commit: str, pinning: str) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out),
            "--models", model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--lm-steps", str(args.lm_steps), "--lm-warmup", str(args.lm_warmup),
            "--settle", str(args.settle), "--confirm-s", str(args.confirm_s),
            "--confirm-max-steps", str(args.confirm_max_steps),
            "--dlrm-steps", str(args.dlrm_steps), "--lstm-vocab", str(args.lstm_vocab),
            "--lr", str(args.lr),
            "--seed", str(args.seed), "--pg-timeout", str(args.pg_timeout),
            "--link-gbps", str(link_gbps), "--link-text", link_text, "--commit", commit,
            "--pinning", pinning]
    if args.builders:
        argv += ["--builders", *args.builders]
    if args.tiny:
        argv.append("--tiny")
    if args.auto_builder != "Auto":
        argv += ["--auto-builder", args.auto_builder]
    if args.verbose_errors:
        argv.append("--verbose-errors")
    return argv


def _run(proc: subprocess.Popen[bytes], timeout: int, what: str) -> int:
    t0 = time.perf_counter()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"{what}: timed out after {timeout} s", file=sys.stderr)
        code = 124
    print(f"{what}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
    return code


def _collect(part_file: Path, args: argparse.Namespace, commit: str) -> None:
    if not part_file.exists():
        return
    meta = {"method": METHOD, "host": {"cpus": os.cpu_count(),
                                       "python": platform.python_version()},
            "planner": {"auto_registered": auto_registered(args.auto_builder),
                        "auto_builder": args.auto_builder,
                        "predict_step_time": predictor() is not None}}
    merge(Path(args.out), json.loads(part_file.read_text()), meta)


METHOD = {
    "interleaved": "every variant in the same processes, a seeded random order per step",
    "processes": "each model in a job of its own (fresh worker processes), as a user's "
                 "job calibrates, probes and trains one model",
    "step_time": "median over measured steps of the max over ranks",
    "prediction_error": "|predicted - measured| / measured (stratagem.planner."
                        "predict_step_time, called with the variant's strategy)",
    "auto_build_s": "AutoDist(strategy_builder='Auto').build_strategy(model): calibration, "
                    "link probe, planning and trial steps",
    "auto_fp16": "Auto_fp16 = Auto(compressors=('none', 'fp16')), judged against every "
                 "built-in incl. AllReduce_fp16; Auto (lossless) against the lossless "
                 "built-ins (AllReduce_fp16 excluded)",
    "prediction": "predict_step_time(..., probe=True): calibrated, links measured in the "
                  "workers",
    "same_as": "a builder whose strategy equals an earlier one's is measured once",
    "settle": "each timed step of a variant follows --settle untimed steps of it (the "
              "first step after another variant's pays for that one's after-effects)",
    "confirm": "where Auto measured slower than the best built-in it is judged by, the "
               "pair alone, interleaved, on fresh steps: at least the case's step count, "
               "then more while within --confirm-s seconds (at most --confirm-max-steps); "
               "ratio_ci90: a 90% bootstrap interval of the ratio of medians; the same for "
               "issue 44's pairs (Auto / DDP, AllReduce_DDP / DDP, AllReduce_DDP_fp16 / "
               "AllReduce_fp16) where the first pass read them slower",
    "ddp_baseline": "DDP = torch DistributedDataParallel(model) with its defaults (25 MiB "
                    "buckets, 1 MiB first bucket, buffers broadcast before each forward, "
                    "no comm hook) on the same gloo group",
    "optimizer": "SGD",
}


def driver(args: argparse.Namespace) -> int:
    """Every case on its cluster, each model in a job of its own: fresh worker processes
    calibrate, probe and train it, as a user's job does. (In workers that had run other
    models first, the allocator's free memory served a fresh 102 MB gradient without page
    faults in calibration but not in the training steps: the LSTM LM's backward read 13.6
    ms against 41, in two runs of six, and its Auto step was predicted 52% fast.)"""
    commit = _commit()
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.loopback:
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
            for model in args.models:
                part = Path(tmp) / f"part_{model}.json"
                argv = [sys.executable, "-m", "stratagem", "run", "-q", "--nproc",
                        str(args.loopback),
                        *_worker_argv(args, model, part, 0.0, "loopback", commit, "")]
                code = _run(subprocess.Popen(argv, env=env), args.timeout,
                            f"{model}, loopback, {args.loopback} workers")
                rc = rc or code
                _collect(part, args, commit)
            return rc
        VirtualCluster = virtual_cluster()
        if VirtualCluster is None:
            return 0
        for nodes in args.nodes:
            cpus = pinned_cpus(nodes)
            pinning = ":".join(",".join(map(str, c)) for c in cpus)
            for bw in args.bandwidth:
                with VirtualCluster(nodes, bandwidth=bw, delay=args.delay, cpus=cpus,
                                    prefix=args.prefix, subnet=args.subnet) as vc:
                    spec = vc.write_resource_spec(Path(tmp) / "spec.yml")
                    shell = (f"{sys.executable} {ROOT / 'tools' / 'vcluster.py'} exec "
                             f"--prefix {args.prefix} {{address}} --")
                    for model in args.models:
                        part = Path(tmp) / f"part_{nodes}_{bw}_{model}.json"
                        argv = [sys.executable, "-m", "stratagem", "run", "-q",
                                "--resource-spec", str(spec), "--remote-shell", shell,
                                *_worker_argv(args, model, part, vc.bandwidth_gbps or 0.0,
                                              bw, commit, pinning)]
                        code = _run(vc.run(0, argv), args.timeout,
                                    f"{model}, {nodes} nodes, {bw}")
                        rc = rc or code
                        _collect(part, args, commit)
    return rc


def main() -> int:
    from zoo import MODEL_NAMES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--summary", action="store_true", help="print a markdown table of --out")
    p.add_argument("--against", metavar="EARLIER_JSON",
                   help="with --summary: compare --out's measurements with an earlier run's")
    p.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=list(MODEL_NAMES))
    p.add_argument("--builders", nargs="+",
                   help="only these variants (builder names, AllReduce_fp16, HybridRef); "
                        "DDP and Auto always run")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bandwidth", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--loopback", type=int, default=0, metavar="N",
                   help="run N workers on this machine over loopback instead (no root)")
    p.add_argument("--tiny", action="store_true", help="the zoo's tiny models (for tests)")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--prefix", default="sgauto")
    p.add_argument("--subnet", default="10.86.0.0/24")
    p.add_argument("--steps", type=int, default=10, help="measured steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lm-steps", type=int, default=5, help="measured steps, LSTM LM")
    p.add_argument("--dlrm-steps", type=int, default=30,
                   help="measured steps, DLRM (at least --steps): its PS steps take "
                        "20-80 ms and vary by +-10%% step to step, so 10 decide little")
    p.add_argument("--lm-warmup", type=int, default=1)
    p.add_argument("--confirm-s", type=float, default=15.0,
                   help="a confirmation runs at least as many steps as the case, then "
                        "more while within this many seconds (short steps: a median of "
                        "30 DLRM steps at 2 nodes moves by 5-10%%)")
    p.add_argument("--confirm-max-steps", type=int, default=400)
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps of a variant before each timed one (see visit)")
    p.add_argument("--lstm-vocab", type=int, default=200_000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=int, default=180, help="collective timeout (s)")
    p.add_argument("--timeout", type=int, default=3600,
                   help="per job: one model on one cluster (s)")
    p.add_argument("--verbose-errors", action="store_true")
    p.add_argument("--auto-builder", default="Auto",
                   help="the builder measured as Auto (tests: any registered name)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--link-gbps", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--link-text", default="", help=argparse.SUPPRESS)
    p.add_argument("--commit", default="unknown", help=argparse.SUPPRESS)
    p.add_argument("--pinning", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.against and not args.summary:
        p.error("--against compares two runs' results: use it with --summary")
    if args.worker:
        worker(args)
        return 0
    if args.summary:
        later = json.loads(Path(args.out).read_text())
        print(summary_markdown(later))
        if args.against:
            earlier = json.loads(Path(args.against).read_text())
            print("\n" + run_to_run_markdown(run_to_run(earlier.get("cases", {}),
                                                        later.get("cases", {}))))
        return 0
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
