"""The explanation of a planner choice: text tables within 80 columns, or JSON. Text that
does not fit is wrapped onto the next lines, never cut.

It shows the chosen strategy by parameter group, the predicted step split into compute,
exposed communication and overheads, bytes per step on each link, the measured access of
row-sparse parameters, and the best alternatives with the part of the step they lost on.
"""

from __future__ import annotations

import textwrap
from typing import Any

import torch

from stratagem.planner.cost_model import StepCost
from stratagem.planner.search import Candidate, Choice
from stratagem.planner.trial import RACED, Trial, fit, refined_s
from stratagem.runtime.plan import Plan, compile_plan
from stratagem.strategy.schema import AllReduceSynchronizer, Strategy

WIDTH = 80
ALTERNATIVES = 5


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def chunks(text: str, n: int) -> list[str]:
    """``text`` in pieces of at most ``n`` characters, broken after a space, dot or slash
    (else an underscore) in the second half of a piece (else at ``n``); joined, the
    pieces (spaces at the breaks dropped) give ``text`` back."""
    out = []
    while len(text) > n:
        cut = max(text.rfind(c, n // 2, n) for c in " ./")  # an underscore only
        if cut < 0:  # where no word or dotted part ends in the second half
            cut = text.rfind("_", n // 2, n)
        cut = n if cut < 0 else cut + 1
        out.append(text[:cut].rstrip(" "))
        text = text[cut:].lstrip(" ") if text[cut - 1] == " " else text[cut:]
    return [*out, text]


def _wrap(text: str, n: int = WIDTH) -> str:
    """A line of prose within ``n`` columns: the rest on indented lines below."""
    return textwrap.fill(text, n, subsequent_indent="    ", break_long_words=True,
                         break_on_hyphens=False)


def chosen_plan(choice: Choice) -> Plan:
    """The chosen strategy compiled as rank 0 runs it: what the explanation describes."""
    return compile_plan(choice.best.strategy, choice.profile, rank=0,
                        world_size=choice.spec.num_workers, device=torch.device("cpu"))


def groups(plan: Plan) -> list[dict[str, Any]]:
    """The plan by unit: all-reduce groups, gathered rows, then PS rows / dense pieces (one
    row each, with their owners), from :meth:`Plan.routes` as the runtime runs them."""
    out: dict[str, dict[str, Any]] = {}
    for r in plan.routes():
        if r.kind == "gathered rows":
            key, how = "gathered rows", "all-gather"  # one collective each; shown together
        elif r.kind == "all-reduce":
            key, how = f"allreduce {r.unit}", r.how
        elif r.kind == "sharded":
            key, how = f"sharded {r.how.removeprefix('stage ')}", r.how
        else:
            key, how = f"ps {'rows' if r.kind == 'PS sparse rows' else 'dense'}", r.how
        g = out.setdefault(key, {"group": key, "kind": r.kind, "how": how, "params": [],
                                 "bytes": 0, "owners": set()})
        if r.param not in g["params"]:
            g["params"].append(r.param)
        g["bytes"] += r.nbytes
        if r.kind.startswith("PS"):
            g["owners"].add(r.destination)
    for g in out.values():
        g["owners"] = sorted(g["owners"])
    return list(out.values())


def engine_of(strategy: Strategy) -> str | None:
    """The engine of the strategy's all-reduce groups (None: it has none)."""
    return next((leaf.synchronizer.engine for nc in strategy.node_config
                 for leaf in nc.leaves()
                 if isinstance(leaf.synchronizer, AllReduceSynchronizer)), None)


def engine_line(choice: Choice) -> str:
    """Which engine runs the all-reduce groups, and why: the best candidate on the other
    engine and what it lost by (trial steps when both were measured, else predictions)."""
    best = choice.best
    engine = engine_of(best.strategy)
    if engine is None:
        return "engine: none (no all-reduce groups)"
    who = "torch's DDP reducer" if engine == "ddp" else "Stratagem's reducer"
    other = [c for c in choice.candidates
             if c is not best and engine_of(c.strategy) not in (None, engine)]
    if not other:
        return f"engine: {engine} ({who}); no candidate on the other engine fits this model"
    alt = other[0]
    trial, best_trial = _trials(choice, alt)
    if (trial is not None and best_trial is not None and trial.measured_s is not None
            and best_trial.measured_s is not None):
        why = (f"trial steps {_ms(best_trial.measured_s)} vs {_ms(trial.measured_s)} ms "
               f"for {alt.name}")
    else:
        why = f"predicted {_ms(best.cost.total_s)} vs {_ms(alt.cost.total_s)} ms for {alt.name}"
    return f"engine: {engine} ({who}): {why} on {engine_of(alt.strategy)}"


def why_lost(alt: StepCost, best: StepCost, trial: Trial | None = None,
             best_trial: Trial | None = None) -> str:
    """The part of the step where ``alt`` loses most against ``best`` (or, when both
    ran trial steps, their measured times)."""
    if (trial is not None and best_trial is not None and trial.measured_s is not None
            and best_trial.measured_s is not None):
        return (f"trial steps {_ms(trial.measured_s)} vs {_ms(best_trial.measured_s)} ms "
                "measured")
    deltas = {"compute": alt.compute_s - best.compute_s,
              "exposed communication": alt.exposed_comm_s - best.exposed_comm_s,
              "overheads": alt.overhead_s - best.overhead_s}
    part, delta = max(deltas.items(), key=lambda kv: kv[1])
    if delta <= 0:
        return "tie (same prediction)"
    wire = sum(v for k, v in alt.link_bytes.items() if k.endswith("tx"))
    best_wire = sum(v for k, v in best.link_bytes.items() if k.endswith("tx"))
    extra = (f", {wire / 1e6:.1f} vs {best_wire / 1e6:.1f} MB sent"
             if part == "exposed communication" and wire != best_wire else "")
    if part == "overheads":
        extra = f", {alt.parts.get('messages', 0):.0f} messages"
    return f"{part} +{_ms(delta)} ms{extra}"


def _trials(choice: Choice, alt: Candidate) -> tuple[Trial | None, Trial | None]:
    """(``alt``'s trial, the chosen candidate's trial), None where not run."""
    by = {t.name: t for t in choice.trials}
    return by.get(alt.name), by.get(choice.best.name)


def explain_json(choice: Choice, plan: Plan | None = None) -> dict[str, Any]:
    """The explanation as JSON; ``plan``: the chosen strategy's compiled plan (compiled
    here when not given)."""
    best = choice.best
    plan = plan or chosen_plan(choice)
    refinement = fit(choice.trials)
    return {
        "chosen": best.name,
        "strategy": best.strategy.to_dict(),
        "workers": choice.spec.num_workers,
        "nodes": len(choice.spec.nodes),
        "calibration": choice.calibration.to_dict(),
        "search_s": choice.search_s,
        "predicted": best.cost.to_dict(),
        "groups": groups(plan),
        "engine": engine_of(best.strategy), "engine_why": engine_line(choice),
        "alternatives": [{"name": c.name, "predicted": c.cost.to_dict(),
                          "refined_s": (refined_s(c.cost, refinement)
                                        if refinement is not None else None),
                          "why_lost": why_lost(c.cost, best.cost, *_trials(choice, c))}
                         for c in choice.candidates[1:]],
        "notes": list(choice.notes),
        "links_measured": choice.link_probe.to_dict() if choice.link_probe else None,
        "trials": [t.to_dict() for t in choice.trials],
        "refinement": refinement.to_dict() if refinement is not None else None,
    }


def _table(rows: list[list[str]], widths: list[int], right: set[int]) -> list[str]:
    """Rows in columns of ``widths``; a cell wider than its column goes on in the same
    column on the next lines (the other cells blank there)."""
    lines = []
    for r in rows:
        pieces = [chunks(c, w) for c, w in zip(r, widths, strict=True)]
        for k in range(max(len(p) for p in pieces)):
            cells = [(p[k] if k < len(p) else "") for p in pieces]
            lines.append("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                          for i, (c, w) in enumerate(zip(cells, widths,
                                                                         strict=True))
                                          ).rstrip())
    return lines


def explain_text(choice: Choice, alternatives: int = ALTERNATIVES,
                 plan: Plan | None = None) -> str:
    """The explanation as text; ``plan`` as for :func:`explain_json`."""
    best: Candidate = choice.best
    plan = plan or chosen_plan(choice)
    cost, cal, spec = best.cost, choice.calibration, choice.spec
    how = (f"calibrated in {cal.seconds:.1f} s" if cal.measured
           else "estimated from the profile (no sample batch)")
    lines = [_wrap(f"Auto chose {best.name} for {spec.num_workers} workers on "
                  f"{len(spec.nodes)} node(s), batch {cal.batch_size}/worker", WIDTH),
             _wrap(f"costs {how}; search {choice.search_s:.2f} s", WIDTH),
             _wrap(f"predicted step {_ms(cost.total_s)} ms = compute {_ms(cost.compute_s)}"
                  f" + exposed comm {_ms(cost.exposed_comm_s)} + overheads "
                  f"{_ms(cost.overhead_s)}", WIDTH), "", "parameter groups:"]
    rows = [["group", "sync", "params", "MiB", "first parameter"]]
    for g in groups(plan):
        rows.append([g["group"], g["how"], str(len(g["params"])),
                     f"{g['bytes'] / 2**20:.2f}", g["params"][0]])
    lines += _table(rows, [13, 10, 6, 9, 30], {2, 3})
    lines += ["", _wrap(engine_line(choice))]
    if cost.link_bytes:
        lines += ["", "bytes per step per link (MB):"]
        rows = [["link", "MB"]] + [[k, f"{v / 1e6:.2f}"]
                                   for k, v in sorted(cost.link_bytes.items())]
        lines += _table(rows, [20, 10], {1})
    sparse = [a for a in (choice.profile.access or cal.access) if a.density < 1.0]
    if sparse:
        lines += ["", "row access (per worker batch):"]
        rows = [["parameter", "rows", "touched", "overlap", "hot 1%"]]
        rows += [[a.name, str(a.rows), f"{a.rows_touched:.0f}", f"{a.overlap:.2f}",
                  f"{a.hot_share:.2f}"] for a in sparse]
        lines += _table(rows, [30, 9, 9, 8, 7], {1, 2, 3, 4})
    if choice.link_probe is not None:
        p = choice.link_probe
        alone = (f", one link alone {p.link_bps * 8 / 1e9:.2f}" if p.link_bps else "")
        lines += ["", _wrap(f"links measured ({p.seconds:.2f} s): {p.bus_bps * 8 / 1e9:.2f} "
                           f"Gbit/s all at once{alone} (spec "
                           f"{p.nominal_bps * 8 / 1e9:.2f})", WIDTH),
                  _wrap(f"  fixed costs: collective {p.collective_s * 1e6:.0f} us"
                       + (f" (a group's {p.group_fixed_s * 1e6:.0f} us)"
                          if p.group_fixed_s else "")
                       + f", message {p.message_s * 1e6:.0f} us"
                       + (f", chained all-to-all {p.all_to_all_s * 1e6:.0f} us"
                          if p.all_to_all_s else ""), WIDTH)]
        if p.pull_round_s:
            lines.append(_wrap(f"  pull round: {p.pull_round_s * 1e6:.0f} us split over owners"
                              + (f"; {p.pull_round_one_s * 1e6:.0f} us with one owner"
                                 if p.pull_round_one_s else ""), WIDTH))
        if p.interference:
            lines.append(_wrap(f"  overlap: compute beside a transfer loses "
                              f"{p.interference:.0%} of the transfer's time", WIDTH))
    if choice.trials:
        lines += ["", "trial steps (slowest rank, median):"]
        rows = [["candidate", "predicted ms", "measured ms", "error"]]
        for t in choice.trials:
            meas = "-" if t.measured_s is None else _ms(t.measured_s)
            err = ("-" if not t.measured_s else
                   f"{abs(t.predicted_s - t.measured_s) / t.measured_s:.2f}")
            raced = t.note == RACED
            rows.append([("+ " if raced else "") + t.name + (" *" if t.name == best.name else ""),
                         _ms(t.predicted_s), meas, err])
        lines += _table(rows, [24, 13, 12, 6], {1, 2, 3})
        if any(t.note == RACED for t in choice.trials):
            lines.append(_wrap("+: the second look, raced against the first trials' winner "
                              "(what their rates put level with it)", WIDTH))
        refinement = fit(choice.trials)
        if refinement is not None:
            lines.append(_wrap("the trials rescale the model: compute and overheads "
                              f"x{refinement.cpu:.2f}, exposed communication "
                              f"x{refinement.wire:.2f}", WIDTH))
            if refinement.pull is not None:
                lines.append(_wrap(f"  but the sparse rows' pulls x{refinement.pull:.2f} "
                                  "(the trials' forward, timed)", WIDTH))
    alts = choice.candidates[1:1 + alternatives]
    if alts:
        lines += ["", "best alternatives:"]
        rows = [["strategy", "step ms", "vs", "why it lost"]]
        for c in alts:
            ratio = c.cost.total_s / cost.total_s if cost.total_s else 1.0
            rows.append([c.name, _ms(c.cost.total_s), f"{ratio:.2f}x",
                         why_lost(c.cost, cost, *_trials(choice, c))])
        lines += _table(rows, [21, 9, 6, 36], {1, 2})
    return "\n".join(lines)
