"""Low-shot trial steps: time the few best-predicted strategies for real and keep the fastest.

The cost model ranks candidates; where its error (fixed costs, contention on busy cores) is
larger than the gap between them, a few measured steps decide. With a process group up
(AutoDist builds the strategy inside the workers), every worker runs, for each of the top
``k`` predicted candidates plus the best built-in builder (so Auto is never slower than it
by more than the trials' noise), a copy of the model wrapped by the runtime under that
strategy, for one warm-up and ``steps`` timed training steps on its sample batch (forward,
backward with the strategy's synchronization, an update with learning rate 0 on the copy).

Every worker takes the same decision: the candidates are rank 0's (sent as JSON), a step's
time is the slowest rank's (an all-reduce of the maximum), and rank 0's pick is broadcast.
Ties (within ``TIE``) keep the earlier, i.e. better predicted, candidate. Bounded: a
candidate whose predicted run would overrun ``BUDGET_S`` is not tried (rank 0 decides).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.planner.calibrate import call_model, default_loss
from stratagem.planner.search import Candidate, Choice
from stratagem.strategy.schema import Strategy
from stratagem.strategy.validate import server_devices, validate

TOP_K = 3
STEPS = 2
WARMUP = 1
BUDGET_S = 20.0
"""Trial steps of all candidates together stop being started past this (predicted)."""
TIE = 0.02
"""Measured steps this close (relative) count as equal: the better predicted one stays."""


@dataclass(frozen=True)
class Trial:
    """One candidate's trial: predicted and measured seconds per step (None: not run)."""

    name: str
    predicted_s: float
    measured_s: float | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_s": self.predicted_s,
                "measured_s": self.measured_s, "note": self.note}


def shortlist(choice: Choice, k: int = TOP_K) -> list[Candidate]:
    """The ``k`` best-predicted candidates (the chosen one first), plus the best-predicted
    built-in builder (registered builders with their defaults: lossless) when none is
    among them."""
    out = list(choice.candidates[:k])
    if not any(c.name != "hybrid" for c in out):
        builtin = next((c for c in choice.candidates[k:] if c.name != "hybrid"), None)
        if builtin is not None:
            out.append(builtin)
    return out


def fastest(measured: list[float | None]) -> int:
    """Index of the fastest measured candidate; one within ``TIE`` of a faster-predicted
    (earlier) one does not displace it, so equal timings give the same answer always."""
    best_i, best_t = 0, float("inf")
    for i, t in enumerate(measured):
        if t is not None and t < best_t * (1 - TIE):
            best_i, best_t = i, t
    return best_i


def _broadcast_json(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (JSON bytes, parsed strictly)."""
    payload = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if dist.get_rank() == 0
           else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return obj if dist.get_rank() == 0 else json.loads(bytes(buf.tolist()).decode())


def run_trial(model: nn.Module, strategy: Strategy, choice: Choice, sample_input: Any,
              loss_fn: Callable[[Any], torch.Tensor], steps: int = STEPS) -> float:
    """Median seconds of ``steps`` training steps (after ``WARMUP``) of a copy of
    ``model`` under ``strategy``, each the slowest rank's (collective: every worker)."""
    from stratagem.runtime import DistributedModel, compile_plan

    replica = copy.deepcopy(model)
    opt = torch.optim.SGD(replica.parameters(), lr=0.0)
    plan = compile_plan(strategy, choice.profile, rank=dist.get_rank(),
                        world_size=dist.get_world_size(), device=torch.device("cpu"),
                        servers=server_devices(choice.spec))
    dm = DistributedModel(replica, plan, optimizer=opt)
    times = []
    try:
        for i in range(WARMUP + steps):
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            loss_fn(call_model(dm, sample_input)).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= WARMUP:
                times.append(float(elapsed))
    finally:
        close = getattr(dm, "close", None)
        if callable(close):
            close()
    return statistics.median(times)


def refine(choice: Choice, model: nn.Module, sample_input: Any, *,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, k: int = TOP_K,
           steps: int = STEPS, budget_s: float = BUDGET_S) -> Choice:
    """``choice`` with its best candidate replaced by the fastest in trial steps (every
    worker calls this at once; all return the same choice). The trials go into
    ``choice.trials`` for the explanation."""
    loss_fn = loss_fn or default_loss
    started = time.perf_counter()
    # Rank 0's shortlist (its predictions) on every rank.
    plan = None
    if dist.get_rank() == 0:
        picked, spent = [], 0.0
        for c in shortlist(choice, k):
            cost = (WARMUP + steps) * c.cost.total_s
            if picked and spent + cost > budget_s:
                continue
            picked.append(c)
            spent += cost
        plan = [{"name": c.name, "predicted_s": c.cost.total_s,
                 "strategy": c.strategy.to_dict()} for c in picked]
    plan = _broadcast_json(plan)
    trials: list[Trial] = []
    strategies = []
    for entry in plan:
        s = validate(Strategy.from_dict(entry["strategy"], source="rank 0's trial candidate"),
                     choice.profile, choice.spec)
        strategies.append(s)
        measured = run_trial(model, s, choice, sample_input, loss_fn, steps)
        trials.append(Trial(entry["name"], entry["predicted_s"], measured))
    pick = torch.tensor([fastest([t.measured_s for t in trials])], dtype=torch.int64)
    dist.broadcast(pick, 0)  # the ranks' numbers are equal; rank 0's word is final
    best_i = int(pick.item())
    name = plan[best_i]["name"]
    original = next((c for c in choice.candidates if c.name == name), None)
    cost = original.cost if original is not None else choice.best.cost
    strategy = strategies[best_i]
    if name != "hybrid" and not strategy.builder.startswith("Auto"):
        strategy = replace(strategy, builder=f"Auto({name})")
    best = Candidate(name, strategy, cost)
    others = tuple(c for c in choice.candidates if c.name != name)
    note = (f"trial steps: {len(trials)} candidates, {WARMUP}+{steps} steps each, "
            f"{time.perf_counter() - started:.1f} s; kept {name}")
    return replace(choice, best=best, candidates=(best, *others), trials=tuple(trials),
                   notes=(*choice.notes, note))
