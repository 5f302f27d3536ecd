"""Measured fixed costs and links: what the cost model's constants are on this machine.

Measurements seconds long at most:

- :func:`runtime_costs` (one process, or pooled over every worker at once): the
  runtime's own cost per all-reduce *tensor* (the gradient hook, the copy into the group
  buffer and back) and per *group* (buffer handling and launch), timed by running the real
  :class:`~stratagem.runtime.allreduce.AllReduceReducer` over many small parameters with a
  collective that completes at once. Small steps of models with hundreds of tensors are
  dominated by these.
- :func:`owner_piece_cost` (likewise): an owner's own cost per dense PS piece it owns, on
  the runtime's ``DenseBucket`` and ``ShardOptimizer``.
- :func:`probe_links` (every worker at once, a process group up): the link as the workers
  see it. A one-element all-reduce repeated gives the fixed cost of one collective; all-
  reduces of a few sizes give the effective bus bandwidth (the slope), and one of 64 MiB,
  where it fits the budget, the rate of buffers past the caches; a one-element
  ping-pong between ranks 0 and 1 gives the cost of one point-to-point message (in
  both passes of small operations, the faster kept); one
  transfer from rank 0 to another node while the rest wait, the rate of one link alone
  (where every node shares the host's cores, above the all-reduces' rate); small
  all-reduces queued back to back, as the reducer launches its groups, the fixed cost of
  one all-reduce group and the least a queued group takes (:data:`QUEUED`); tiny
  all-to-alls back to back the cost of one in a chain (the sparse rows' exchange is such a
  chain: ids, rows, counts, each waiting for the last); the runtime's own sparse exchange
  (:func:`_sparse_step`), with few rows and with many, gives a pull round's cost (an
  embedding call of a parameter-server table), the closing round's, and the rest of a
  sparse step's (push and owner update), each fixed and per row (these three small
  operations in two passes seconds apart, :class:`_SmallOps`); one size all-reduced
  again as fp16 and as bf16, in two passes too (:class:`_HalfRates`), gives how much
  faster or slower half-precision bytes move (gloo sums fp16 elementwise in software: on
  loopback an fp16 all-reduce of half the bytes took 1.2x an fp32 one's time, a bf16 one
  0.6x, so on a CPU-bound link fp16 compression saves nothing); an
  all-reduce run beside a compute loop gives how much of its time the compute loses
  (:func:`_interference`: on a fast link moving bytes is CPU work, not hidden by overlap). Every
  number is averaged over the ranks with an all-reduce, so every rank plans with the same
  link model. Bounded: each size is tried only if it fits in ``PROBE_BUDGET_S`` at the
  rate measured so far (the spec's nominal rate at first).

Both are cached per process (the link probe per resource spec and world size).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from stratagem.distributed.gloo_threads import Yielding, unclaimed_loops
from stratagem.planner.links import GBIT_BYTES, LINK_EFFICIENCY
from stratagem.resource import ResourceSpec
from stratagem.runtime.plan import compile_plan
from stratagem.strategy.schema import AllReduceSynchronizer, NodeConfig, Strategy

T = TypeVar("T")

PROBE_BUDGET_S = 2.0
"""The link probe's bound (all sizes and repeats together, at the rate measured so far)."""
TINY_REPEATS = 20
SIZES_MIB = (0.25, 1.0, 4.0, 16.0)
"""All-reduce sizes of the bandwidth probe. The largest is a gradient bucket's order (DDP's
25 MB): with four workers on two cores at 10 Gbit/s, all-reduces of 4 MiB ran at 1.4 GB/s
bus bandwidth and the 64 MB of DLRM's table at 0.4 GB/s."""
SUSPECT_RATE = 0.5
"""A bus rate fitted below this share of the spec's is measured again and the faster fit
kept (a link that is slower than its spec reads slow twice): one probe in 14 fresh jobs
read a 10 Gbit/s link at 0.11 GB/s against 0.84-1.09 in the others, and priced wide &
deep's all-reduce 5.7x slow."""
BIG_MIB = 64.0
"""One all-reduce this large after the fit, when it fits in what is left of the budget
(on a fast link): the rate of buffers past the caches, at which a large table's all-reduce
runs (4 nodes on 2 cores at 10 Gbit/s: 0.66-0.69 GB/s for 89 MB against 0.74-0.87 GB/s
fitted up to 16 MiB)."""
TENSORS = 256  # small parameters the runtime-cost measurement runs over
CHAIN = 8
"""Tiny all-to-alls timed back to back (per repeat). Chained, not one after a barrier: with
four workers on two cores one all-to-all after a barrier took 0.5 ms, four in a row 4.6 ms
(each waits for every peer to be scheduled again), and the rows' exchange is such a chain."""
CHAIN_REPEATS = 5
"""Chains timed in each of the probe's two passes of small operations (:class:`_SmallOps`)."""
SPARSE_REPEATS = 5
"""Repeats of the sparse step (:func:`_sparse_step`) in each of those passes, a trimmed
mean of each part over both (:func:`_steady`): at 2 nodes and 10 Gbit/s a third of the
steps' rest took 3-5 ms instead of 0.6-0.9 (a peer late from its forward), so a median
read either mode from run to run (0.8-3.9 ms), where a training step pays each mode as
often as it comes."""
TRIM = 2
"""Repeats dropped at each end before :func:`_steady` averages the rest."""
LINK_S = 0.05
LINK_MIB = 16.0
"""One link alone (:func:`_one_link`) moves what takes ``LINK_S`` at the all-reduces' bus
rate (the smallest rank's), at most ``LINK_MIB`` (1 MiB at least)..."""
LINK_REPEATS = 3
"""...this many times after a warm-up (0.2 s)."""
LINK_BELOW_BUS = 0.8
"""A link alone read below this share of the all-reduces' bus rate is disturbed: in the
ring the same link carries the bus rate while its ends also receive, so alone it is not
slower. Such a reading is timed again with twice the repeats, and the link is taken at
no less than the bus rate (:func:`settled_link`). On a slower host, two probes in nine read
a 10 Gbit/s link alone at 0.26 and 0.63 GB/s against a bus rate of 0.64 and 1.02 (the
others 1.01-1.19), and priced the LSTM LM's parameter-server pulls 1.9x slow."""
QUEUED = 8
QUEUED_KIB = 64
"""All-reduces of this many KiB launched back to back, ``QUEUED`` at a time, as the
runtime's reducer launches its groups during backward: the fixed cost of a group. A
one-element all-reduce understates it. Four workers on two cores at 10 Gbit/s: 0.5 ms for
one element, 6-8 ms for 1 KiB to 256 KiB (each ring hop waits for the next process to
be scheduled), 6 ms each queued; many_small's step grew by 7 ms per group. The cost hides
behind a larger group's bytes: 2 nodes at 1 Gbit/s, queued all-reduces of 16 and 64 KiB
took 2.3-2.7 ms each, of 256 KiB to 4 MiB their wire time (2.2-35 ms) and no more."""
QUEUED_REPEATS = 6
"""Rounds of ``QUEUED`` timed in each of the two passes (:class:`_SmallOps`), seconds
apart; the trimmed mean of all of them (:func:`_steady`) is the figure. The rounds'
stalls come in spells: at 2 nodes and 1 Gbit/s a round's mean read 0.5-3.8 ms within
one job, the trimmed mean of 9 rounds at once 0.65-2.9 ms from probe to probe in the
same processes, and a median of 5 rounds 1.2-2.9 ms from job to job."""
ROUND_ROWS = (32, 4096)
"""Rows one worker asks in a timed pull round (16 floats each): a few of each other worker
(the fixed cost of a round and a push), then many in all, split over the other workers (the
cost per row). The many must cost well over the rounds' noise: at 2 nodes and 10 Gbit/s 512
rows added 0.1-0.2 ms to a round that varied by 1-2 ms, and the slope read 0.4-3.3 us a row
from run to run (the wide-and-deep model's pull mispriced by 10 ms); 4096 rows read
0.08-0.21 us. The signal is the round's rows in all, so at 4 nodes each peer is asked a
third of them: 4096 of each took 11 of the probe's 19 s there (4 nodes on 2 cores, 10
Gbit/s), and a third of that read the slope at 1.6-2.0 us against 1.3-1.4. Fewer on a slow
link, where each row's wire time adds to the signal: as many as take ``ROUND_WIRE_S`` on the
link (4 nodes at 1 Gbit/s: about 900 of each peer), 4 times the few at least."""
ROUND_WIRE_S = 0.002
ROW_BYTES = 16 * 4 + 8  # a probe row and its id
INTERFERE_S = 0.05
"""Seconds (at the measured rate) of the all-reduce run under a compute loop of about its
length, to measure how much each slows the other: the cost model's
``LinkModel.interference``."""
INTERFERE_MIB = (0.25, 16.0)
"""Bounds of that all-reduce's size."""
WORK_N = 128
"""The compute loop's matrices (``WORK_N`` square, fp32 matmuls: backward's kind of work)."""
HALF_MIB = 16.0
"""The size (MiB) all-reduced again in fp16 and bf16, the same bytes in each dtype (less
where it would not fit in the budget below at the measured rate). The ratio moves with the
size: on loopback fp16's was 0.3-0.5 at 1 MiB, 0.6 at 4 MiB, 0.9 at 16 MiB; at 2 nodes
and 10 Gbit/s, one core per node, 0.48 at 8 MiB and 0.65 at 32 and 64 MiB, where training
casts its large groups (DLRM's 64 MB ring ran at 0.6 of fp32's)."""
HALF_ROUNDS = 4
"""Rounds of one fp32, one fp16 and one bf16 all-reduce in each of the probe's two passes;
the medians of each dtype over both give the rates."""
HALF_BUDGET_S = 1.3
"""...within what is left of ``PROBE_BUDGET_S``, or at least this long: the warm-up and
both passes are 9 rounds of the three dtypes, about 35 fp32 all-reduces' time where fp16
runs at 0.6 of fp32's rate (sized for 48, so that a bus rate read a little high still
fits; at 0.5 s and 24, one of seven probes at 4 nodes and 10 Gbit/s found its 12 MiB
warm-up too slow for the passes and left fp16 unmeasured)."""
HALF_FP32_ALLREDUCES = 48
"""fp32 all-reduces' time at the measured rate the half-precision passes are sized for."""


_WAITS = [Yielding(())]
"""The running probe's waits (:func:`probe_links` sets it): each wait yields gloo's I/O
threads exactly as the runtime's waits do (``Comm.wait``), the rest of the probe does not,
so the probe pays what training pays between its waits."""


def _wait(work: Any) -> None:
    with _WAITS[0]:
        work.wait()


class _WorldGroup:
    """The default process group as the runtime's sparse exchange uses a group."""

    def __init__(self) -> None:
        self.size = dist.get_world_size()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> Any:
        return dist.all_to_all_single(out, inp, out_splits or None, in_splits or None,
                                      async_op=True)

    def run(self, fn, what: str) -> None:  # noqa: ANN001 - as Group.run
        _wait(fn())

    def wait(self, work: Any, what: str = "") -> None:
        _wait(work)

_OWNER: dict[bool, list[float]] = {}  # owner_piece_cost's timed rounds, by together
_RUNTIME: dict[bool, dict[int, list[float]]] = {}
"""runtime_costs' timed backwards: by ``together``, then by group count."""
_LINKS: dict[tuple, LinkProbe] = {}


@dataclass(frozen=True)
class LinkProbe:
    """Measured link figures (averaged over ranks): fixed cost of one all-reduce call,
    effective bus bandwidth (bytes/s; ``2(n-1)/n · S / (T - fixed)``), one point-to-point
    message's cost, and how long the probe took."""

    world: int
    collective_s: float
    bus_bps: float
    message_s: float
    seconds: float
    nominal_bps: float
    all_to_all_s: float = 0.0
    """One tiny all-to-all in a chain of them (0: not measured)."""
    pull_round_s: float = 0.0
    """One on-demand pull round of the runtime's sparse exchange, in a chain of them
    (small rows; 0: not measured)."""
    pull_round_one_s: float = 0.0
    """The same round where the table has one owner (rank 0 serves, the others ask), timed
    beside the shared rounds with as many rows (0: not measured)."""
    pull_row_one_s: float = 0.0
    """Its seconds per row a worker asks for (the rows' wire time not)."""
    sparse_push_s: float = 0.0
    """The rest of that sparse step after its closing round: the gradient rows pushed to
    their owners, the owners' sparse update (0: not measured)."""
    closing_s: float = 0.0
    """The closing pull round of that sparse step (the runtime runs it in the background
    while backward computes; 0: not measured)."""
    pull_row_s: float = 0.0
    """A pull round's seconds per row a worker asks for (the serving side's included; the
    rows' wire time not)."""
    push_row_s: float = 0.0
    """The push and update's seconds per row a worker pushes (its wire time not)."""
    big_rate: float = 0.0
    """Bus bytes/s of a ``BIG_MIB`` all-reduce over ``bus_bps`` (0: not measured)."""
    fp16_rate: float = 0.0
    """Bytes/s of an fp16 all-reduce over those of an fp32 one of the same bytes (0: not
    measured)."""
    bf16_rate: float = 0.0
    """The same for bf16."""
    group_fixed_s: float = 0.0
    """Fixed seconds of one all-reduce with a payload among queued ones (``QUEUED_KIB``;
    its wire time at ``bus_bps`` taken off, at least ``collective_s``; 0: not measured)."""
    group_period_s: float = 0.0
    """Seconds of one ``QUEUED_KIB`` all-reduce among queued ones, its wire time in it: the
    least a queued group takes (0: not measured)."""
    interference: float = 0.0
    """Share of an overlapped all-reduce's time a compute loop beside it loses
    (:func:`_interference`; 0: none, or not measured)."""
    link_bps: float = 0.0
    """Bytes/s of one link alone: rank 0 sending to a rank on another node while the
    others wait (:func:`_one_link`; 0: one node, or not measured)."""
    parts: tuple[tuple[str, float], ...] = ()
    """Rank 0's seconds in each of the probe's phases, in order (where ``seconds`` went)."""

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "collective_s": self.collective_s,
                "bus_bps": self.bus_bps, "message_s": self.message_s,
                "all_to_all_s": self.all_to_all_s, "pull_round_s": self.pull_round_s,
                "pull_round_one_s": self.pull_round_one_s,
                "pull_row_one_s": self.pull_row_one_s,
                "sparse_push_s": self.sparse_push_s, "closing_s": self.closing_s,
                "pull_row_s": self.pull_row_s,
                "push_row_s": self.push_row_s, "big_rate": self.big_rate,
                "fp16_rate": self.fp16_rate, "bf16_rate": self.bf16_rate,
                "group_fixed_s": self.group_fixed_s, "group_period_s": self.group_period_s,
                "interference": self.interference,
                "link_bps": self.link_bps, "seconds": self.seconds,
                "nominal_bps": self.nominal_bps,
                "parts_s": {k: round(v, 3) for k, v in self.parts}}


class _DoneWork:
    def wait(self) -> bool:
        return True


class _NullComm:
    """A Comm whose collectives complete at once: what remains is the runtime's own cost."""

    world_size = 2

    def all_reduce(self, tensor: torch.Tensor) -> _DoneWork:
        return _DoneWork()

    def wait(self, work: _DoneWork) -> None:
        work.wait()


def _time_backward(model: nn.Module, x: torch.Tensor, repeats: int,
                   sync: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = None
        loss = model(x).sum()
        sync()
        t = time.process_time()
        loss.backward()
        times.append(time.process_time() - t)
    return statistics.median(times)


RUNTIME_REPEATS = 7  # rounds of runtime_costs' three backwards


def runtime_costs(together: bool = False) -> tuple[float, float]:
    """(CPU seconds per all-reduced tensor, CPU seconds per all-reduce group) of the
    runtime's reducer, beyond the collective itself: medians of this process's timed
    backwards (measured once, ~0.2 s) or, ``together`` (every worker of the default process
    group calls it at once), of every rank's. CPU time, not wall time: ranks sharing cores
    read 3-20 us a tensor in wall time at 4 nodes on 2 cores (the time slices a short
    backward happened to get), and priced many_small's partitioned PS up to 45% fast;
    calibration scales it by what a CPU second costs while every rank computes."""
    samples = measured_once(_RUNTIME, together, _time_runtime)
    plain, one, many = (statistics.median(gathered(samples[g]) if together else samples[g])
                        for g in sorted(samples))
    many_groups = max(samples)
    return max(0.0, one - plain) / TENSORS, max(0.0, many - one) / (many_groups - 1)


def _time_runtime(sync: Callable[[], Any]) -> dict[int, list[float]]:
    """CPU seconds of a backward over ``TENSORS`` small parameters without the reducer
    (0), with it in one group (1) and in ``TENSORS // 4`` groups, ``RUNTIME_REPEATS`` of
    each in rounds (load that comes and goes hits all three alike), ``sync`` before each."""
    from stratagem.analysis.profile import analyze
    from stratagem.runtime.allreduce import AllReduceReducer
    from stratagem.runtime.stats import CommStats

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(TENSORS)])
    x = torch.randn(2, 8)
    profile = analyze(model)
    names = [p.name for p in profile.params]
    params = dict(model.named_parameters())

    def reducer(groups: int) -> AllReduceReducer:
        per = -(-len(names) // groups)
        strategy = Strategy(node_config=tuple(
            NodeConfig(n, AllReduceSynchronizer(group=i // per)) for i, n in enumerate(names)))
        plan = compile_plan(strategy, profile, rank=0, world_size=2,
                            device=torch.device("cpu"))
        return AllReduceReducer(plan, params, {g.backend: _NullComm() for g in plan.groups},
                                CommStats())

    samples: dict[int, list[float]] = {0: [], 1: [], TENSORS // 4: []}
    _time_backward(model, x, 1, sync)  # warm-up
    for _ in range(RUNTIME_REPEATS):
        samples[0].append(_time_backward(model, x, 1, sync))
        for groups in (1, TENSORS // 4):
            r = reducer(groups)
            try:
                samples[groups].append(_time_backward(model, x, 2, sync))
            finally:
                r.remove_hooks()
    return samples


class _OwnGroup:
    """A PS group of one member (the owner itself): its values go to no one."""

    members = (0,)


def owner_piece_cost(together: bool = False) -> float:
    """CPU seconds an owner spends each step per dense PS piece it owns, beyond its bytes:
    giving the piece's shard its summed gradient, the optimizer's update of it, clearing
    it and copying its value out for the pull (the runtime's ``DenseBucket`` and
    ``ShardOptimizer``, SGD, over ``TENSORS`` small pieces of one bucket this process
    owns). Median of ``RUNTIME_REPEATS`` rounds (every rank's, ``together``). Priced per
    owned piece, not per byte: a partitioned PS of many small tensors gives each owner a
    piece of every parameter (many_small: 482 on each of 4 owners)."""
    samples = measured_once(_OWNER, together, _time_owner)
    return statistics.median(gathered(samples) if together else samples)


def _time_owner(sync: Callable[[], Any]) -> list[float]:
    from stratagem.runtime.ps.dense import DenseBucket
    from stratagem.runtime.ps.optim import ShardOptimizer
    from stratagem.runtime.ps.plan import PSBucket, PSPiece
    from stratagem.runtime.stats import CommStats

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(TENSORS)])
    params = dict(model.named_parameters())
    pieces, offset = [], 0
    for i, (name, param) in enumerate(params.items()):
        pieces.append(PSPiece(id=i, param=name, index=i, shape=tuple(param.shape),
                              dtype="float32", owner=0, destination="probe", bucket=0,
                              offset=offset))
        offset += param.numel()
    plan = PSBucket(id=0, owner=0, dtype="float32", pieces=tuple(range(len(pieces))),
                    numel=offset)
    bucket = DenseBucket(plan, pieces, params, _OwnGroup(), 0, 1,  # type: ignore[arg-type]
                         torch.device("cpu"), CommStats())
    shards = {pc.id: params[pc.param].detach().clone() for pc in pieces}
    opt = ShardOptimizer([torch.optim.SGD(model.parameters(), lr=0.0)],
                         [(shards[pc.id], 0, 0, False, pc.param) for pc in pieces])

    def owner_step() -> float:
        assert bucket.acc is not None
        bucket.acc.fill_(1.0)  # every piece pushed (its presence slot set)
        sync()
        t = time.process_time()
        bucket.attach_grads(shards)
        opt.step(sparse=False)
        bucket.clear_grads(shards)
        bucket.post_values(shards)
        return (time.process_time() - t) / len(pieces)

    owner_step()  # warm-up
    return [owner_step() for _ in range(RUNTIME_REPEATS)]


def measured_once(cache: dict[bool, T], together: bool,
                  measure: Callable[[Callable[[], Any]], T]) -> T:
    """``cache[together]``, else ``measure(sync)`` stored there. ``together`` (every
    worker of the default process group calls it at once): ``sync`` is a barrier, to call
    before each timed run so that every rank runs it at once, as training runs its steps
    (ranks sharing cores that each time at their own pace read them 2-5x apart), and the
    cache is reused only where every rank has it (else all measure again, in step)."""
    have = together in cache
    if together:
        have = bool(agreed(float(have)))
    if not have:
        cache[together] = measure(dist.barrier if together else (lambda: None))
    return cache[together]


def _timed_allreduce(t: torch.Tensor, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        s = time.perf_counter()
        _wait(dist.all_reduce(t, async_op=True))
        out.append(time.perf_counter() - s)
    return out


def agreed(value: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.MIN) -> float:
    """The ranks' ``value``s reduced by ``op`` (the smallest by default), on every rank:
    each decides alike (whether a size fits, how large to make it)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def gathered(values: list[float]) -> list[float]:
    """Every rank's ``values`` (as many on each rank), concatenated, on every rank: for
    medians over all ranks' samples, where one disturbed rank is outvoted."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(x) for t in every for x in t]


def _bus_rate(fixed: float, nominal: float, ring: float, budget_s: float
              ) -> tuple[float, int]:
    """(bus bytes/s, sizes timed): the ``SIZES_MIB`` all-reduced in increasing order while
    they fit in ``budget_s`` at the rate seen so far (``nominal`` at first; every rank takes
    the same decision), each a warm-up and the median of 3; the least-squares slope of
    time on ring bytes is 1/bandwidth."""
    started = time.perf_counter()
    xs, ys = [], []
    rate = nominal
    for mib in SIZES_MIB:
        nbytes = int(mib * 2 ** 20)
        cost = 4 * (ring * nbytes / rate + fixed)  # warm-up + 3 repeats
        go = not xs or time.perf_counter() - started + cost <= budget_s
        if not agreed(float(go)):
            break
        t = torch.zeros(nbytes // 4)
        _timed_allreduce(t, 1)
        xs.append(ring * nbytes)
        ys.append(statistics.median(_timed_allreduce(t, 3)))
        rate = min(nominal, xs[-1] / max(ys[-1] - fixed, 1e-9))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx \
        if sxx > 0 else 0.0
    if slope <= 0:  # one size, or noise: the largest transfer's own rate
        slope = max((y - fixed) / x for x, y in zip(xs, ys, strict=True))
    return 1.0 / max(slope, 1e-12), len(xs)


def _big_rate(fixed: float, bus_bps: float, ring: float, budget_s: float) -> float:
    """Bus bytes/s of one ``BIG_MIB`` all-reduce over ``bus_bps`` (warm-up and 3 timed,
    median: of 2, one disturbed pass read 4 nodes at 10 Gbit/s at 0.56 against 0.81-1.02
    and priced DLRM's all-reduce 39% slow); 0 when 4 of them at ``bus_bps`` would not fit
    in ``budget_s`` (every rank takes the same decision)."""
    nbytes = int(BIG_MIB * 2 ** 20)
    if not agreed(float(4 * (ring * nbytes / bus_bps + fixed) <= budget_s)):
        return 0.0
    t = torch.zeros(nbytes // 4)
    _timed_allreduce(t, 1)
    took = max(statistics.median(_timed_allreduce(t, 3)) - fixed, 1e-9)
    return ring * nbytes / took / bus_bps


@dataclass
class _HalfRates:
    """The fp32, fp16 and bf16 all-reduces of the same bytes, each repeat's seconds. One
    pass of 5 rounds at 8 MiB read fp16's rate at 0.63-0.92 from probe to probe at 4 nodes
    and 10 Gbit/s, where 6 rounds each of 8 and 64 MiB, timed apart, read 0.59-0.66 and
    DLRM's fp16 ring ran at about 0.6: the probe takes them in two passes seconds apart
    (:meth:`take`), as it does its small operations, and takes the rates over both."""

    tensors: dict[torch.dtype, torch.Tensor]
    fixed: float
    samples: dict[torch.dtype, list[float]] = field(default_factory=dict)
    """Each dtype's seconds, both passes together (filled by :meth:`take`)."""

    @classmethod
    def sized(cls, fixed: float, budget_s: float, ring_bps: float) -> _HalfRates | None:
        """``HALF_MIB`` each or what ``HALF_FP32_ALLREDUCES`` all-reduces at ``ring_bps``
        (bytes/s of the buffer) fit in ``budget_s``, warmed up; None when the warm-up says
        the two passes would not fit after all (every rank takes the same decision)."""
        fits = int(ring_bps * budget_s / HALF_FP32_ALLREDUCES)
        # each rank measured its own rate
        nbytes = int(agreed(max(2 ** 16, min(int(HALF_MIB * 2 ** 20), fits)))) // 4 * 4
        tensors = {dt: torch.zeros(nbytes // torch.empty((), dtype=dt).element_size(),
                                   dtype=dt)
                   for dt in (torch.float32, torch.float16, torch.bfloat16)}
        t = time.perf_counter()
        for x in tensors.values():  # warm-up; its time tells whether the repeats fit
            dist.all_reduce(x)
        if not agreed(float(2 * HALF_ROUNDS * (time.perf_counter() - t) <= budget_s)):
            return None
        return cls(tensors, fixed)

    def take(self) -> None:
        """One pass: ``HALF_ROUNDS`` rounds of one all-reduce of each dtype."""
        for _ in range(HALF_ROUNDS):  # in rounds: load that comes and goes hits each alike
            for dt, x in self.tensors.items():
                self.samples.setdefault(dt, []).extend(_timed_allreduce(x, 1))

    def rates(self) -> tuple[float, float]:
        """(fp16, bf16) all-reduce bytes/s over fp32's: medians over both passes, less the
        one-element all-reduce's fixed cost."""
        took = {dt: max(statistics.median(ts) - self.fixed, 1e-9)
                for dt, ts in self.samples.items()}
        return (took[torch.float32] / took[torch.float16],
                took[torch.float32] / took[torch.bfloat16])


def _interference(fixed: float, bus_bps: float, ring: float, repeats: int = 3) -> float:
    """Share of an overlapped all-reduce's time that a compute loop running beside it
    loses: (loop under the all-reduce - loop alone) / the all-reduce's time alone, in
    [0, 1]. The all-reduce takes about ``INTERFERE_S``; the loop (``WORK_N`` matmuls) is
    sized to match. Where the wire bounds the transfer the CPU is free and the loop runs
    at full speed (about 0); where moving the bytes is CPU work on the same cores, the
    loop waits for it (about 1). Medians over ``repeats`` rounds of (loop alone,
    all-reduce alone, both at once)."""
    lo, hi = (int(m * 2 ** 20) for m in INTERFERE_MIB)
    nbytes = int(agreed(min(hi, max(lo, bus_bps * INTERFERE_S / ring)))) // 4 * 4
    buf = torch.zeros(nbytes // 4)
    a, b = torch.randn(WORK_N, WORK_N), torch.randn(WORK_N, WORK_N)

    def work(n: int) -> float:
        s = time.perf_counter()
        for _ in range(n):
            torch.mm(a, b)
        return time.perf_counter() - s

    _wait(dist.all_reduce(buf, async_op=True))  # warm-up
    per = work(16) / 16
    ring_s = ring * nbytes / bus_bps + fixed
    n = max(4, int(agreed(ring_s / max(per, 1e-7))))
    alone, comm, under = [], [], []
    for _ in range(repeats):
        dist.barrier()
        alone.append(work(n))
        dist.barrier()
        s = time.perf_counter()
        _wait(dist.all_reduce(buf, async_op=True))
        comm.append(time.perf_counter() - s)
        dist.barrier()
        handle = dist.all_reduce(buf, async_op=True)
        under.append(work(n))
        _wait(handle)
    return interference_share(statistics.median(alone), statistics.median(comm),
                              statistics.median(under))


def interference_share(alone_s: float, comm_s: float, under_s: float) -> float:
    """Share of an all-reduce's time (``comm_s``, alone) that a compute loop taking
    ``alone_s`` alone lost when it ran beside it (``under_s``), in [0, 1]."""
    return min(1.0, max(0.0, (under_s - alone_s) / max(comm_s, 1e-9)))


def _ping_pong(repeats: int) -> float:
    """Half a round trip of a one-element message between ranks 0 and 1 (others wait)."""
    rank = dist.get_rank()
    t = torch.zeros(1)
    times = []
    for _ in range(repeats):
        s = time.perf_counter()
        if rank == 0:
            _wait(dist.isend(t, 1))
            _wait(dist.irecv(t, 1))
        elif rank == 1:
            _wait(dist.irecv(t, 0))
            _wait(dist.isend(t, 0))
        times.append((time.perf_counter() - s) / 2)
    return statistics.median(times) if rank == 0 else 0.0


def _one_link(peer: int | None, nbytes: int, repeats: int) -> float:
    """Bytes/s of ``nbytes`` sent from rank 0 to ``peer`` (a rank on another node) while
    every other rank waits, the receipt acknowledged by one element (median of
    ``repeats`` after a warm-up; measured on rank 0, 0 elsewhere or without a peer). Every
    node moving bytes at once is what the all-reduces measure; on one host whose cores all
    the nodes share, one link alone runs faster: at 4 nodes on 2 cores and 10 Gbit/s,
    1.1 GB/s against 0.61-0.66 GB/s each with every node sending."""
    rank = dist.get_rank()
    if peer is None:
        return 0.0
    buf, ack = torch.zeros(nbytes // 4), torch.zeros(1)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        s = time.perf_counter()
        if rank == 0:
            _wait(dist.isend(buf, peer))
            _wait(dist.irecv(ack, peer))
        elif rank == peer:
            _wait(dist.irecv(buf, 0))
            _wait(dist.isend(ack, 0))
        if i:
            times.append(time.perf_counter() - s)
    return nbytes / max(statistics.median(times), 1e-9) if rank == 0 else 0.0


def link_disturbed(link: float, bus: float) -> bool:
    """Whether a link-alone reading (bytes/s; 0: not measured on this rank) is below
    ``LINK_BELOW_BUS`` of the bus rate ``bus``, which the ring's links carry."""
    return 0 < link < LINK_BELOW_BUS * bus


def settled_link(readings: list[float], bus: float) -> float:
    """The link-alone rate from its ``readings`` (the first, and any retimed after it read
    disturbed): the fastest, but not below the bus rate (0: not measured on this rank)."""
    best = max(readings, default=0.0)
    return max(best, bus) if best > 0 else 0.0


def _link_rate(peer: int | None, nbytes: int, bus: float) -> float:
    """:func:`_one_link`, timed again with twice the repeats where every rank agrees rank
    0's reading is disturbed (:func:`link_disturbed`), settled by :func:`settled_link`."""
    readings = [_one_link(peer, nbytes, LINK_REPEATS)]
    if agreed(float(link_disturbed(readings[0], bus)), dist.ReduceOp.MAX):
        readings.append(_one_link(peer, nbytes, 2 * LINK_REPEATS))
    return settled_link(readings, bus)


def _peer(spec: ResourceSpec) -> int | None:
    """The first rank on another node than rank 0's (ranks follow ``spec.replicas``)."""
    nodes = [d.split(":")[0] for d in spec.replicas]
    return next((r for r, n in enumerate(nodes) if n != nodes[0]), None)


def _queued_allreduce(repeats: int) -> list[float]:
    """Seconds of one ``QUEUED_KIB`` all-reduce among ``QUEUED`` launched back to back and
    waited for together, in each of ``repeats`` rounds (after a warm-up)."""
    bufs = [torch.zeros(QUEUED_KIB * 256) for _ in range(QUEUED)]

    def once() -> float:
        dist.barrier()
        s = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in bufs]
        for w in works:
            _wait(w)
        return (time.perf_counter() - s) / QUEUED

    once()
    return [once() for _ in range(repeats)]


def _chained_all_to_all(chain: int, repeats: int) -> list[float]:
    """Seconds of one tiny all-to-all (an int64 per peer) among chained ones: in each of
    ``repeats``, ``chain`` back to back, divided by ``chain``."""
    world = dist.get_world_size()
    src = torch.zeros(world, dtype=torch.int64)
    dst = torch.empty_like(src)
    dist.all_to_all_single(dst, src)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        s = time.perf_counter()
        for _ in range(chain):
            _wait(dist.all_to_all_single(dst, src, async_op=True))
        times.append((time.perf_counter() - s) / chain)
    return times


@dataclass(frozen=True)
class SparseSteps:
    """The runtime's sparse exchange as measured: a pull round's fixed seconds and its
    seconds per row asked, the push and update's fixed and per row, the closing round's."""

    round_s: float
    round_row_s: float
    push_s: float
    push_row_s: float
    closing_s: float = 0.0
    round_one_s: float = 0.0
    """A pull round's fixed seconds where the table has one owner (0: not measured)."""
    round_one_row_s: float = 0.0
    """Its seconds per row asked."""


def _sparse_step(chain: int, repeats: int, rows: int, one_owner: bool = False
                 ) -> tuple[list[float], list[float], int, list[float]]:
    """(seconds of one on-demand pull round among ``chain`` chained ones, seconds of the
    rest of the step after its closing round, rows this worker pushed, seconds of the
    closing round; each timed ``repeats`` times) of the runtime's own
    :class:`~stratagem.runtime.ps.sparse.SparseExchange` over the default group, every
    worker owning a piece of one table and asking ``rows`` rows of every other per round;
    ``one_owner``: rank 0 owns the whole table and every other worker asks it as many rows
    per round, ``rows`` times the other workers.

    The two layouts differ in more than their rows: with every worker both asking and
    serving, each exchange carries rows both ways at once, and where a worker has one core
    gloo's I/O thread spins while it waits for the worker's main thread (measured on the
    virtual cluster: 2.5-3 ms a round at 2 nodes against 1.1-1.3 with one owner, at 2 and
    at 1 Gbit/s; 0.85-0.9 of it at 4 nodes, two workers to a core).

    A round is what an embedding call of a parameter-server table costs in the forward:
    ids made unique and split by owner, counts and rows exchanged, the peers' ids served,
    the rows written. Two tiny all-to-alls chained cost less: each all-to-all of a round
    waits for every peer to finish its own work before it. The closing round is timed
    apart: the runtime runs it in the background while backward computes (``PSEngine.
    after_forward``). The rest of the step: the gradient rows stashed and pushed to their
    owners, the owner's sparse gradient built and applied."""
    from stratagem.runtime.ps.plan import PSPiece
    from stratagem.runtime.ps.sparse import SparseExchange
    from stratagem.runtime.stats import CommStats

    world, rank, dim = dist.get_world_size(), dist.get_rank(), 16
    per = 4 * chain * rows  # few repeats among a forward's lookups
    weight = nn.Parameter(torch.zeros(world * per, dim))
    if one_owner:
        pieces = [PSPiece(id=0, param="w", index=0, shape=(world * per, dim),
                          dtype="float32", owner=0, destination="w0", axis=0, start=0,
                          length=world * per, part=0, sparse=True)]
        asks = rows * (world - 1)
    else:
        pieces = [PSPiece(id=i, param="w", index=0, shape=(per, dim), dtype="float32",
                          owner=i, destination=f"w{i}", axis=0, start=i * per, length=per,
                          part=i, sparse=True) for i in range(world)]
        asks = rows
    shards = {p.id: torch.zeros(p.rows, dim) for p in pieces if p.owner == rank}
    sx = SparseExchange(pieces, _WorldGroup(), rank, world,  # type: ignore[arg-type]
                        {"w": weight}, shards, CommStats())
    gen = torch.Generator().manual_seed(rank)
    lookups = [torch.cat([torch.randint(p.row_start, p.row_start + p.rows, (asks,),
                                        generator=gen) for p in pieces])
               for _ in range(chain)]
    touched = torch.unique(torch.cat(lookups))
    grad = torch.zeros(len(touched), dim)
    pushed = len(touched) - sum(
        int(((touched >= p.row_start) & (touched < p.row_start + p.rows)).sum())
        for p in pieces if p.owner == rank)

    def forward() -> None:
        sx.begin_pulls()
        for ids in lookups:
            uniq = torch.unique(ids)
            sx.pull_round({i: sx.not_yet_asked(
                i, uniq[(uniq >= p.row_start) & (uniq < p.row_start + p.rows)])
                for i, p in enumerate(pieces)})

    def closing() -> None:
        while not sx.pull_round(None):
            pass

    def rest() -> None:
        sx.stash_grad(pieces, touched, grad)
        sx.push()
        if sx.attach_grads():  # the update: plain SGD, the least an optimizer does
            for shard in shards.values():
                if shard.grad is not None:
                    shard.add_(shard.grad, alpha=-0.0)
        sx.clear()

    forward()  # warm-up (and each round's agreed capacity)
    closing()
    rest()
    rounds, closings, rests = [], [], []
    for _ in range(repeats):
        dist.barrier()
        s = time.perf_counter()
        forward()
        t = time.perf_counter()
        closing()
        c = time.perf_counter()
        rest()
        rounds.append((t - s) / chain)
        closings.append(c - t)
        rests.append(time.perf_counter() - c)
    return rounds, rests, pushed, closings


def _steady(times: list[float]) -> float:
    """Mean of ``times`` less the ``TRIM`` shortest and longest (all of them when that
    would leave none): what a part costs a step on average when its waits are bimodal,
    without the rare pass a peer was descheduled through."""
    xs = sorted(times)
    if len(xs) > 2 * TRIM:
        xs = xs[TRIM:len(xs) - TRIM]
    return statistics.fmean(xs)


@dataclass
class _SmallOps:
    """The probe's readings of small operations, each repeat's seconds: the queued
    all-reduces' rounds, the chained all-to-alls', and the sparse step's parts (rounds,
    rests, closings) with few rows and with many. Their stalls come in spells seconds
    long, so the probe takes them in two passes apart (:meth:`take`) and averages all."""

    few: int
    many: int
    queued: list[float] = field(default_factory=list)
    chained: list[float] = field(default_factory=list)
    steps: dict[int, tuple[list[float], list[float], int, list[float]]] = field(
        default_factory=dict)
    ones: dict[int, list[float]] = field(default_factory=dict)
    """Pull rounds where the table has one owner, by rows asked per peer
    (:func:`_sparse_step`)."""
    pings: list[float] = field(default_factory=list)
    """Each pass's median one-way message time (:func:`_ping_pong`; rank 0's, 0 on the
    other ranks)."""

    @classmethod
    def rows(cls, bus_bps: float) -> _SmallOps:
        """Empty, with the rows asked per peer: few, and as many as take
        ``ROUND_WIRE_S`` on the link at ``bus_bps``, at most ``ROUND_ROWS[1]`` in all and
        4 times the few at least (agreed among the ranks)."""
        world, few = dist.get_world_size(), ROUND_ROWS[0]
        wire = bus_bps * ROUND_WIRE_S / (ROW_BYTES * (world - 1))
        many = int(agreed(max(4 * few, min(ROUND_ROWS[1] // (world - 1), wire))))
        return cls(few, many)

    def take(self) -> None:
        """One pass: ``TINY_REPEATS`` ping-pongs, ``QUEUED_REPEATS`` rounds of queued
        all-reduces, ``CHAIN_REPEATS`` of chained all-to-alls, ``SPARSE_REPEATS`` sparse
        steps with each row count, and as many with one owner."""
        self.pings.append(_ping_pong(TINY_REPEATS))
        self.queued += _queued_allreduce(QUEUED_REPEATS)
        self.chained += _chained_all_to_all(CHAIN, CHAIN_REPEATS)
        for n in (self.few, self.many):
            rounds, rests, pushed, closings = _sparse_step(CHAIN, SPARSE_REPEATS, n)
            r0, p0, _, c0 = self.steps.get(n, ([], [], 0, []))
            self.steps[n] = (r0 + rounds, p0 + rests, pushed, c0 + closings)
            self.ones[n] = self.ones.get(n, []) + _sparse_step(
                CHAIN, SPARSE_REPEATS, n, one_owner=True)[0]

    def message_s(self) -> float:
        """A message's own cost: the faster pass's median. A whole pass's ping-pongs can
        fall in a stall (one probe of the 28 in each of the last four benchmark runs read
        0.5-2 ms against 40-70 us, and priced cnn's PS at 4 nodes 40% slow at its 24
        messages a step); the messages a step sends are priced at their own cost, and
        the stalls a step meets are in its measured rounds."""
        return min(self.pings, default=0.0)

    def sparse(self, bus_bps: float) -> SparseSteps:
        """The sparse exchange's fixed costs and slopes per row (:func:`fit_sparse`; the
        slopes less their wire time at ``bus_bps``, priced on the links apart)."""
        def at(n: int) -> tuple[int, float, float, int]:
            rounds, rests, pushed, _ = self.steps[n]
            return n, _steady(rounds), _steady(rests), pushed

        world, wire = dist.get_world_size(), ROW_BYTES / bus_bps
        fit = fit_sparse(world, wire, at(self.few), at(self.many))
        # one owner: its askers ask as many rows as in the shared rounds (no push fitted);
        # the owner's link carries every asker's rows, (world - 1) per row asked
        one = fit_sparse(world, wire * (world - 1),
                         (self.few, _steady(self.ones[self.few]), 0.0, 0),
                         (self.many, _steady(self.ones[self.many]), 0.0, 0))
        # the closing round asks nothing in either: readings of one cost
        return replace(fit, round_one_s=one.round_s, round_one_row_s=one.round_row_s,
                       closing_s=_steady(self.steps[self.few][3] + self.steps[self.many][3]))


def fit_sparse(world: int, wire: float, few: tuple[int, float, float, int],
               many: tuple[int, float, float, int]) -> SparseSteps:
    """The fixed costs and per-row slopes of a pull round and of the rest of a sparse
    step from two measurements, ``(rows asked per peer, round s, rest s, rows pushed)``
    with few rows and with many; ``wire``: one row's seconds on the link (taken off the
    slopes)."""
    few_rows, r0, p0, n0 = few
    many_rows, r1, p1, n1 = many
    round_row = max(0.0, (r1 - r0) / ((world - 1) * (many_rows - few_rows)) - wire)
    push_row = max(0.0, (p1 - p0) / max(n1 - n0, 1) - wire)
    # More rows never cost less: where the many rows' step measured faster than the few
    # rows' (noise), its time bounds the fixed cost too (the smaller of the two estimates).
    # At 2 nodes and 10 Gbit/s the few rows' push read 0.8-3.9 ms from run to run.
    return SparseSteps(
        round_s=max(0.0, min(r0 - round_row * (world - 1) * few_rows,
                             r1 - round_row * (world - 1) * many_rows)),
        round_row_s=round_row,
        push_s=max(0.0, min(p0 - push_row * n0, p1 - push_row * n1)), push_row_s=push_row)


class _Clock:
    """Seconds spent in each named phase, added up (a phase may come back)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._spent: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Charge the seconds since the last mark to ``phase``."""
        now = time.perf_counter()
        self._spent[phase] = self._spent.get(phase, 0.0) + now - self._last
        self._last = now

    def parts(self) -> tuple[tuple[str, float], ...]:
        """Rank 0's seconds by phase, on every rank (every rank plans with one probe)."""
        spent = torch.tensor(list(self._spent.values()), dtype=torch.float64)
        dist.broadcast(spent, 0)
        return tuple(zip(self._spent, (float(x) for x in spent), strict=True))


def probe_links(spec: ResourceSpec, use_cache: bool = True) -> LinkProbe | None:
    """Measure the links among the job's workers (call on every worker at once); None
    when no process group spans exactly the spec's workers."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world != spec.num_workers or world < 2:
        return None
    nodes = tuple((n.address, n.network_bandwidth, n.workers) for n in spec.nodes)
    key = (nodes, world)
    if use_cache and key in _LINKS:
        return _LINKS[key]
    started = time.perf_counter()
    clock = _Clock()
    multi = len(spec.nodes) > 1
    nominal = (min(n.network_bandwidth for n in spec.nodes) * GBIT_BYTES * LINK_EFFICIENCY
               if multi else 40.0 * GBIT_BYTES)
    ring = 2 * (world - 1) / world
    dist.barrier()
    # the runtime's waits on the default group yield gloo's I/O threads; the probe's too
    _WAITS[0] = Yielding(unclaimed_loops())
    tiny = torch.zeros(1)
    _timed_allreduce(tiny, 3)  # warm-up: connections, allocator
    fixed = statistics.median(_timed_allreduce(tiny, TINY_REPEATS))
    clock.mark("collective")
    budget = PROBE_BUDGET_S * 0.8
    bus, sizes = _bus_rate(fixed, nominal, ring, budget - (time.perf_counter() - started))
    if multi and agreed(float(bus < SUSPECT_RATE * nominal), dist.ReduceOp.MAX):
        again, more = _bus_rate(fixed, nominal, ring, budget)
        if again > bus:
            bus, sizes = again, more
    clock.mark("bus")
    big_rate = _big_rate(fixed, bus, ring, PROBE_BUDGET_S - (time.perf_counter() - started)) \
        if agreed(float(sizes == len(SIZES_MIB))) else 0.0
    clock.mark("big")
    half = _HalfRates.sized(
        fixed, max(HALF_BUDGET_S, PROBE_BUDGET_S - (time.perf_counter() - started)),
        bus / ring)
    if half is not None:
        half.take()
    clock.mark("half")
    small = _SmallOps.rows(bus)
    small.take()
    clock.mark("small")
    interference = _interference(fixed, bus, ring)
    clock.mark("interference")
    link_bytes = int(agreed(min(LINK_MIB * 2 ** 20, max(2 ** 20, bus * LINK_S)))) // 4 * 4
    link = _link_rate(_peer(spec), link_bytes, bus)
    clock.mark("link")
    small.take()  # the second passes, seconds after the first
    clock.mark("small")
    fp16_rate, bf16_rate = (0.0, 0.0)
    if half is not None:
        half.take()
        fp16_rate, bf16_rate = half.rates()
    clock.mark("half")
    queued = max(fixed, _steady(small.queued))
    group_fixed = max(fixed, queued - ring * QUEUED_KIB * 1024 / bus)
    chained = _steady(small.chained)
    sp = small.sparse(bus)
    message = small.message_s()
    figures = torch.tensor([fixed, bus, message * world, chained, sp.round_s,
                            sp.round_row_s, sp.push_s, sp.push_row_s, fp16_rate, bf16_rate,
                            big_rate, group_fixed, interference, link * world, sp.closing_s,
                            queued, sp.round_one_s, sp.round_one_row_s],
                           dtype=torch.float64)
    dist.all_reduce(figures)
    figures /= world  # the ranks' mean (the message and the one link: rank 0's measure)
    probe = LinkProbe(world=world, collective_s=float(figures[0]), bus_bps=float(figures[1]),
                      message_s=float(figures[2]), seconds=time.perf_counter() - started,
                      nominal_bps=nominal, all_to_all_s=float(figures[3]),
                      pull_round_s=float(figures[4]), pull_row_s=float(figures[5]),
                      sparse_push_s=float(figures[6]), push_row_s=float(figures[7]),
                      fp16_rate=float(figures[8]), bf16_rate=float(figures[9]),
                      big_rate=float(figures[10]), group_fixed_s=float(figures[11]),
                      interference=float(figures[12]), link_bps=float(figures[13]),
                      closing_s=float(figures[14]), group_period_s=float(figures[15]),
                      pull_round_one_s=float(figures[16]),
                      pull_row_one_s=float(figures[17]), parts=clock.parts())
    if use_cache:
        _LINKS[key] = probe
    return probe
