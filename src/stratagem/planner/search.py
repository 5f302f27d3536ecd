"""Search: the strategy of least predicted step time for this model on these resources.

Candidates are every registered builder's strategy (with its defaults) and hybrids built
here, per parameter: all-reduce in groups formed in gradient-ready order up to a byte cap
(as DDP's buckets), or parameter servers as rows (declared sparse, or measured row-sparse)
sharded evenly over the least-loaded owners, or -- a declared-sparse gradient -- its rows
all-gathered (``gather_rows``, as DDP does); then a compressor per group when lossy ones
are allowed. Hybrids improve greedily (one parameter or group at a time, kept when the
prediction drops), so the search is a few hundred predictions at most: bounded well under
10 s for a model of 200 tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StratagemError
from stratagem.planner.calibrate import Calibration, row_sparse
from stratagem.planner.cost_model import StepCost, plan_for, predict
from stratagem.planner.links import LinkModel
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders import builder_from_name, builder_names
from stratagem.strategy.builders.allreduce import AllReduce
from stratagem.strategy.builders.auto import Auto
from stratagem.strategy.builders.ps import Placer, ps_capacities, ps_node, ps_servers
from stratagem.strategy.schema import (
    AllReduceSynchronizer,
    GraphConfig,
    NodeConfig,
    PSSynchronizer,
    Strategy,
)
from stratagem.strategy.validate import validate

MIB = 2 ** 20
BYTE_CAPS = (MIB // 4, MIB // 2, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, None)
"""Byte caps of the hybrids' all-reduce groups (None: one group). Below 1 MiB: backward's
last gradients (a CNN's first conv layers) in a small bucket of their own, whose
all-reduce is all that waits after backward."""
BUDGET_S = 8.0  # the search stops improving after this long (the bound is 10 s)
TOLERANCE = 0.05  # predictions this close count as equal (see prefer_simple)
GATHER_GROUP = 10_000  # group ids of gathered rows start here (one group each)
DDP_ENGINE = "AllReduceDDP"
"""The candidate AllReduce (defaults) on the ddp engine (torch's DDP reducer)."""
DDP_BUCKET_CAPS = (MIB // 4, MIB // 2, MIB, 4 * MIB)
"""Bucket sizes of the ddp engine candidates besides DDP's default 25 MiB."""
HYBRID = "hybrid"
"""The name of the candidate made of per-parameter choices here (every other candidate is
a named builder's strategy)."""


@dataclass(frozen=True)
class Candidate:
    """One strategy the search priced."""

    name: str
    strategy: Strategy
    cost: StepCost


@dataclass(frozen=True)
class Choice:
    """The search's answer: the chosen candidate and the others, best first (a built-in
    builder by its name, or ``hybrid``: per-parameter choices made here)."""

    best: Candidate
    candidates: tuple[Candidate, ...]
    calibration: Calibration
    profile: ModelProfile
    spec: ResourceSpec
    search_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    trials: tuple[Any, ...] = ()
    """Low-shot trial steps (:class:`~stratagem.planner.trial.Trial`), when run."""
    link_probe: Any = None
    """The measured links (:class:`~stratagem.planner.probe.LinkProbe`), when probed."""
    memory: Any = None
    """The chosen strategy's peak memory per worker
    (:class:`~stratagem.planner.memory.MemoryEstimate`), under a memory limit."""

    @property
    def strategy(self) -> Strategy:
        return self.best.strategy

    @property
    def cost(self) -> StepCost:
        return self.best.cost


DDP_NO_FIRST = f"{DDP_ENGINE}@no-first-bucket"
"""The candidate ``AllReduce(engine="ddp", first_bucket_bytes=0)``: DDP's buckets without
its 1 MiB first bucket, one collective fewer a step (a model under 25 MiB in one bucket).
That pays where the link is fast and the all-reduce's fixed cost is not: 4 workers sharing
2 cores over loopback stepped 0.95-0.97x plain DDP's time on the CNN of
bench/auto_strategy.py and 0.89-0.91x on its many_small model (2.9 and 2.0 MiB of
gradients), against 1.00x with the first bucket apart."""


def ddp_bucket_name(cap: int) -> str:
    """The name of the candidate AllReduce on the ddp engine with ``cap``-byte buckets."""
    return f"{DDP_ENGINE}@{cap // 1024}KiB"


def pullable(info: ParamInfo) -> bool:
    """Rows can be pulled on demand (an untied embedding module) or come declared sparse."""
    return info.sparse or (info.embedding_like and not info.aliases)


def row_candidates(profile: ModelProfile, cal: Calibration, options: Auto) -> list[str]:
    """Parameters that may travel as rows: declared sparse, or (``detect_sparse``)
    measured row-sparse; largest first (none when rows or servers are off)."""
    if not options.rows or not options.servers:
        return []
    access = {a.name: a for a in (profile.access or cal.access)}
    out = [p for p in profile.params if p.shape and p.shape[0] >= 2 and (
        pullable(p) or (options.detect_sparse and row_sparse(access.get(p.name))))]
    return [p.name for p in sorted(out, key=lambda p: -p.bytes)]


def dense_on_servers(strategy: Strategy, profile: ModelProfile) -> int:
    """Bytes of parameters that go to parameter servers densely (not as rows)."""
    total = 0
    for nc in strategy.node_config:
        info = profile.get(nc.var_name)
        leaves = nc.leaves()
        for leaf in leaves:
            s = leaf.synchronizer
            if isinstance(s, PSSynchronizer) and not (s.row_sparse or pullable(info)):
                total += info.bytes // len(leaves)
    return total


def collectives(candidate: Candidate) -> int:
    """Collectives a worker starts per step: one per all-reduce group, plus the parameter
    servers' messages. Each has a fixed cost (a gloo/nccl launch, a round trip) that the
    model prices only roughly, and that grows with the count of groups."""
    groups = {leaf.synchronizer.group for nc in candidate.strategy.node_config
              for leaf in nc.leaves() if isinstance(leaf.synchronizer, AllReduceSynchronizer)}
    return len(groups) + int(candidate.cost.parts.get("messages", 0.0))


def prefer_simple(pool: list[Candidate], profile: ModelProfile) -> Candidate:
    """The cheapest candidate, except that among those predicted within ``TOLERANCE`` of
    it (the model's own error) the one with the fewest dense bytes on parameter servers
    wins (dense parameters go to servers only when that clearly pays), then the one that
    starts the fewest collectives (measured: 8 all-reduce groups of a 482-tensor model
    stepped 1.3x slower than one group at the same predicted time)."""
    best = min(c.cost.total_s for c in pool)
    close = [c for c in pool if c.cost.total_s <= best * (1 + TOLERANCE)]
    return min(close, key=lambda c: (dense_on_servers(c.strategy, profile), collectives(c),
                                     c.cost.total_s))


def all_reduce_only(strategy: Strategy) -> bool:
    """Whether every parameter of ``strategy`` is all-reduced (no parameter servers)."""
    return all(isinstance(leaf.synchronizer, AllReduceSynchronizer)
               for nc in strategy.node_config for leaf in nc.leaves())


def sends_rows(strategy: Strategy, profile: ModelProfile) -> bool:
    """Whether a parameter of ``strategy`` goes to a parameter server as rows, or has its
    rows all-gathered (either way the optimizer gets rows)."""
    for nc in strategy.node_config:
        info = profile.get(nc.var_name)
        for leaf in nc.leaves():
            s = leaf.synchronizer
            if isinstance(s, AllReduceSynchronizer) and s.gather_rows:
                return True
            if isinstance(s, PSSynchronizer) and (s.row_sparse or pullable(info)):
                return True
    return False


@dataclass
class Hybrid:
    """A per-parameter assignment the search edits: which go as rows, the group cap, and
    the compressor of each all-reduce group (by group number)."""

    rows: set[str]
    cap: int | None
    compressors: dict[int, str] = field(default_factory=dict)
    replicate: set[str] = field(default_factory=set)  # rows kept on every worker
    gather: set[str] = field(default_factory=set)  # sparse gradients' rows all-gathered
    engine: str = "stratagem"  # who runs the all-reduce groups (ddp: torch's reducer)

    def copy(self) -> Hybrid:
        return Hybrid(set(self.rows), self.cap, dict(self.compressors), set(self.replicate),
                      set(self.gather), self.engine)


def ready_order(profile: ModelProfile, cal: Calibration) -> list[ParamInfo]:
    """Parameters by the time their gradient is ready (ties: reverse registration)."""
    pos = {p.name: i for i, p in enumerate(profile.params)}
    return sorted(profile.params,
                  key=lambda p: (cal.grad_ready_s.get(p.name, cal.backward_s), -pos[p.name]))


def build_hybrid(h: Hybrid, profile: ModelProfile, spec: ResourceSpec,
                 cal: Calibration) -> Strategy:
    nodes: dict[str, NodeConfig] = {}
    group, filled = 0, 0
    # On the ddp engine, groups follow DDP's own fill order (reverse registration), so
    # that each group is exactly one of DDP's buckets (bucket_cap_mb_list cuts that order).
    order = (list(reversed(profile.params)) if h.engine == "ddp"
             else ready_order(profile, cal))
    for info in order:
        if info.name in h.rows:
            continue
        if info.name in h.gather:
            nodes[info.name] = NodeConfig(info.name, AllReduceSynchronizer(
                gather_rows=True, group=GATHER_GROUP + len(nodes)))
            continue
        if filled and h.cap is not None and filled + info.bytes > h.cap:
            group += 1
            filled = 0
        filled += info.bytes
        comp = h.compressors.get(group, "none")
        nodes[info.name] = NodeConfig(info.name, AllReduceSynchronizer(
            compressor=comp, group=group, powersgd_rank=4 if comp == "powersgd" else 1,
            engine=h.engine))
    placer = Placer(ps_servers(spec), ps_capacities(spec))
    for name in sorted(h.rows, key=lambda n: -profile.get(n).bytes):
        info = profile.get(name)
        keep = name in h.replicate or not pullable(info)
        make = PSSynchronizer(local_replication=keep, row_sparse=not pullable(info))
        if len(placer.servers) > 1 and info.shape[0] >= 2 and len(info.shape) >= 2:
            pieces = placer.even(info.shape[0], info.bytes // info.shape[0])
        else:
            pieces = placer.whole(info.bytes)
        nodes[name] = ps_node(info, pieces, placer, make)
    return Strategy(node_config=tuple(nodes[p.name] for p in profile.params),
                    graph_config=GraphConfig(tuple(spec.replicas)), builder="Auto")


def group_count(strategy: Strategy) -> int:
    """All-reduce groups that sum a buffer (gathered rows take no compressor)."""
    return len({nc.synchronizer.group for nc in strategy.node_config
                if isinstance(nc.synchronizer, AllReduceSynchronizer)
                and not nc.synchronizer.gather_rows})


class Pricer:
    """Prices strategies (compile + predict), remembering failures as infinite."""

    def __init__(self, profile: ModelProfile, spec: ResourceSpec, cal: Calibration,
                 links: LinkModel | None = None) -> None:
        self.profile, self.spec, self.cal = profile, spec, cal
        self.links = links or LinkModel.from_spec(spec)
        self.count = 0

    def __call__(self, strategy: Strategy) -> StepCost | None:
        self.count += 1
        try:
            strategy = validate(strategy, self.profile, self.spec)
            plan = plan_for(strategy, self.profile, self.spec)
        except StratagemError:
            return None
        return predict(strategy, self.profile, self.spec, self.cal, self.links, plan)


def search(profile: ModelProfile, spec: ResourceSpec, cal: Calibration,
           options: Auto | None = None, links: LinkModel | None = None) -> Choice:
    """Price every built-in builder and the hybrids; return the cheapest. ``links``: a
    measured link model (default: the spec's nominal one)."""
    options = options or Auto()
    started = time.perf_counter()
    price = Pricer(profile, spec, cal, links)
    found: list[Candidate] = []
    notes: list[str] = []
    for name in builder_names():
        if name in ("Auto", "ZeRO"):  # sharded candidates: only under a memory limit
            continue
        try:
            strategy = builder_from_name(name).build(profile, spec)
        except StratagemError as exc:
            notes.append(f"{name}: not applicable ({exc.problem})")
            continue
        if not options.rows and sends_rows(strategy, profile):
            notes.append(f"{name}: skipped (it sends rows; rows are off)")
            continue
        if not options.servers and not all_reduce_only(strategy):
            notes.append(f"{name}: skipped (it uses parameter servers; servers are off)")
            continue
        cost = price(strategy)
        if cost is not None:
            found.append(Candidate(name, strategy, cost))
    # With lossy compressors allowed: AllReduce with each of them (what a user would try
    # first; the hybrids below may not reach it from their own starting point).
    lossy = [c for c in options.compressors if c != "none"]
    for comp in lossy:
        strategy = AllReduce(compressor=comp).build(profile, spec)
        cost = price(strategy)
        if cost is not None:
            found.append(Candidate(f"AllReduce({comp})", strategy, cost))
    # The same on torch's DDP reducer (the ddp engine: its C++ reducer costs less per
    # tensor than this runtime's hooks); the trials measure both. Not where calibration
    # saw a parameter without a gradient: the ddp engine needs one for every parameter.
    ddp_ok = all(p.name in cal.grad_ready_s for p in profile.params)
    for comp in (("none", *lossy) if "none" in options.compressors else lossy) * ddp_ok:
        strategy = AllReduce(compressor=comp, engine="ddp").build(profile, spec)
        cost = price(strategy)
        if cost is not None:
            name = DDP_ENGINE if comp == "none" else f"{DDP_ENGINE}({comp})"
            found.append(Candidate(name, strategy, cost))
    # ... and with buckets smaller than DDP's 25 MiB (DDP's ``bucket_cap_mb``, a setting
    # its users tune): backward's last gradients then wait in a smaller last bucket.
    # ... and without DDP's first bucket (one collective fewer; :data:`DDP_NO_FIRST`).
    if ddp_ok and "none" in options.compressors:
        named = [(ddp_bucket_name(cap), AllReduce(engine="ddp", bucket_bytes=cap))
                 for cap in DDP_BUCKET_CAPS]
        named.append((DDP_NO_FIRST, AllReduce(engine="ddp", first_bucket_bytes=0)))
        for name, builder in named:
            strategy = builder.build(profile, spec)
            cost = price(strategy)
            if cost is not None:
                found.append(Candidate(name, strategy, cost))

    def run(h: Hybrid) -> tuple[Strategy, StepCost | None]:
        s = build_hybrid(h, profile, spec, cal)
        return s, price(s)

    # 1. The byte cap of the all-reduce groups, everything dense, on either engine: the
    # groups are the ddp engine's buckets there, and where backward's last gradients come
    # in a bucket smaller than DDP's default 25 MiB, their all-reduce is exposed for less.
    engines = ("stratagem", "ddp") if ddp_ok else ("stratagem",)
    best_h, best_s, best_c = None, None, None
    for engine in engines:
        for cap in BYTE_CAPS:
            h = Hybrid(rows=set(), cap=cap, engine=engine)
            s, c = run(h)
            if c is not None and (best_c is None or c.total_s < best_c.total_s):
                best_h, best_s, best_c = h, s, c
    if best_h is None:
        raise StratagemError("no strategy could be priced", where="planner.search",
                             fix="check the model profile and resource spec")
    # 2. Parameters as rows, one at a time (largest first), kept when cheaper. Then from
    # all of them as rows at once: the sparse exchange's fixed costs (the push, the
    # refresh, each pull round) are paid once per step, so where no one parameter pays
    # for them alone, all together may (wide & deep: nine tables, 4 workers); each is
    # then put back to all-reduce, or switched between pulled and replicated, while that
    # is cheaper.
    names = row_candidates(profile, cal, options)
    dense_h = best_h

    def improve(h: Hybrid, s: Strategy, c: StepCost, moves: list[Hybrid]
                ) -> tuple[Hybrid, Strategy, StepCost]:
        for m in moves:
            if time.perf_counter() - started > BUDGET_S:
                break
            ms, mc = run(m)
            if mc is not None and mc.total_s < c.total_s:
                h, s, c = m, ms, mc
        return h, s, c

    def as_rows(h: Hybrid, name: str, replicate: bool) -> Hybrid:
        h = h.copy()
        h.rows.add(name)
        if replicate:
            h.replicate.add(name)
        else:
            h.replicate.discard(name)
        return h

    def modes(name: str) -> tuple[bool, ...]:
        return (False, True) if pullable(profile.get(name)) else (True,)

    for name in names:
        best_h, best_s, best_c = improve(best_h, best_s, best_c,
                                         [as_rows(best_h, name, r) for r in modes(name)])
    if len(names) > 1:
        for replicate in (True, False):
            h = dense_h.copy()
            for name in names:
                h = as_rows(h, name, replicate or not pullable(profile.get(name)))
            s, c = run(h)
            if c is None:
                continue
            for name in names:
                back = h.copy()
                back.rows.discard(name)
                back.replicate.discard(name)
                h, s, c = improve(h, s, c, [back, *(as_rows(h, name, r) for r in modes(name)
                                                   if r != (name in h.replicate))])
            if c.total_s < best_c.total_s:
                best_h, best_s, best_c = h, s, c
    # 2b. A declared-sparse gradient's rows all-gathered instead (DDP's way: no owner, no
    # refresh; every worker receives every other's rows), one at a time, then all at once.
    def gathered(h: Hybrid, names: list[str]) -> Hybrid:
        h = h.copy()
        for name in names:
            h.rows.discard(name)
            h.replicate.discard(name)
            h.gather.add(name)
        return h

    sparse = [p.name for p in profile.params if p.sparse and p.shape] if options.rows else []
    for name in sparse:
        best_h, best_s, best_c = improve(best_h, best_s, best_c, [gathered(best_h, [name])])
    if len(sparse) > 1:
        best_h, best_s, best_c = improve(best_h, best_s, best_c,
                                         [gathered(best_h, sparse), gathered(dense_h, sparse)])
    # 3. Once rows are settled, the cap again (the dense remainder changed).
    for cap in BYTE_CAPS:
        h = best_h.copy()
        h.cap = cap
        s, c = run(h)
        if c is not None and c.total_s < best_c.total_s:
            best_h, best_s, best_c = h, s, c
    # 4. A compressor per group, when lossy ones are allowed.
    def compressed(h: Hybrid, g: int, comp: str) -> Hybrid:
        h = h.copy()
        h.compressors[g] = comp
        return h

    for g in range(group_count(best_s) if lossy else 0):
        best_h, best_s, best_c = improve(best_h, best_s, best_c,
                                         [compressed(best_h, g, comp) for comp in lossy])
    # 5. The hybrid's all-reduce groups on torch's DDP reducer, when it can run them
    # (whole dense parameters, one compressor): kept when predicted cheaper.
    if ddp_ok and best_h.engine != "ddp":
        best_h, best_s, best_c = improve(best_h, best_s, best_c,
                                         [replace(best_h.copy(), engine="ddp")])
    hybrid = Candidate(HYBRID, best_s, best_c)
    allowed_lossless = "none" in options.compressors
    pool = [c for c in found if allowed_lossless or "(" in c.name] + [hybrid]
    chosen = prefer_simple(pool, profile)
    others = sorted((c for c in [*found, hybrid] if c is not chosen),
                    key=lambda c: c.cost.total_s)
    best = chosen if chosen is hybrid else Candidate(
        chosen.name, replace(chosen.strategy, builder=f"Auto({chosen.name})"), chosen.cost)
    notes.append(f"{price.count} strategies priced")
    return Choice(best=best, candidates=(best, *others), calibration=cal, profile=profile,
                  spec=spec, search_s=time.perf_counter() - started, notes=tuple(notes))

