"""Low-shot trial steps: time the few best-predicted strategies for real and keep the fastest.

The cost model ranks candidates; where its error (fixed costs, contention on busy cores) is
larger than the gap between them, a few measured steps decide. With a process group up
(AutoDist builds the strategy inside the workers), every worker runs, for each of the top
``k`` predicted candidates (distinct strategies) plus the best built-in builder and the
best all-reduce-only candidate (so Auto is never slower than them by more than the
trials' noise) -- none predicted over ``DOMINATED`` times the best -- a copy of the model
wrapped by the runtime under that strategy, for one warm-up and ``steps`` timed training
steps on its sample batch (forward, backward with the strategy's synchronization, an update
with learning rate 0 on the copy); short steps are repeated up to ``MEASURE_S`` of them.

Candidates small enough are built at once and stepped in turn, the order rotating each
round (as the benchmarks interleave variants: load that comes and goes hits all alike);
large ones run one at a time. Every worker takes the same decision: the candidates are
rank 0's (sent as JSON), a step's time is the slowest rank's (an all-reduce of the
maximum), and rank 0's pick is broadcast. Ties -- within ``TIE`` or within the two trials'
spread -- keep the earlier, i.e. better predicted, candidate, except that a hybrid gives way
to a named builder's strategy within ``TIE`` of it (:func:`prefer_named`). Bounded: a
candidate whose predicted run would overrun ``BUDGET_S`` is not tried, nor is any step
round started once that much time has passed (rank 0 decides both).

Then a second look: the trials refine the cost model (:func:`fit`), and every untried
candidate whose refined prediction comes within ``SECOND_LOOK`` of the winner's measured
step is raced against the winner -- interleaved again, with more steps (``SECOND_STEPS``,
``SECOND_MEASURE_S``), and decided on the standard error of the medians rather than one
step's spread. The first shortlist follows the raw model, which errs most where steps are
CPU-bound; a candidate it ranked low but the measured rates put level gets measured.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem import env
from stratagem.distributed.process_group import broadcast_bytes
from stratagem.planner.calibrate import call_model, default_loss
from stratagem.planner.cost_model import StepCost
from stratagem.planner.search import HYBRID, Candidate, Choice, all_reduce_only
from stratagem.strategy.schema import Strategy
from stratagem.strategy.validate import server_devices, validate

TOP_K = 3
STEPS = 2
"""Timed steps per candidate at least; more for short steps (``MEASURE_S``), at most
``MAX_STEPS``."""
MAX_STEPS = 10
MEASURE_S = 0.3
"""Predicted seconds of timed steps per candidate that short steps are repeated up to."""
WARMUP = 1
BUDGET_S = 20.0
"""Trial steps of all candidates together stop being started past this (predicted)."""
INTERLEAVE_BYTES = 2 ** 30
COPIES = 3
"""Candidates are stepped in turn (all built at once) while their copies -- about
``COPIES`` times the parameters each: values, gradients, buffers -- fit in
``INTERLEAVE_BYTES`` per process and in the room every rank has for them
(:func:`trial_room`: a share of the host's available memory, and on a GPU of its free
memory too);
else one at a time, and not at all where one copy does not fit."""
GPU_SHARE = 0.5
"""Of a GPU's free memory, what trial copies may take (the rest: their activations, the
allocator's slack)."""
HOST_SHARE = 0.5
"""Of the host's available memory, what the trial copies of this machine's workers may take
together (the rest: their activations, the job's own growth)."""
UNKNOWN_ROOM = 2 ** 62
"""Room where the host does not say how much memory is available (not checked)."""
TIE = 0.05
"""Measured steps this close (relative) count as equal: the better predicted one stays
(the search's own tolerance; steps of a few ms vary by that much between repeats)."""
SECOND_LOOK = 1.3
"""An untried candidate whose refined prediction is within this factor of the winner's
measured step is raced against it (DLRM at 4 nodes, 10 Gbit/s: PS, ranked fifth by the raw
model and never tried, stepped 6-8% faster than the winner Parallax in two full runs).
1.15 at first; in the next full run the best built-in of all four cases where Auto's
choice re-measured above 1.05 of it had refined to 1.20-1.28x the winner's trial."""
SECOND_MAX = 3
"""Contenders raced at most (the closest by refined prediction)."""
SECOND_STEPS = (5, 30)
"""Timed steps per raced candidate, at least and at most..."""
SECOND_MEASURE_S = 1.0
"""...aiming at this many seconds of timed steps each, at the refined rate."""
Z = 2.0
"""Standard errors by which a raced candidate must beat the winner (about 95%)."""
DOMINATED = 2.0
"""A candidate predicted slower than this many times the best prediction is not tried, not
even as the best built-in or all-reduce one (the second look still races it if the
trials' refinement brings it within ``SECOND_LOOK`` of the winner). In the eight
benchmark runs of bench/results, none of the 271 trials predicted over 2x the best
measured within 1.63x of the winner (of the 420 over 1.3x, none within 1.13x); on the
LSTM LM at 4 nodes and 1 Gbit/s such trials (3.9x predicted) took most of a 58 s build."""
RACED = "second look"
"""The note of a trial run in the second look's race (the explanation marks them)."""


@dataclass(frozen=True)
class Trial:
    """One candidate's trial: predicted and measured seconds per step (None: not run)."""

    name: str
    predicted_s: float
    measured_s: float | None
    note: str = ""
    spread_s: float = 0.0
    """Median absolute deviation of the timed steps (the trial's own noise)."""
    family: str = ""
    """:func:`family` of the candidate's strategy (all-reduce only or some servers)."""
    cpu_s: float = 0.0
    """The prediction's compute and overheads (:func:`split`)..."""
    wire_s: float = 0.0
    """...and its exposed communication; both 0: not known, all of it counts as CPU."""
    forward_s: float = 0.0
    """The prediction's forward compute (:func:`pulls`)..."""
    pull_s: float = 0.0
    """...and its sparse rows' pull rounds in the forward (part of ``wire_s``)."""
    measured_forward_s: float | None = None
    """Median seconds of the trial steps' forward (the slowest rank's): with the pulls'
    own rounds in it, what the sparse exchange costs in this model's step."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_s": self.predicted_s,
                "measured_s": self.measured_s, "spread_s": self.spread_s, "note": self.note,
                "family": self.family, "cpu_s": self.cpu_s, "wire_s": self.wire_s,
                "forward_s": self.forward_s, "pull_s": self.pull_s,
                "measured_forward_s": self.measured_forward_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trial:
        """The inverse of :meth:`to_dict` (keys it lacks take their defaults)."""
        return cls(d["name"], d["predicted_s"], d.get("measured_s"), d.get("note", ""),
                   d.get("spread_s", 0.0), d.get("family", ""), d.get("cpu_s", 0.0),
                   d.get("wire_s", 0.0), d.get("forward_s", 0.0), d.get("pull_s", 0.0),
                   d.get("measured_forward_s"))


ALL_REDUCE, SERVERS = "all-reduce", "parameter servers"


def family(strategy: Strategy) -> str:
    """All-reduce only, or some parameter on servers (for reports)."""
    return ALL_REDUCE if all_reduce_only(strategy) else SERVERS


RIDGE = 0.01
"""Pull of the two factors towards their priors (in squared relative error): the CPU
factor towards the trials' common ratio (how much slower than calibrated the steps ran),
the wire factor towards 1 (the links are probed: as measured, unless trials say
otherwise). A factor the trials cannot tell apart -- the wire's when no trial waits on
the wire -- stays at its prior instead of following the noise. (With both pulled to the
common ratio, the benchmark's leave-one-out worst error was 1.87 instead of 1.15: an
all-reduce whose own trial was left out took the parameter servers' CPU slowdown for
its wire.)"""
FACTOR_RANGE = (0.5, 10.0)
"""Bounds of each factor: the parts are measured (calibration, link probe), so a step twice
as fast as they say is not believed; ten times slower is (a heavily shared machine)."""


@dataclass(frozen=True)
class Refinement:
    """Low-shot refinement of the cost model, fitted on the trial steps:
    ``measured ~ cpu * (compute + overheads) + wire * (exposed communication - pulls)
    + pull * pulls``, ``pulls`` being the sparse rows' pull rounds in the forward.

    The two parts err differently: CPU work slows down when cores are shared (four workers
    on two cores, a busy host), wire time when the link is not the bottleneck the model
    thinks it is. On DLRM at 2 nodes and 1 Gbit/s the trials measured parameter servers
    (mostly CPU) at 1.8x the model and all-reduce (mostly wire) at 1.04x; one factor for
    both would misprice one of them."""

    cpu: float = 1.0
    wire: float = 1.0
    trials: int = 0
    pull: float | None = None
    """Measured pull rounds over predicted: the trials' forward less the calibrated
    forward, over the predicted pulls (the median over trials with pulls; None: no trial
    timed any, and the pulls go with the rest of the wire). The
    link probe times a chain of synthetic rounds, one sample of waits that are bimodal
    on this machine: at 2 nodes and 10 Gbit/s it read a round at 1.5-3.4 ms from run to
    run, while wide & deep's eight rounds in the step took 10.8-14.9 ms in six runs."""

    def seconds(self, cpu_s: float, wire_s: float, pull_s: float = 0.0) -> float:
        """Refined seconds of a step predicted as ``cpu_s`` + ``wire_s``, of which
        ``pull_s`` the sparse pulls."""
        pull = self.wire if self.pull is None else self.pull
        return self.cpu * cpu_s + self.wire * (wire_s - pull_s) + pull * pull_s

    def of(self, cost: StepCost) -> float:
        """Refined seconds of a predicted step."""
        return self.seconds(*split(cost), pulls(cost)[1])

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "wire": self.wire, "pull": self.pull,
                "trials": self.trials}


def split(cost: StepCost) -> tuple[float, float]:
    """(compute + overheads, exposed communication) of a predicted step."""
    return cost.compute_s + cost.overhead_s, cost.exposed_comm_s


def pulls(cost: StepCost) -> tuple[float, float]:
    """(forward compute, the sparse pulls' rounds in the forward) of a predicted step."""
    return cost.parts.get("forward", 0.0), cost.parts.get("sparse_pull", 0.0)


def pull_factor(trials: tuple[Trial, ...] | list[Trial]) -> float | None:
    """Measured over predicted pull rounds: per trial that pulls rows in its forward and
    timed it, (measured forward - predicted forward compute) / predicted pulls; their
    median, within ``FACTOR_RANGE`` (None: no such trial)."""
    ratios = [(t.measured_forward_s - t.forward_s) / t.pull_s for t in trials
              if t.measured_forward_s is not None and t.measured_s and t.pull_s > 0]
    if not ratios:
        return None
    return min(FACTOR_RANGE[1], max(FACTOR_RANGE[0], statistics.median(ratios)))


def fit(trials: tuple[Trial, ...] | list[Trial]) -> Refinement | None:
    """The :class:`Refinement` that best explains the trials that ran (least squares in
    relative error, ridge towards the priors, see ``RIDGE``; each factor kept in
    ``FACTOR_RANGE``); None when no trial ran."""
    pull = pull_factor(trials)
    rows = []  # (cpu, wire less pulls, measured less the pulls' refined seconds, measured)
    for t in trials:
        if t.measured_s and t.predicted_s > 0:
            c, w = (t.cpu_s, t.wire_s) if t.cpu_s + t.wire_s > 0 else (t.predicted_s, 0.0)
            # the pulls, priced by their own factor, out of the fit (where one was timed)
            p = min(t.pull_s, w) if pull is not None else 0.0
            rows.append((c, w - p, t.measured_s - (pull or 0.0) * p, t.measured_s))
    if not rows:
        return None
    common = statistics.median(r / (c + w) if c + w > 0 else 1.0 for c, w, r, _ in rows)
    # minimise sum(((a c + b w - r) / y)^2) + RIDGE ((a - common)^2 + (b - 1)^2)
    saa = sab = sbb = ra = rb = 0.0
    for c, w, r, y in rows:
        c, w, r = c / y, w / y, r / y
        saa += c * c
        sab += c * w
        sbb += w * w
        ra += c * r
        rb += w * r
    saa += RIDGE
    sbb += RIDGE
    ra += RIDGE * common
    rb += RIDGE
    det = saa * sbb - sab * sab  # > 0: the ridge makes the system positive definite

    def clip(v: float) -> float:
        return min(FACTOR_RANGE[1], max(FACTOR_RANGE[0], v))

    a = (ra * sbb - rb * sab) / det
    b = (rb * saa - ra * sab) / det
    if clip(a) != a:  # a bound holds one factor: the other is refitted given it
        a = clip(a)
        b = (rb - sab * a) / sbb
    elif clip(b) != b:
        b = clip(b)
        a = (ra - sab * b) / saa
    return Refinement(cpu=clip(a), wire=clip(b), trials=len(rows), pull=pull)


def refined_s(cost: StepCost, refinement: Refinement | None) -> float:
    """``cost``'s predicted seconds, refined by the trials where they ran."""
    return refinement.of(cost) if refinement is not None else cost.total_s


def _key(strategy: Strategy) -> str:
    """What makes two candidates the same strategy, whatever their names."""
    return json.dumps([nc.to_dict() for nc in strategy.node_config], sort_keys=True)


def dominated(choice: Choice, c: Candidate) -> float | None:
    """``c``'s prediction over the best prediction of ``choice`` when that is more than
    ``DOMINATED`` (not worth a trial), else None."""
    best = min(o.cost.total_s for o in choice.candidates)
    ratio = c.cost.total_s / best if best > 0 else 1.0
    return ratio if ratio > DOMINATED else None


def shortlist(choice: Choice, k: int = TOP_K) -> list[Candidate]:
    """The ``k`` best-predicted candidates with distinct strategies (the chosen one first),
    plus the best-predicted built-in builder and the best-predicted all-reduce-only
    candidate when none is among them: the model errs most on parameter servers (their
    per-piece work), and all-reduce is what a user would run without Auto. None predicted
    more than ``DOMINATED`` times the best (:func:`dominated`), whatever it is."""
    out: list[Candidate] = []
    seen: set[str] = set()
    wants = [lambda c: c.name != HYBRID, lambda c: all_reduce_only(c.strategy)]
    for c in choice.candidates:
        key = _key(c.strategy)
        if key in seen:  # the same strategy under another name (AllReduce = Parallax ...)
            continue
        if c is not choice.best and dominated(choice, c) is not None:
            continue
        missing = [w for w in wants if not any(w(o) for o in out)]
        if len(out) < k or any(w(c) for w in missing):
            out.append(c)
            seen.add(key)
        if len(out) >= k and all(any(w(o) for o in out) for w in wants):
            break
    return out


def passed_over(choice: Choice, short: list[Candidate]) -> list[str]:
    """The best-predicted built-in builder and all-reduce-only candidate, where ``short``
    has none of their kind because they are :func:`dominated`: ``name (ratio x)`` each."""
    out: list[str] = []
    for want in (lambda c: c.name != HYBRID, lambda c: all_reduce_only(c.strategy)):
        if any(want(c) for c in short):
            continue
        c = next((c for c in choice.candidates if want(c)), None)
        ratio = dominated(choice, c) if c is not None else None
        if c is not None and ratio is not None and f"{c.name} ({ratio:.1f}x)" not in out:
            out.append(f"{c.name} ({ratio:.1f}x)")
    return out


def fastest(measured: list[float | None], spread: list[float] | None = None) -> int:
    """Index of the fastest measured candidate. One does not displace a better-predicted
    (earlier) one unless faster by more than ``TIE`` and by more than the two trials'
    spreads together (median absolute deviations): within the noise the prediction
    decides, and equal timings give the same answer always."""
    spread = spread or [0.0] * len(measured)
    best_i, best_t = 0, float("inf")
    for i, t in enumerate(measured):
        if t is None:
            continue
        margin = spread[i] + (spread[best_i] if best_t < float("inf") else 0.0)
        if t < best_t * (1 - TIE) and t < best_t - margin:
            best_i, best_t = i, t
    return best_i


def median_se(spread: float, n: int) -> float:
    """Standard error of the median of ``n`` steps whose median absolute deviation is
    ``spread`` (steps spread normally: sigma = 1.4826 MAD, and the median's standard error
    is 1.2533 sigma / sqrt(n))."""
    return 1.4826 * 1.2533 * spread / math.sqrt(max(n, 1))


def raced(measured: list[float | None], spread: list[float], counts: list[int]) -> int:
    """Index of the race's winner: the first entry (the winner so far) stays unless
    another is faster by more than ``TIE`` and by ``Z`` standard errors of the difference
    of the two medians; of those that are, the fastest."""
    base = measured[0]
    if base is None:
        return fastest(measured, spread)
    best_i = 0
    for i in range(1, len(measured)):
        t = measured[i]
        if t is None:
            continue
        se = math.hypot(median_se(spread[i], counts[i]), median_se(spread[0], counts[0]))
        if t < base * (1 - TIE) and t < base - Z * se and t < (measured[best_i] or base):
            best_i = i
    return best_i


def _level_with(best_i: int, measured: list[float | None], challenged: bool,
                preferred: Callable[[int], bool]) -> int:
    """``best_i``, or when ``challenged`` the ``preferred`` candidate measured within
    ``TIE`` of it that :func:`fastest` picks among them (the better predicted unless
    another is faster by more than ``TIE``); ``best_i`` when there is none. Among
    level candidates the measurement does not decide: on DLRM at 2 nodes and 1 Gbit/s
    PartitionedPS (12.3 ms) was taken over the better-predicted Parallax (12.4 ms) and
    measured 1.05-1.15x Parallax in the benchmark."""
    t = measured[best_i]
    if not challenged or t is None:
        return best_i
    level = [i for i, m in enumerate(measured)
             if preferred(i) and m is not None and m <= t * (1 + TIE)]
    return level[fastest([measured[i] for i in level])] if level else best_i


def prefer_named(best_i: int, names: list[str], measured: list[float | None]) -> int:
    """``best_i``, unless it is a hybrid (per-parameter choices no builder makes) and a named
    candidate (a built-in builder's strategy) measured within ``TIE`` of it: then the
    one :func:`_level_with` picks among them. A hybrid has to beat what a user could pick
    by name by more than the trials' resolution: on DLRM at 2 nodes and 10 Gbit/s a hybrid
    of replicated rows tied the parameter-server builders in its trials (8.8 ms each) and
    trained 12-28% slower than PSLoadBalancing in three benchmark runs (new ids every
    step, which a trial's one sample batch does not have)."""
    return _level_with(best_i, measured, names[best_i] == HYBRID,
                       lambda i: names[i] != HYBRID)


def prefer_all_reduce(best_i: int, families: list[str], measured: list[float | None]) -> int:
    """``best_i``, unless it puts parameters on servers and an all-reduce-only candidate
    measured within ``TIE`` of it: then the one :func:`_level_with` picks among them.
    Servers have to win by more than the trials' resolution, or they are used for nothing:
    on the dense CNN at 2 nodes and 10 Gbit/s PSLoadBalancing measured 40.8 ms against
    AllReduce's 41.0 in trials, was kept on a 0.6% better prediction, and trained 8%
    slower than the best built-in."""
    return _level_with(best_i, measured, families[best_i] == SERVERS,
                       lambda i: families[i] == ALL_REDUCE)


def _broadcast_json(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (JSON bytes, parsed strictly)."""
    if dist.get_rank() == 0:
        broadcast_bytes(json.dumps(obj).encode())
        return obj
    return json.loads(broadcast_bytes(None).decode())


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the first's; CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def model_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters (one copy's values)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable``: free plus what the kernel can
    reclaim), else its free pages; ``None`` where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _host_room() -> int:
    """``HOST_SHARE`` of the host's available memory divided among the workers on this
    machine (each makes its copies at the same time); ``UNKNOWN_ROOM`` where not known."""
    free = host_available_bytes()
    if free is None:
        return UNKNOWN_ROOM
    return int(free * HOST_SHARE / env.local_workers())


def trial_room(model: nn.Module) -> int:
    """Bytes this rank can give trial copies of ``model``: on the CPU, its share of the
    host's memory (:func:`_host_room`); on a GPU, ``GPU_SHARE`` of its free memory, and no
    more than that host share either (a GPU worker's parameter-server traffic is staged in
    host buffers: a copy under such a strategy holds its pushed and pulled bytes there);
    none on any other device (a copy could not run there)."""
    device = model_device(model)
    if device.type == "cpu":
        return _host_room()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(int(free * GPU_SHARE), _host_room())
    return 0


def agreed_room(model: nn.Module) -> int:
    """The least :func:`trial_room` over the ranks (collective: every rank decides alike
    whether copies fit, and how many at once)."""
    room = torch.tensor([trial_room(model)], dtype=torch.int64)
    dist.all_reduce(room, op=dist.ReduceOp.MIN)
    return int(room.item())


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels: a GPU step is timed to its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """A copy of the model wrapped by the runtime under one strategy, on the model's
    device (collective to build, step and close: every worker at once)."""

    def __init__(self, model: nn.Module, strategy: Strategy, choice: Choice) -> None:
        from stratagem.runtime import DistributedModel, compile_plan

        replica = copy.deepcopy(model)
        self.device = model_device(model)
        self.opt = torch.optim.SGD(replica.parameters(), lr=0.0)
        plan = compile_plan(strategy, choice.profile, rank=dist.get_rank(),
                            world_size=dist.get_world_size(), device=self.device,
                            servers=server_devices(choice.spec))
        self.dm = DistributedModel(replica, plan, optimizer=self.opt)
        self.times: list[float] = []
        self.forwards: list[float] = []
        self.steps = 0

    def step(self, sample_input: Any, loss_fn: Callable[[Any], torch.Tensor]) -> None:
        """One training step; its time is the slowest rank's (the first is warm-up). It
        ends when the values the update sends back have arrived: the next forward waits
        for them, and left running they would finish unseen in the barrier between steps
        (trials of parameter servers measured up to 45% faster than training ran)."""
        _synchronize(self.device)
        dist.barrier()
        t = time.perf_counter()
        self.opt.zero_grad()
        loss = loss_fn(call_model(self.dm, sample_input))
        _synchronize(self.device)
        forward = time.perf_counter() - t
        loss.backward()
        self.opt.step()
        self.dm.wait_for_values()
        _synchronize(self.device)
        elapsed = torch.tensor([time.perf_counter() - t, forward], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if self.steps >= WARMUP:
            self.times.append(float(elapsed[0]))
            self.forwards.append(float(elapsed[1]))
        self.steps += 1

    def close(self) -> None:
        close = getattr(self.dm, "close", None)
        if callable(close):
            close()

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def timing(self) -> Timing:
        return (self.median(), self.spread(), len(self.times),
                statistics.median(self.forwards) if self.forwards else None)

    def spread(self) -> float:
        """Median absolute deviation of the timed steps."""
        m = self.median()
        return statistics.median(abs(t - m) for t in self.times) if m is not None else 0.0


Timing = tuple[float | None, float, int, float | None]
"""(median, median absolute deviation, count, median forward) of a candidate's timed
steps."""


def run_trial(model: nn.Module, strategy: Strategy, choice: Choice, sample_input: Any,
              loss_fn: Callable[[Any], torch.Tensor], steps: int = STEPS) -> Timing:
    """(median, median absolute deviation, count, median forward) of ``steps`` training
    steps (after ``WARMUP``) of a copy of ``model`` under ``strategy``, each the slowest
    rank's (collective)."""
    r = _Runner(model, strategy, choice)
    try:
        for _ in range(WARMUP + steps):
            r.step(sample_input, loss_fn)
    finally:
        r.close()
    return r.timing()


def over_budget(started: float, budget_s: float) -> bool:
    """Rank 0's clock says ``budget_s`` has passed since ``started`` (the same answer on
    every rank: collective)."""
    flag = torch.tensor([int(time.perf_counter() - started > budget_s)])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _interleaved(model: nn.Module, strategies: list[Strategy], steps: list[int],
                 choice: Choice, sample_input: Any, loss_fn: Callable[[Any], torch.Tensor],
                 started: float, budget_s: float) -> list[Timing]:
    """Every candidate built at once and stepped in turn, the order rotating each round
    (load that comes and goes hits all alike, as in the benchmarks)."""
    runners: list[_Runner] = []
    try:
        for s in strategies:
            runners.append(_Runner(model, s, choice))
        for rnd in range(WARMUP + max(steps)):
            if rnd > WARMUP and over_budget(started, budget_s):
                break
            n = len(runners)
            for j in range(n):
                i = (rnd + j) % n
                if runners[i].steps < WARMUP + steps[i]:
                    runners[i].step(sample_input, loss_fn)
    finally:
        for r in runners:
            r.close()
    return [r.timing() for r in runners]


def _interleave(plan: list[dict[str, Any]], model: nn.Module, room: int) -> bool:
    """Whether ``plan``'s copies of ``model`` fit at once in ``INTERLEAVE_BYTES`` and in
    ``room`` (see ``COPIES``)."""
    return len(plan) * model_bytes(model) * COPIES <= min(room, INTERLEAVE_BYTES)


def _measure(plan: list[dict[str, Any]], strategies: list[Strategy], model: nn.Module,
             choice: Choice, sample_input: Any, loss_fn: Callable[[Any], torch.Tensor],
             started: float, budget_s: float, room: int) -> list[Timing]:
    """Timings of ``plan``'s candidates: interleaved when their copies fit in ``room``,
    else in turn (rank 0's clock decides whether to go on after the first)."""
    if _interleave(plan, model, room):
        return _interleaved(model, strategies, [e["steps"] for e in plan], choice,
                            sample_input, loss_fn, started, budget_s)
    out: list[Timing] = []
    for i, (entry, s) in enumerate(zip(plan, strategies, strict=True)):
        if i > 0 and over_budget(started, budget_s):
            out.append((None, 0.0, 0, None))
            continue
        out.append(run_trial(model, s, choice, sample_input, loss_fn, entry["steps"]))
    return out


def _entry(c: Candidate, steps: int) -> dict[str, Any]:
    return {"name": c.name, "predicted_s": c.cost.total_s, "steps": steps,
            "split": split(c.cost), "pulls": pulls(c.cost), "strategy": c.strategy.to_dict()}


def _first_plan(choice: Choice, k: int, steps: int, budget_s: float) -> dict[str, Any]:
    """Rank 0's shortlist with the steps each, within the budget (predicted), and what it
    passed over (:func:`passed_over`)."""
    picked: list[dict[str, Any]] = []
    spent = 0.0
    short = shortlist(choice, k)
    for c in short:
        n = min(MAX_STEPS, max(steps, math.ceil(MEASURE_S / max(c.cost.total_s, 1e-6))))
        cost = (WARMUP + n) * c.cost.total_s
        if picked and spent + cost > budget_s:
            continue
        picked.append(_entry(c, n))
        spent += cost
    return {"plan": picked, "passed_over": passed_over(choice, short)}


def second_look(choice: Choice, trials: list[Trial], winner: dict[str, Any],
                measured_s: float, left_s: float) -> list[dict[str, Any]]:
    """Rank 0's race after the first trials: the winner's entry first, then the untried
    candidates (distinct strategies) whose prediction refined by ``trials`` is within
    ``SECOND_LOOK`` of the winner's measured step, closest first, at most ``SECOND_MAX``;
    steps each for ``SECOND_MEASURE_S`` within ``SECOND_STEPS``, fewer contenders while the
    race would overrun ``left_s`` at the refined rates. Empty: nothing to race."""
    refinement = fit(trials)
    if refinement is None or measured_s <= 0:
        return []
    names = {t.name for t in trials}
    tried = {_key(c.strategy) for c in choice.candidates if c.name in names}
    close: list[tuple[float, Candidate]] = []
    for c in choice.candidates:
        key = _key(c.strategy)
        if key in tried:
            continue
        tried.add(key)
        est = refinement.of(c.cost)
        if est <= measured_s * SECOND_LOOK:
            close.append((est, c))
    close = sorted(close, key=lambda e: e[0])[:SECOND_MAX]
    wanted = min(SECOND_STEPS[1],
                 max(SECOND_STEPS[0], math.ceil(SECOND_MEASURE_S / measured_s)))
    while close:
        round_s = measured_s + sum(est for est, _ in close)
        n = min(wanted, int(left_s / round_s) - WARMUP)
        if n >= SECOND_STEPS[0]:
            return [{**winner, "steps": n}, *(_entry(c, n) for _, c in close)]
        close.pop()
    return []


def _pick(index: int) -> int:
    """Rank 0's ``index`` on every rank (the ranks' numbers are equal; rank 0's word is
    final)."""
    pick = torch.tensor([index], dtype=torch.int64)
    dist.broadcast(pick, 0)
    return int(pick.item())


def refine(choice: Choice, model: nn.Module, sample_input: Any, *,
           loss_fn: Callable[[Any], torch.Tensor] | None = None, k: int = TOP_K,
           steps: int = STEPS, budget_s: float = BUDGET_S) -> Choice:
    """``choice`` with its best candidate replaced by the fastest in trial steps (every
    worker calls this at once; all return the same choice). The trials, the second look's
    too, go into ``choice.trials`` for the explanation."""
    loss_fn = loss_fn or default_loss
    started = time.perf_counter()
    rank0 = dist.get_rank() == 0
    room, one = agreed_room(model), model_bytes(model)
    if one * COPIES > room:
        return replace(choice, notes=(*choice.notes, (
            f"trial steps: none, a copy of the model ({one / 2**20:.0f} MiB of parameters) "
            f"does not fit beside it on {model_device(model)} on every rank; the prediction "
            "decides")))
    # Rank 0's shortlist (its predictions) on every rank.
    first = _broadcast_json(_first_plan(choice, k, steps, budget_s) if rank0 else None)
    plan = first["plan"]

    def strategies_of(entries: list[dict[str, Any]]) -> list[Strategy]:
        return [validate(Strategy.from_dict(e["strategy"], source="rank 0's trial candidate"),
                         choice.profile, choice.spec) for e in entries]

    def trials_of(entries: list[dict[str, Any]], timings: list[Timing],
                  strategies: list[Strategy], note: str = "") -> list[Trial]:
        return [Trial(e["name"], e["predicted_s"], m,
                      note if m is not None else "not run: trial budget spent", spread,
                      family(s), *e["split"], *e["pulls"], fwd)
                for e, (m, spread, _, fwd), s in zip(entries, timings, strategies,
                                                     strict=True)]

    strategies = strategies_of(plan)
    timings = _measure(plan, strategies, model, choice, sample_input, loss_fn, started,
                       budget_s, room)
    trials = trials_of(plan, timings, strategies)
    measured = [t.measured_s for t in trials]
    best_i = _pick(prefer_all_reduce(
        prefer_named(fastest(measured, [t.spread_s for t in trials]),
                     [e["name"] for e in plan], measured),
        [t.family for t in trials], measured))
    entry, strategy = plan[best_i], strategies[best_i]
    how = "interleaved" if _interleave(plan, model, room) else "in turn"
    note = (f"trial steps: {len(trials)} candidates {how}, {WARMUP}+{steps}..{MAX_STEPS} "
            f"steps each, {time.perf_counter() - started:.1f} s; kept {entry['name']}")
    if first["passed_over"]:
        note += (f"; not tried, predicted over {DOMINATED:g}x the best: "
                 f"{', '.join(first['passed_over'])}")
    # The second look: what the trials' rates put level with the winner, raced against it.
    race = None
    if rank0 and trials[best_i].measured_s is not None:
        race = second_look(choice, trials, entry, trials[best_i].measured_s,
                           budget_s - (time.perf_counter() - started))
    race = _broadcast_json(race)
    if race:
        raced_strategies = [strategy, *strategies_of(race[1:])]
        timings2 = _measure(race, raced_strategies, model, choice, sample_input, loss_fn,
                            started, budget_s, room)
        trials += trials_of(race, timings2, raced_strategies, RACED)
        medians = [m for m, *_ in timings2]
        won = _pick(prefer_all_reduce(
            prefer_named(raced(medians, [s for _, s, *_ in timings2],
                               [n for _, _, n, _ in timings2]),
                         [e["name"] for e in race], medians),
            [family(s) for s in raced_strategies], medians))
        entry, strategy = race[won], raced_strategies[won]
        note += (f"; second look: raced {len(race) - 1} more "
                 f"({', '.join(e['name'] for e in race[1:])}), {race[0]['steps']} steps "
                 f"each, kept {entry['name']}")
    name = entry["name"]
    original = next((c for c in choice.candidates if c.name == name), None)
    cost = original.cost if original is not None else choice.best.cost
    if name != HYBRID and not strategy.builder.startswith("Auto"):
        strategy = replace(strategy, builder=f"Auto({name})")
    best = Candidate(name, strategy, cost)
    others = tuple(c for c in choice.candidates if c.name != name)
    return replace(choice, best=best, candidates=(best, *others), trials=tuple(trials),
                   notes=(*choice.notes, note))
