"""Peak memory per worker of a strategy, and Auto's choice under a memory limit.

The estimate adds what one worker holds at the peak of a step (the worst rank's share):
parameters (a 1/world slice of stage-3 ones, plus the gathered units), gradients (a
stage-2 worker keeps only its own, a stage-3 one its slice plus one unit's whole
gradients), optimizer state (elements of state per parameter element by the optimizer's
kind, on the workers that update the parameter), activations (the bytes autograd saves
for backward, measured on the sample batch) and communication buffers (the all-reduce
groups' flat buffers). See docs/concepts/sharding.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratagem.analysis.profile import ModelProfile, ParamInfo
from stratagem.errors import StratagemError
from stratagem.resource import ResourceSpec
from stratagem.strategy.schema import NodeConfig, ShardedSynchronizer, Strategy
from stratagem.strategy.validate import unit_of

STATE_PER_ELEMENT = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2,
                     "Adagrad": 1, "Adadelta": 2, "RMSprop": 1, "SGD": 1, "Lion": 1}
"""Optimizer state elements per parameter element (SGD: the momentum buffer, when set)."""
DEFAULT_STATE = 2  # unknown optimizer: Adam's
BACKWARD_UNITS = 5  # stage 3: units' worth of bytes in flight during backward (below)
MARGIN = 0.05
"""Auto's safety margin: a candidate fits when its estimate plus this share of it, plus
:data:`RESERVE`, is within the limit (resident memory moves by about a MiB from run to
run, and the estimate adds items that do not all peak at once only on average)."""
RESERVE = 2 * 2**20
"""Bytes the training process holds beyond the model's own: the planner's and runtime's
objects (measured 1.6-1.9 MiB of resident growth after Auto's choice on CPU,
tests/planner/test_memory.py), not in the estimate, which counts the model's bytes."""


def fits(estimate: MemoryEstimate, limit: int) -> bool:
    """Whether ``estimate`` fits ``limit`` bytes with Auto's margin and reserve."""
    return estimate.peak * (1 + MARGIN) + RESERVE <= limit


def state_per_element(optimizer: Any) -> int:
    """Elements of optimizer state per parameter element for ``optimizer`` (one or a list;
    the largest), Adam's 2 when unknown."""
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer or [])
    if not opts:
        return DEFAULT_STATE
    out = 0
    for o in opts:
        k = STATE_PER_ELEMENT.get(type(o).__name__, DEFAULT_STATE)
        if isinstance(o, torch.optim.SGD) and not any(g.get("momentum") for g in o.param_groups):
            k = 0
        if isinstance(o, torch.optim.RMSprop) and any(g.get("momentum") for g in o.param_groups):
            k = 2
        out = max(out, k)
    return out


def activation_bytes(model: nn.Module, sample_input: Any,
                     run: Any = None) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward of
    ``model`` on ``sample_input`` (each storage once), without running backward."""
    seen: dict[Any, int] = {}
    alive = []  # the storages, until the end: a freed one's address may come again
    meta = any(p.is_meta for p in model.parameters())
    if meta:  # a meta-device model (no values): the same forward on meta inputs
        sample_input = _to_meta(sample_input)

    def key_of(t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        # (meta storages have no address: their storage objects tell them apart)
        return (st._cdata if t.is_meta else st.data_ptr(), t.device)

    # Saved views of the parameters (a linear layer's transposed weight) are not new memory.
    held = {key_of(p) for p in [*model.parameters(), *model.buffers()]}

    def pack(t: torch.Tensor) -> None:
        # Returns nothing: keeping ``t`` would tie a saved output to its own graph node (a
        # reference cycle outside Python's collector: the parameters would never be freed).
        st = t.untyped_storage()
        key = key_of(t)
        if key not in held:
            seen[key] = st.nbytes()
            alive.append(st)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("activation_bytes runs no backward")

    was = model.training
    model.train()
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = run(model, sample_input) if run else (
                model(*sample_input) if isinstance(sample_input, tuple) else model(sample_input))
            del out
    finally:
        model.train(was)
    return sum(seen.values())


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one worker holds at the peak of a step, by item (the worst rank's)."""

    items: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.items.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.items.items(), key=lambda kv: -kv[1])[:n]

    def text(self) -> str:
        parts = ", ".join(f"{k} {mib(v)}" for k, v in self.largest(len(self.items)) if v)
        return f"{mib(self.peak)} per worker ({parts})"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def config_of(info: ParamInfo, configs: Mapping[str, NodeConfig]) -> NodeConfig | None:
    """The node config of a profiled parameter, found by its name or an alias (None)."""
    return next((configs[n] for n in (info.name, *info.aliases) if n in configs), None)


def estimate_memory(strategy: Strategy, profile: ModelProfile, world: int, *,
                    state_elements: int = DEFAULT_STATE, activations: int = 0
                    ) -> MemoryEstimate:
    """Peak bytes per worker of ``strategy`` on ``world`` workers (the module docstring)."""
    from stratagem.runtime.plan import assign_owners  # (the runtime's own assignment)

    configs = {nc.var_name: nc for nc in strategy.node_config}
    params = grads = state = buffers = 0
    units: dict[str, int] = {}
    keep: dict[str, bool] = {}
    prefetch: dict[str, int] = {}
    owned_sizes = []
    itemsize = {}
    largest_owned = 0
    for info in profile.params:
        nc = config_of(info, configs)
        sync = nc.synchronizer if nc is not None else None
        itemsize[info.name] = info.bytes // max(info.numel, 1)
        if isinstance(sync, ShardedSynchronizer) and sync.stage == 3:
            u = unit_of(nc.var_name, sync)
            rows = info.shape[0] if info.shape else 1
            shard = math.ceil(rows / world) * (info.numel // max(rows, 1))  # FSDP2 pads dim 0
            params += shard * itemsize[info.name]
            grads += shard * itemsize[info.name]
            state += shard * itemsize[info.name] * state_elements
            units[u] = units.get(u, 0) + info.bytes
            keep[u] = not sync.reshard_after_forward
            prefetch[u] = sync.prefetch
            continue
        params += info.bytes
        if isinstance(sync, ShardedSynchronizer):
            owned_sizes.append((info.name, sync.stage, info.numel))
            if sync.stage == 1:
                grads += info.bytes
                buffers += info.bytes  # the stage-1 all-reduce group's buffer
            else:
                largest_owned = max(largest_owned, info.bytes)
            continue
        grads += info.bytes
        state += info.bytes * state_elements
        buffers += info.bytes  # the all-reduce groups' flat buffers (or PS buckets)
    if owned_sizes:
        owned = assign_owners(owned_sizes, world)
        per_rank = [0] * world
        g2 = [0] * world
        for o in owned:
            per_rank[o.owner] += o.numel * itemsize[o.param]
            if o.stage == 2:
                g2[o.owner] += o.numel * itemsize[o.param]
        worst = max(range(world), key=lambda r: per_rank[r] * state_elements + g2[r])
        state += per_rank[worst] * state_elements
        grads += g2[worst] + 2 * largest_owned  # own gradients + the reduce in flight
    gathered = 0
    if units:
        biggest = max(units.values())
        kept = sum(b for u, b in units.items() if keep[u])
        ahead = max(prefetch.values())
        # FSDP2's forward: the kept units, the running unit, those prefetched, and the
        # all-gather buffer it is copied out of. Backward: the running unit's parameters
        # and the next one's (prefetched), the running unit's whole gradients, and two
        # reduce-scatters -- the running unit's and the previous one's, still in flight
        # -- each a flat input plus gloo's buffer (it reduce-scatters by an all-reduce),
        # which do not all peak at once: 5 units. (The 5 is fitted on the measured peak,
        # with the libraries' one-time allocations in the baseline, of the must-hold case:
        # tests/planner/test_memory.py; 4.6 units measured there.)
        gathered = max(kept + biggest * (2 + ahead), kept + BACKWARD_UNITS * biggest)
    return MemoryEstimate(items={"parameters": params, "gradients": grads,
                                 "optimizer state": state, "activations": activations,
                                 "gathered units": gathered, "comm buffers": buffers})


def rescale_memory(strategy: Strategy, profile: ModelProfile, world: int, *,
                   state_elements: int = DEFAULT_STATE) -> MemoryEstimate:
    """Peak bytes per worker while an in-process rescale gathers the model whole in the
    old group (``DistributedModel.before_regroup``), at a step boundary of ``world``
    workers: what :func:`estimate_memory` counts there (no activations, no unit gathered
    for compute) plus every stage-3 parameter whole, and every parameter's optimizer
    state whole (stage-1/2 owners' state and stage-3 slices are gathered on every rank)."""
    base = estimate_memory(strategy, profile, world, state_elements=state_elements)
    configs = {nc.var_name: nc for nc in strategy.node_config}
    stage3 = 0
    for info in profile.params:
        nc = config_of(info, configs)
        sync = nc.synchronizer if nc is not None else None
        if isinstance(sync, ShardedSynchronizer) and sync.stage == 3:
            stage3 += info.bytes
    state = sum(p.bytes for p in profile.params) * state_elements
    return MemoryEstimate(items={"parameters": base.items["parameters"] + stage3,
                                 "gradients": base.items["gradients"],
                                 "optimizer state": max(state, base.items["optimizer state"]),
                                 "comm buffers": base.items["comm buffers"]})


def check_rescale_fits(strategy: Strategy, profile: ModelProfile, spec: ResourceSpec,
                       world: int, optimizer: Any = None) -> None:
    """In an in-process elastic job under a memory limit: a strategy with stage-3 units
    whose rescale gather (:func:`rescale_memory`) would not fit the limit is refused
    before training, naming both figures and what rescales within it."""
    limit = spec.memory_limit()
    if limit is None or not any(isinstance(nc.synchronizer, ShardedSynchronizer)
                                and nc.synchronizer.stage == 3
                                for nc in strategy.node_config):
        return
    limit_bytes, where = limit
    need = rescale_memory(strategy, profile, max(world, 2),
                          state_elements=state_per_element(optimizer))
    if fits(need, limit_bytes):
        return
    raise StratagemError(
        f"an in-process rescale of this stage-3 strategy gathers the whole parameters and "
        f"optimizer state on every worker: {need.text()}, over the limit "
        f"{mib(limit_bytes)}", where=f"{spec.source}: {where}",
        fix="use ZeRO(stage=2) or Auto (they rescale within the limit), checkpoint-restart "
            "(stratagem run --nnodes MIN:MAX without STRATAGEM_RESCALE_STORE: stage-3 "
            "checkpoints restore onto any world size), or raise the limit")


def calibration_fits(profile: ModelProfile, limit: int, activations: int) -> bool:
    """Whether calibrating (whole parameters and gradients, the sample's activations)
    stays within ``limit`` bytes; if not, Auto plans from estimated costs."""
    return 2 * sum(p.bytes for p in profile.params) + activations <= limit


def check_shard_floor(profile: ModelProfile, spec: ResourceSpec) -> None:
    """A limit below one worker's shard of the largest parameter cannot be met by any
    strategy: refused, naming the field."""
    limit = spec.memory_limit()
    if limit is None or not profile.params:
        return
    bytes_, where = limit
    biggest = max(profile.params, key=lambda p: p.bytes)
    shard = math.ceil(biggest.bytes / spec.num_workers)
    if bytes_ < shard:
        raise StratagemError(
            f"{where} is {mib(bytes_)}, less than one worker's shard of {biggest.name!r} "
            f"({mib(shard)} of {mib(biggest.bytes)} over {spec.num_workers} workers)",
            where=f"{spec.source}: {where}",
            fix="raise the limit, or add workers")


def not_fitting(estimates: list[tuple[str, MemoryEstimate]], limit: int, where: str,
                profile: ModelProfile, world: int, state_elements: int,
                activations: int) -> StratagemError:
    """The error when no candidate fits: the smallest estimate, the limit, its largest
    items, and what would fit."""
    name, best = min(estimates, key=lambda t: t[1].peak)
    items = ", ".join(f"{k} {mib(v)}" for k, v in best.largest())
    from stratagem.strategy.builders.sharded import ZeRO

    hints = []
    for w in (2 * world, 4 * world, 8 * world):
        s = ZeRO(stage=3).build(profile, ResourceSpec.local(1))
        if fits(estimate_memory(s, profile, w, state_elements=state_elements,
                           activations=activations), limit):
            hints.append(f"{w} workers with ZeRO-3")
            break
    room = (limit - RESERVE) / (1 + MARGIN)  # the largest estimate that fits
    no_act = best.peak - activations
    if activations and no_act <= room:
        share = (room - no_act) / activations
        hints.append(f"a per-worker batch about {share:.0%} of this one, or activation "
                     "checkpointing")
    return StratagemError(
        f"no strategy fits the memory limit: the smallest estimate ({name}) is "
        f"{mib(best.peak)} per worker, the limit {mib(limit)} (room for "
        f"{mib(max(room, 0))} after a {MARGIN:.0%} margin and {mib(RESERVE)} reserve); "
        f"largest items: {items}",
        where=where,
        fix="what would fit: " + ("; ".join(hints) if hints else
                                  "a larger memory limit (no smaller batch or more workers "
                                  "within 8x would do)"))


def fit_memory(choice: Any, activations: int, optimizer: Any, price: Any,
               max_stage: int = 3) -> Any:
    """``choice`` when its strategy fits the spec's memory limit (or no limit is set);
    else the fastest candidate (the priced ones, then ZeRO 1, 2 and 3 up to
    ``max_stage``) that fits, with its estimate in the notes. Raises StratagemError when
    none fits. ``activations``: bytes measured by :func:`activation_bytes` (0: unknown);
    ``price(strategy)``: the search's StepCost of a strategy (None: it cannot run)."""
    from dataclasses import replace as dc_replace

    from stratagem.planner.search import Candidate
    from stratagem.strategy.builders.sharded import ZeRO

    spec, profile = choice.spec, choice.profile
    limit = spec.memory_limit()
    if limit is None:
        return choice
    check_shard_floor(profile, spec)
    limit_bytes, where = limit
    k = state_per_element(optimizer)
    act = activations
    world = spec.num_workers

    def est(s: Strategy) -> MemoryEstimate:
        return estimate_memory(s, profile, world, state_elements=k, activations=act)

    pool = sorted(choice.candidates, key=lambda c: c.cost.total_s)
    if choice.best not in pool:
        pool.insert(0, choice.best)
    for stage, keep in ((1, True), (2, True), (3, False), (3, True)):
        if stage > max_stage:
            continue
        s = ZeRO(stage=stage, reshard_after_forward=keep).build(profile, spec)
        cost = price(s)  # the cost model prices the sharded collectives (shard_cost)
        if cost is None:
            continue
        name = f"ZeRO-{stage}" + ("" if stage < 3 else
                                  " (reshard after forward)" if keep else " (kept)")
        pool.append(Candidate(name, s, cost))
    estimates = [(c.name, est(c.strategy)) for c in pool]
    fitting = [(c, e) for c, (_, e) in zip(pool, estimates, strict=True)
               if fits(e, limit_bytes)]
    if not fitting:
        raise not_fitting(estimates, limit_bytes, f"{spec.source}: {where}", profile, world,
                          k, act)
    best, e = min(fitting, key=lambda t: t[0].cost.total_s)
    note = (f"memory: {best.name} needs {e.text()}, within {where} {mib(limit_bytes)}")
    if best is choice.best:
        return dc_replace(choice, notes=(*choice.notes, note), memory=e)
    first = estimates[0][1]
    note += (f"; {choice.best.name} would need {mib(first.peak)}")
    return dc_replace(choice, best=best,
                      candidates=tuple(sorted(pool, key=lambda c: c.cost.total_s)),
                      notes=(*choice.notes, note), memory=e)
