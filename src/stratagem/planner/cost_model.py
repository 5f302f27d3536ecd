"""The cost model: predicted time of one training step under any runnable strategy.

The strategy is compiled with the runtime's own :func:`compile_plan` (rank 0's view; the
groups, PS pieces, owners and buckets are the same on every rank), so the model prices
exactly what the runtime would execute:

- **compute**: forward + backward + the local update, from :class:`Calibration`;
- **all-reduce groups**, in the plan's launch order, each ready when its last gradient is,
  taking ``ring_allreduce_time`` of its (compressed) bytes plus the compressor's own work;
- **dense PS buckets**: pushed to their owner as they are ready (per-owner load, incast),
  the updated values pulled back after the update (exposed: the next forward waits;
  with sparse pieces, the values' hop waits out the rows' push, as the owners post the
  values first, but not their bytes);
  the push and the pull each cost a hop (:meth:`LinkModel.hop_s`: a ring's measured
  group cost per hop, the all-reduce groups' own fixed cost being the whole ring's); a
  push the owner paces (``runtime/ps/pacing.py``) costs a hop per sender;
- **sparse PS pieces**: rows a worker touches (``AccessStats``) spread over the owners by
  their share of the rows; pulled in the forward (on-demand pieces: a pull round per
  embedding call, ``AccessStats.calls``) or refreshed after the update to every worker
  (``local_replication``: the union of the workers' rows); pushed after backward and after
  the forward's closing round, which runs in the background from the end of forward; each
  message costs main-thread CPU, or, where the link probe measured a chained all-to-all,
  each of the exchange's collectives costs that, a pull round what the probe's chained
  rounds cost, the closing round what the probe's cost, and the push what the rest of
  the probe's sparse step cost, the rounds and the push with the probe's cost per row;
  a refresh's two all-to-alls, and the second all-to-all that replicated pieces' rows
  take in the push (no pull announced them), each cost a pull round's share, as ranks
  arrive at them unevenly from their own work;
- **sharded parameters** (:func:`shard_cost`): all-gathers, reduce-scatters, reduces
  and the owners' broadcasts, each half a ring all-reduce's bytes and fixed cost; the
  gathers and broadcasts exposed, the gradients' reduce(-scatter)s queued in backward;
- **overlap**: transfers queue on one link in launch order (``timeline.schedule``);
  whatever ends after backward is exposed communication; of the time spent moving bytes
  during backward, the measured share the compute loses (``LinkModel.interference``) is
  added too (fixed costs are waits, not counted there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem import env
from stratagem.analysis.profile import AccessStats, ModelProfile
from stratagem.planner.calibrate import Calibration
from stratagem.planner.links import (
    LinkModel,
    queued_ring_time,
    ring_bytes_time,
    ring_flows,
)
from stratagem.planner.timeline import Slot, exposed, overlapped, schedule
from stratagem.resource import ResourceSpec
from stratagem.runtime.allreduce import GATHER_HEADROOM
from stratagem.runtime.plan import GroupPlan, Plan, compile_plan
from stratagem.runtime.ps.pacing import paced_buckets
from stratagem.runtime.ps.plan import PSPiece
from stratagem.strategy.schema import Strategy
from stratagem.strategy.validate import server_devices

DDP_TENSOR_SHARE = 0.25
"""The ddp engine's work per all-reduced tensor as a share of this runtime's calibrated
``tensor_s`` (a C++ autograd hook and a copy into the bucket instead of a Python hook and
its copy; nominal, not calibrated: the trials measure the two engines side by side)."""

ID_BYTES = 8  # a row index on the wire (int64)
SPARSE_COLLECTIVES_PULL = 2  # per embedding call: ids, then rows (plus one closing round)
SPARSE_COLLECTIVES_PUSH = 2  # headers/announced rows, then the extra rows
SPARSE_COLLECTIVES_REFRESH = 2  # counts, then rows
GATHER_ROUNDS = 2  # gathered rows: the ids with the count, and the values (all-gathers:
# half a ring all-reduce's hops each)
GATHER_PASSES = 3  # padded in, concatenated, coalesced


@dataclass(frozen=True)
class StepCost:
    """A predicted step, split so that the parts add up to ``total_s``."""

    compute_s: float
    exposed_comm_s: float
    overhead_s: float
    link_bytes: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)
    slots: tuple[Slot, ...] = ()

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.overhead_s

    def to_dict(self) -> dict[str, Any]:
        return {"total_s": self.total_s, "compute_s": self.compute_s,
                "exposed_comm_s": self.exposed_comm_s, "overhead_s": self.overhead_s,
                "link_bytes": dict(self.link_bytes), "parts": dict(self.parts)}


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def gathered_rows(group: GroupPlan, access: dict[str, AccessStats], batch_size: int
                  ) -> tuple[float, float]:
    """(rows one worker sends, bytes of one row's values) of a ``gather_rows`` group: the
    rows its batch touches (``AccessStats``; the batch size where not measured)."""
    m = group.members[0]
    total = m.shape[0] if m.shape else 1
    stats = access.get(m.param)
    rows = stats.rows_touched if stats is not None else float(min(total, batch_size))
    return rows, m.numel / max(total, 1) * _itemsize(group.dtype)


def gather_cost(group: GroupPlan, links: LinkModel, replicas: list[str], cal: Calibration,
                access: dict[str, AccessStats]
                ) -> tuple[float, float, list[tuple[str, str, float]], float]:
    """:func:`group_cost` of a ``gather_rows`` group: every worker's rows (values and an
    index each) all-gathered on the ring -- each link carries the other workers' rows,
    what a ring all-reduce of half the gathered bytes carries -- in ``GATHER_ROUNDS``
    collectives, padded to the runtime's capacity (``GATHER_HEADROOM`` over the rows);
    then every worker concatenates and coalesces all of them (``GATHER_PASSES`` passes
    over the gathered bytes)."""
    rows, value_bytes = gathered_rows(group, access, cal.batch_size)
    n = len(replicas)
    gathered = n * rows * (value_bytes + ID_BYTES) * GATHER_HEADROOM
    moving = ring_bytes_time(links, replicas, gathered / 2)
    wire = queued_ring_time(links, n, moving, GATHER_ROUNDS)
    work = GATHER_PASSES * gathered / cal.copy_bps
    return wire, work, ring_flows(replicas, gathered / 2), max(0.0, wire - moving)


def group_cost(group: GroupPlan, links: LinkModel, replicas: list[str], cal: Calibration
               ) -> tuple[float, float, list[tuple[str, str, float]], float]:
    """(wire seconds, compressor seconds, flows, the wire seconds' fixed part) of one
    all-reduce group."""
    size = _itemsize(group.dtype)
    if group.compressor in ("fp16", "bf16"):
        nbytes = group.numel * 2
        work = 2 * group.numel * (size + 2) / cal.copy_bps  # cast in, cast back
        rounds = 1
    elif group.compressor == "powersgd":
        r = group.powersgd_rank
        nbytes, flops, rounds = 0.0, 0.0, 1
        for m in group.members:
            rows = m.shape[0] if m.shape else 1
            cols = m.numel // rows if rows else 0
            k = min(r, rows, cols)
            if len(m.shape) >= 2 and (rows + cols) * k * 2.0 < rows * cols:
                nbytes += (rows + cols) * k * size
                flops += 6.0 * rows * cols * k  # P = MQ, Q = M^T P, approx = P Q^T
                rounds = 2
            else:
                nbytes += m.numel * size
        work = flops / cal.flops
    else:
        nbytes, work, rounds = float(group.numel * size), 0.0, 1
    # a half-precision ring moves its bytes at its own measured rate (CPU-bound sums)
    rate = links.half_rate(group.compressor) if group.compressor in ("fp16", "bf16") else 1.0
    moving = ring_bytes_time(links, replicas, nbytes, rate)
    wire = queued_ring_time(links, len(replicas), moving, rounds)
    return wire, work, ring_flows(replicas, nbytes), max(0.0, wire - moving)


def half_ring_s(links: LinkModel, replicas: list[str], nbytes: float) -> tuple[float, float]:
    """(seconds, of them moving bytes) of an all-gather, reduce-scatter, reduce or
    broadcast of ``nbytes`` (the whole tensor) among ``replicas``: half a ring
    all-reduce's bytes ((n-1)/n of them on each link) and half its fixed cost."""
    if len(replicas) < 2 or nbytes <= 0:
        return 0.0, 0.0
    moving = ring_bytes_time(links, replicas, nbytes) / 2
    return moving + links.ring_fixed_s(len(replicas)) / 2, moving


def shard_cost(plan: Plan, links: LinkModel, replicas: list[str], cal: Calibration,
               nbytes: dict[str, int]
               ) -> tuple[list[tuple[float, str, float, float]], float,
                          list[tuple[str, str, float]], int]:
    """The sharded parameters' collectives (runtime/sharded.py): (backward events
    ``(ready, name, seconds, moving seconds)``, exposed seconds, flows, messages).

    Stage 3 (FSDP2), per unit: the forward's all-gather (exposed: the unit's forward waits
    for it), with ``reshard_after_forward`` the backward's all-gather again (exposed: its
    backward waits), and the gradients' reduce-scatter, queued in backward as the unit's
    gradients are ready. Stage 2: each parameter's gradient reduced to its owner as it is
    ready (queued in backward). Stages 1 and 2: after the update, each owner broadcasts
    its parameters (exposed: the next forward waits); stage-1 gradients are all-reduced
    in a group of the plan, priced with the groups."""
    shards = plan.shards
    assert shards is not None
    W = len(replicas)
    events: list[tuple[float, str, float, float]] = []
    flows: list[tuple[str, str, float]] = []
    exposed_s = 0.0
    messages = 0
    per_msg = 2 * (W - 1)  # a ring all-gather or reduce-scatter: (n-1) sends and receives

    for u in shards.units:
        b = sum(nbytes[p] for p in u.params)
        rs, rs_moving = half_ring_s(links, replicas, b)
        gather = rs  # (an all-gather moves what a reduce-scatter does)
        gathers = 2 if u.reshard_after_forward else 1
        exposed_s += gathers * gather
        events.append((_ready(cal, list(u.params)), f"reduce-scatter {u.module or '(root)'}",
                       rs, rs_moving))
        flows += ring_flows(replicas, b / 2) * (gathers + 1)  # half a ring each
        messages += per_msg * (gathers + 1)
    owned_bytes: dict[int, int] = {}
    for o in shards.owned:
        b = nbytes[o.param]
        owned_bytes[o.owner] = owned_bytes.get(o.owner, 0) + b
        if o.stage == 2:
            t, moving = half_ring_s(links, replicas, b)
            events.append((_ready(cal, [o.param]), f"reduce {o.param}", t, moving))
            flows += ring_flows(replicas, b / 2)
            messages += per_msg
    for b in owned_bytes.values():  # one flat broadcast per owner
        t, _ = half_ring_s(links, replicas, b)
        exposed_s += t
        flows += ring_flows(replicas, b / 2)
        messages += per_msg
    return events, exposed_s, flows, messages


def _ready(cal: Calibration, params: list[str]) -> float:
    """When the last of ``params``' gradients is ready (seconds into backward)."""
    return max((cal.grad_ready_s.get(p, cal.backward_s) for p in params), default=0.0)


def _touched(piece: PSPiece, info_rows: int, stats: AccessStats | None,
             batch_size: int) -> float:
    """Rows of ``piece`` one worker's batch touches (its share of the parameter's)."""
    touched = stats.rows_touched if stats is not None else float(min(info_rows, batch_size))
    return touched * piece.rows / max(info_rows, 1)


def pull_calls(ps: Any, access: dict[str, AccessStats]) -> int:
    """Pull rounds of one forward: a round per embedding call of every table pulled on
    demand (``AccessStats.calls``; one call where not measured)."""
    return sum(pull_rounds(ps, access))


def _pulled_owners(ps: Any) -> dict[str, set[int]]:
    """The owners of each table pulled on demand."""
    owners: dict[str, set[int]] = {}
    for p in ps.sparse:
        if not p.local_replication and not p.rows_from_grad:
            owners.setdefault(p.param, set()).add(p.owner)
    return owners


def pull_rounds(ps: Any, access: dict[str, AccessStats],
                owners: dict[str, set[int]] | None = None) -> tuple[int, int]:
    """(rounds of tables split over several owners, rounds of tables with one owner) of one
    forward, as :func:`pull_calls` counts them (``owners``: :func:`_pulled_owners`, when
    the caller has it)."""
    owners = _pulled_owners(ps) if owners is None else owners
    calls = {t: access[t].calls if t in access else 1 for t in owners}
    return (sum(n for t, n in calls.items() if len(owners[t]) > 1),
            sum(n for t, n in calls.items() if len(owners[t]) == 1))


def plan_for(strategy: Strategy, profile: ModelProfile, spec: ResourceSpec) -> Plan:
    return compile_plan(strategy, profile, rank=0, world_size=spec.num_workers,
                        device=torch.device("cpu"), servers=server_devices(spec))


def predict(strategy: Strategy, profile: ModelProfile, spec: ResourceSpec,
            cal: Calibration, links: LinkModel | None = None,
            plan: Plan | None = None) -> StepCost:
    """Predicted seconds of one step of ``strategy`` (see the module docstring)."""
    links = links or LinkModel.from_spec(spec)
    plan = plan or plan_for(strategy, profile, spec)
    replicas = list(spec.replicas)
    W = len(replicas)
    info = {p.name: p for p in profile.params}
    access = {a.name: a for a in (profile.access or cal.access)}
    if W < 2:
        return StepCost(cal.forward_s + cal.backward_s + cal.optimizer_s, 0.0, 0.0,
                        parts={"forward": cal.forward_s, "backward": cal.backward_s,
                               "update": cal.optimizer_s})
    ps = plan.ps
    owners_dev = list(ps.replicas) + list(ps.servers) if ps else replicas
    events: list[tuple[float, str, float, float]] = []  # (ready, name, duration, bytes')
    all_flows: list[tuple[str, str, float]] = []
    work_s = 0.0
    messages = 0
    ar_bytes = 0
    tensors = sum(len(g.members) for g in plan.groups)
    # a slice of a parameter is copied back into its gradient after the wait (a whole
    # parameter's gradient is a view of its group's buffer)
    sliced_bytes = sum(m.numel * _itemsize(g.dtype) for g in plan.groups for m in g.members
                       if not m.whole)
    for g in plan.groups:  # (on the ddp engine too: each group is one DDP bucket)
        if g.gather_rows:
            wire, work, flows, fixed = gather_cost(g, links, replicas, cal, access)
            rows, value_bytes = gathered_rows(g, access, cal.batch_size)
            ar_bytes += min(g.nbytes, W * rows * value_bytes)  # the rows updated
        else:
            wire, work, flows, fixed = group_cost(g, links, replicas, cal)
            ar_bytes += g.nbytes
        moving = max(0.0, wire - fixed)
        events.append((_ready(cal, list(g.params)), f"allreduce group {g.id}", wire + work,
                       moving))
        all_flows += flows
        work_s += work

    pull_s = refresh_s = fwd_pull_s = sparse_push_s = scan_s = closing_s = 0.0
    in_collectives = 0  # messages priced inside the measured all-to-alls, not one by one
    owned_bytes = [0.0] * (ps.size if ps else 0)
    owned_pieces = [0] * (ps.size if ps else 0)  # dense pieces each owner updates
    if ps is not None:
        # Dense buckets: push as ready (launch order), pull values after the update.
        # Buckets of different owners travel at the same time on different links: the
        # pushes together take transfer_time(all of them), shared out by bytes.
        pull_flows: list[tuple[str, str, float]] = []
        push_flows_all: list[tuple[str, str, float]] = []
        buckets = []
        for b in ps.buckets:
            pieces = [ps.pieces[i] for i in b.pieces]
            nbytes = b.numel * _itemsize(b.dtype)
            owner = owners_dev[b.owner]
            flows = [(w, owner, nbytes) for w in replicas if w != owner]
            pull_flows += [(owner, w, nbytes) for w in replicas if w != owner]
            push_flows_all += flows
            buckets.append((b, pieces, nbytes, len(flows)))
            messages += 2 * len(flows)  # per worker: one push and one pull per remote owner
            tensors += len(pieces)
            owned_bytes[b.owner] += nbytes
            owned_pieces[b.owner] += len(pieces)
        push_total = links.transfer_time(push_flows_all)
        dense_bytes = sum(n for _, _, n, _ in buckets) or 1
        hop = links.hop_s(W)  # a bucket's push, and the values' pull, each one hop
        paced = paced_buckets(ps.buckets, W, env.ps_pace_bytes())
        for b, pieces, nbytes, senders in buckets:
            moving = push_total * nbytes / dense_bytes
            hops = senders if b.id in paced else 1
            events.append((_ready(cal, [p.param for p in pieces]), f"push bucket {b.id}",
                           moving + hops * hop, moving))
        all_flows += push_flows_all + pull_flows
        pull_wire_s = links.transfer_time(pull_flows)
        pull_s = pull_wire_s + (hop if pull_flows else 0.0)
        # Sparse pieces: rows per worker, by owner.
        fwd_flows: list[tuple[str, str, float]] = []
        push_flows: list[tuple[str, str, float]] = []
        ref_flows: list[tuple[str, str, float]] = []
        on_demand = replicated = False
        asked = pushed = 0.0  # rows a worker asks for in the forward, pushes after backward
        asked_one = 0.0  # of them, rows of tables with one owner
        owners = _pulled_owners(ps)
        alone_tables = {t for t, o in owners.items() if len(o) == 1}
        for p in ps.sparse:
            pinfo = info[p.param]
            rows = pinfo.shape[0]
            row_bytes = pinfo.bytes / max(rows, 1)
            if p.rows_from_grad:  # the runtime finds the non-zero rows of the dense grad
                scan_s += p.rows * row_bytes / cal.scan_bps
            stats = access.get(p.param)
            u = _touched(p, rows, stats, cal.batch_size)
            owner = owners_dev[p.owner]
            remote = sum(w != owner for w in replicas) / W  # a worker's share of askers
            pushed += u * remote
            if not p.local_replication:
                asked += u * remote
                if p.param in alone_tables:
                    asked_one += u * remote
            for w in replicas:
                if w == owner:
                    continue
                if p.local_replication:
                    push_flows.append((w, owner, u * (row_bytes + ID_BYTES)))
                else:
                    fwd_flows.append((w, owner, u * ID_BYTES))
                    fwd_flows.append((owner, w, u * row_bytes))
                    push_flows.append((w, owner, u * row_bytes))
            if p.local_replication:
                replicated = True
                # the workers' rows together: disjoint (which rows other workers touch
                # is not measured, so the upper bound)
                union = min(float(p.rows), u * W)
                ref_flows += [(owner, w, union * (row_bytes + ID_BYTES))
                              for w in replicas if w != owner]
            else:
                on_demand = True
            owned_bytes[p.owner] += u * row_bytes * W
        peers = ps.size - 1
        shared, alone = pull_rounds(ps, access, owners) if on_demand else (0, 0)
        calls = shared + alone
        closing = 1 if on_demand else 0
        n_coll = (SPARSE_COLLECTIVES_PULL * calls + closing + SPARSE_COLLECTIVES_PUSH
                  + (SPARSE_COLLECTIVES_REFRESH if replicated else 0)) if ps.sparse else 0
        messages += n_coll * peers
        if links.all_to_all_s > 0:  # measured: a chained all-to-all, its messages' CPU in it
            lat = links.all_to_all_s
            in_collectives = n_coll * peers
        else:
            lat = links.latency_s
        # a pull round (an embedding call): measured in a chain, or its two all-to-alls;
        # the push likewise (the probe's sparse step, or its collectives). A table with
        # one owner has its own measured round: no exchange carries rows both ways
        round_s = links.pull_round_s or SPARSE_COLLECTIVES_PULL * lat
        # one blocking all-to-all between a step's own work: a pull round's share (ranks
        # arrive at it unevenly, as they do at a pull round; the chained all-to-all of the
        # probe runs in step)
        step_coll_s = round_s / SPARSE_COLLECTIVES_PULL
        round_one_s, row_one_s = ((links.pull_round_one_s, links.pull_row_one_s)
                                  if links.pull_round_one_s else (round_s, links.pull_row_s))
        fwd_pull_s = links.transfer_time(fwd_flows) if fwd_flows else 0.0
        sparse_push_s = links.transfer_time(push_flows) if ps.sparse else 0.0
        refresh_s = links.transfer_time(ref_flows) if ref_flows else 0.0
        if ps.sparse:
            fwd_pull_s += (round_s * shared + round_one_s * alone
                           + links.pull_row_s * (asked - asked_one) + row_one_s * asked_one)
            # the closing round: started in the background as forward ends, done before
            # the push (below: it runs from the start of backward); a probe that did not
            # time it apart counted it in its push
            if closing:
                closing_s = links.closing_s or (0.0 if links.sparse_push_s else lat)
            sparse_push_s += (links.sparse_push_s or lat * SPARSE_COLLECTIVES_PUSH
                              ) + links.push_row_s * pushed
            if replicated and links.sparse_push_s:
                # the probe's push carries rows its pulls announced; rows of replicated
                # pieces, never announced, follow the headers in a second all-to-all
                sparse_push_s += step_coll_s
            refresh_s += step_coll_s * (SPARSE_COLLECTIVES_REFRESH if replicated else 0)
            # the owners post the dense values before they wait for the sparse rows'
            # push: the values' hop waits that out; their bytes still take the link
            pull_s = max(pull_wire_s, pull_s - sparse_push_s)
        all_flows += fwd_flows + push_flows + ref_flows

    shard_exposed_s = 0.0
    if plan.shards is not None:
        shard_events, shard_exposed_s, shard_flows, shard_msgs = shard_cost(
            plan, links, replicas, cal, {n: p.bytes for n, p in info.items()})
        events += shard_events
        all_flows += shard_flows
        messages += shard_msgs
    events.sort(key=lambda e: e[0])  # the link takes them as they become ready
    slots = schedule([(name, ready, dur) for ready, name, dur, _ in events])
    # what moving the overlapped transfers' bytes takes from the backward pass's CPU (the
    # measured share; fixed costs are waits, the compressor's work is priced apart)
    contention_s = links.interference * sum(
        overlapped([s], cal.backward_s) * (m / d if d > 0 else 0.0)
        for s, (_, _, d, m) in zip(slots, events, strict=True))
    if ps is not None and ps.sparse:  # after backward (and the closing round)
        end = max((s.end_s for s in slots), default=0.0)
        start = max(end, cal.backward_s, closing_s)
        slots.append(Slot("sparse push", cal.backward_s, start, start + sparse_push_s))
    backward_tail = exposed(slots, cal.backward_s)
    # The local update touches what this worker updates: all-reduced values and its shards;
    # a sparse gradient all-reduced is first made dense (a pass over its bytes).
    local = ar_bytes + (max(owned_bytes) if owned_bytes else 0.0)
    densify = sum(info[m.param].bytes * m.numel / max(info[m.param].numel, 1)
                  for g in plan.groups for m in g.members
                  if info[m.param].sparse and not g.gather_rows)
    update_s = cal.update_s(local + densify, profile.total_bytes)
    compute = cal.forward_s + cal.backward_s + update_s
    exposed_comm = (backward_tail + contention_s + pull_s + refresh_s + fwd_pull_s
                    + shard_exposed_s)
    # Compressor work runs inside the queued transfers (counted there; shown apart).
    # The runtime's own work per tensor (hook, copy in and back) and per group.
    # (a dense PS bucket's machinery -- buffer, posting its sends -- is priced as a group's)
    groups = len(plan.groups) + (len(ps.buckets) if ps is not None else 0)
    write_back_s = sliced_bytes / (cal.update_bps or cal.copy_bps)
    # the busiest owner's work per piece it owns holds back the values every worker pulls
    owner_s = max(owned_pieces, default=0) * cal.piece_s
    # torch's DDP reducer (the ddp engine) runs the all-reduced tensors' hooks in C++
    tensor_s = cal.tensor_s * (DDP_TENSOR_SHARE if plan.engine == "ddp" else 1.0)
    runtime_s = (tensors * tensor_s + groups * cal.group_s + owner_s + scan_s
                 + write_back_s)
    overhead = (messages - in_collectives) * links.message_cpu_s + runtime_s
    parts = {"forward": cal.forward_s, "backward": cal.backward_s, "update": update_s,
             "backward_tail": backward_tail, "contention": contention_s,
             "ps_pull": pull_s, "sparse_pull": fwd_pull_s,
             "sparse_push": sparse_push_s, "closing_round": closing_s,
             "refresh": refresh_s,
             "compressor_work": work_s, "messages": float(messages),
             "runtime": runtime_s, "tensors": float(tensors), "row_scan": scan_s,
             "write_back": write_back_s, "owner_pieces": owner_s,
             "sharded_exposed": shard_exposed_s}
    return StepCost(compute_s=compute, exposed_comm_s=exposed_comm, overhead_s=overhead,
                    link_bytes=links.flow_bytes(all_flows), parts=parts,
                    slots=tuple(slots))
