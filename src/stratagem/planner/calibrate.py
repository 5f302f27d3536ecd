"""Calibration: what one training step of this model costs on this machine, in seconds.

A few forward/backward passes on a sample batch, with hooks: the forward time of every
leaf module, the moment each parameter's gradient is ready (``post_accumulate_grad``
hooks, seconds after backward starts), the optimizer-sized update pass, and for every
parameter the rows its gradient touches (non-zero rows; a sparse gradient's indices) --
how sparse access is *found*, not declared. Running the same on half of the batch tells how
the touched rows grow with the batch (the overlap between workers' batches).

Without a sample batch, :func:`estimate` derives the same fields from the profile alone
(2 FLOPs per value per sample forward, twice that backward, at a measured matmul rate).
Results are cached per (model signature, batch size, input shapes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.analysis.profile import AccessStats, ModelProfile, analyze
from stratagem.errors import StratagemError
from stratagem.planner.probe import (
    agreed,
    gathered,
    measured_once,
    owner_piece_cost,
    runtime_costs,
)

WARMUP = 1
STEPS = 3
MORE_STEPS = 4
"""Passes added, one at a time, while the timed passes disagree (``STEADY``)..."""
STEADY = 1.25
"""...: the slowest pass's forward and backward over the fastest's, on any rank. A median
of three passes read a CNN's forward and backward at 55 and 66 ms on 4 nodes sharing 2
cores, where other runs read 27-36 and 37-44 and its training steps' forward took 32."""
MIN_TIMED_S = 0.05
MAX_PASSES = 30
"""Short passes are repeated until ``MIN_TIMED_S`` of them are timed (at most
``MAX_PASSES``): three of DLRM's 2 ms passes are a 6 ms window that one disturbance covers
whole, and once read its forward + backward at 1.24 + 1.95 ms at 2 nodes, against
0.50-0.68 + 0.96-1.05 in every other run and its training steps' 0.7 ms forward."""
SPARSE_DENSITY = 0.5
"""A parameter whose gradient touches fewer than this share of its rows is row-sparse."""

_CACHE: dict[tuple, Calibration] = {}
_RATES: dict[bool, dict[str, list[float]]] = {}  # machine rates' runs: by together, name


@dataclass(frozen=True)
class Calibration:
    """Measured (or estimated) costs of one step at ``batch_size`` samples per worker."""

    batch_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    grad_ready_s: dict[str, float]
    layer_forward_s: dict[str, float] = field(default_factory=dict)
    access: tuple[AccessStats, ...] = ()
    copy_bps: float = 2e9
    """Bytes/s of casting fp32 to fp16 and back (12 bytes an element), as a compressor's
    casts run on a large group: past the caches, every rank at once."""
    flops: float = 1e10
    measured: bool = True
    seconds: float = 0.0
    tensor_s: float = 0.0
    """The runtime's own seconds per all-reduced tensor (hook, copy in and out)."""
    group_s: float = 0.0
    """The runtime's own seconds per all-reduce group (buffer, launch, wait)."""
    scan_bps: float = 4e9
    """Bytes/s of finding a dense gradient's non-zero rows (what the runtime does for a
    parameter sent as rows though declared dense): CPU work, scaled by ``cpu_share``."""
    piece_s: float = 0.0
    """An owner's own seconds per dense PS piece it owns (the shard's gradient, update,
    clearing, value out), beyond the bytes."""
    cpu_share: float = 1.0
    """Wall seconds per CPU second of a rank's compute while every rank computes (the
    median over the timed passes; 1 at least, and on a GPU): 2 where two ranks share
    each core. ``tensor_s``, ``group_s`` and ``piece_s`` are CPU seconds scaled by it,
    ``scan_bps`` a CPU rate divided by it."""
    update_bps: float = 0.0
    """Parameter bytes/s of an SGD-sized update pass over the parameters (0: not known;
    ``optimizer_s`` then covers the whole model). A strategy's update and the densifying
    of sparse gradients it all-reduces are priced per byte with it."""

    def update_s(self, nbytes: float, total_bytes: float) -> float:
        """Seconds of a dense update of ``nbytes`` parameter bytes."""
        if self.update_bps > 0:
            return nbytes / self.update_bps
        return self.optimizer_s * min(1.0, nbytes / max(total_bytes, 1.0))

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def access_of(self, name: str) -> AccessStats | None:
        return next((a for a in self.access if a.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "forward_s": self.forward_s,
                "backward_s": self.backward_s, "optimizer_s": self.optimizer_s,
                "measured": self.measured, "seconds": self.seconds,
                "copy_bps": self.copy_bps, "flops": self.flops,
                "tensor_s": self.tensor_s, "group_s": self.group_s,
                "scan_bps": self.scan_bps, "update_bps": self.update_bps,
                "cpu_share": self.cpu_share, "piece_s": self.piece_s,
                "access": [a.to_dict() for a in self.access]}


RATE_REPEATS = 5  # timed runs of each machine rate, per process


def machine_rates(together: bool = False) -> tuple[float, float]:
    """(copy bytes/s, matmul FLOP/s): medians of this process's timed runs (measured once,
    a few ms) or, ``together`` (every worker of the default process group calls it at
    once), of every rank's, timed at once (:func:`~stratagem.planner.probe.measured_once`).
    One process's three copies once read 96 GB/s against 24 GB/s in the next run and
    priced fp16's casts 4x cheap."""
    return _rate("copy", together), _rate("flops", together)


def scan_rate(together: bool = False) -> float:
    """Bytes per CPU second of ``nonzero(grad.any(dim=1))`` over a dense gradient, as
    :func:`machine_rates`. CPU time, not wall time: the runtime scans during backward,
    while the other ranks on its core compute, but ranks that each scan 16 MiB after a
    barrier mostly took turns (4 ranks on 2 cores read 7.4-8.1 GB/s in wall time, one
    alone 8.4, two pinned to one core scanning 100 MiB at once 4.2 each; the LSTM LM's
    102 MB output layer took 22 ms to scan in training, priced at 13). Calibration scales
    it by what a CPU second costs while every rank computes (``Calibration.cpu_share``).
    The fastest reading, not the median: the CPU seconds themselves grew where ranks on
    one core scanned at once (two ranks pinned to one core: 4.9-5.3 GB/s in some runs,
    7.9-8.2 in others; a scan beside the other rank's compute ran at 4.1-4.3 in wall time
    in all of them, what the fastest reading over the share prices)."""
    return _rate("scan", together, pick=max)


def _rate(name: str, together: bool,
          pick: Callable[[list[float]], float] | None = None) -> float:
    """``pick`` (the median when None) of the samples of machine rate ``name``."""
    samples = measured_once(_RATES, together, _time_rates)[name]
    return (pick or _median)(gathered(samples) if together else samples)


CAST_MIB = 64
"""The fp32 buffer cast to fp16 and back for the copy rate: past the caches, as a large
group's buffer is (on this machine's 32 MiB L3 a 16 MiB cast alone read 45-127 GB/s, one
of 64 MiB in and back 23 GB/s, 13-16 GB/s with 4 ranks on 2 cores casting at once; priced
at the 16 MiB rate, DLRM's fp16 casts cost 3 ms where they took 8-12)."""


def _time_rates(sync: Callable[[], Any]) -> dict[str, list[float]]:
    """Timed runs of a ``CAST_MIB`` fp32-to-fp16 cast and back (what the fp16 compressor
    does to a group), a 256x256 matmul and a row scan of that buffer as a gradient of
    128-wide rows, none touched (its CPU seconds: :func:`scan_rate`), ``RATE_REPEATS``
    rounds of each, ``sync`` before each."""
    x = torch.zeros(CAST_MIB * 2 ** 18)
    y = torch.empty(x.numel(), dtype=torch.float16)
    a = torch.randn(256, 256)
    g = x.view(-1, 128)  # zeros again after each cast back

    def cast() -> None:
        y.copy_(x)
        x.copy_(y)

    wall, cpu = time.perf_counter, time.process_time
    work = {"copy": (cast, x.numel() * 12, wall),
            "flops": (lambda: a @ a, 2 * 256 ** 3, wall),
            "scan": (lambda: torch.nonzero(g.any(dim=1)), g.numel() * 4, cpu)}
    for run, *_ in work.values():  # warm-up
        run()
    samples: dict[str, list[float]] = {k: [] for k in work}
    for _ in range(RATE_REPEATS):
        for k, (run, amount, now) in work.items():
            sync()
            t = now()
            run()
            samples[k].append(amount / max(now() - t, 1e-9))
    return samples


def signature(model: nn.Module) -> tuple:
    """What identifies a model for the cache: its class and its parameters' shapes, dtypes
    and devices (the same model on a GPU runs a pass in a fraction of the CPU's time)."""
    return (type(model).__qualname__,
            tuple((n, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
                  for n, p in model.named_parameters()))


def _shapes(sample: Any) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (tuple(sample.shape), str(sample.dtype), str(sample.device))
    if isinstance(sample, (tuple, list)):
        return tuple(_shapes(s) for s in sample)
    if isinstance(sample, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(sample.items()))
    return (type(sample).__name__,)


def _batch_size(sample: Any) -> int:
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[0]) if sample.dim() else 1
    items = sample.values() if isinstance(sample, dict) else sample
    if isinstance(items, (tuple, list)) or isinstance(sample, dict):
        for s in items:
            if isinstance(s, torch.Tensor) and s.dim():
                return int(s.shape[0])
    raise StratagemError("cannot tell the batch size of the sample input",
                         where="planner.calibrate",
                         fix="pass a tensor, or a tuple/dict whose first tensor is batched")


def _half(sample: Any, n: int) -> Any:
    """The first half of every tensor batched along dim 0 with ``n`` rows."""
    if isinstance(sample, torch.Tensor):
        return sample[: n // 2] if sample.dim() and sample.shape[0] == n else sample
    if isinstance(sample, tuple):
        return tuple(_half(s, n) for s in sample)
    if isinstance(sample, list):
        return [_half(s, n) for s in sample]
    if isinstance(sample, dict):
        return {k: _half(v, n) for k, v in sample.items()}
    return sample


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model`` applied to a sample batch: a dict as keywords, a tuple/list as arguments."""
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def default_loss(out: Any) -> torch.Tensor:
    """Sum of every floating tensor in the output: touches what a real loss touches."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    items = out.values() if isinstance(out, dict) else out
    total = None
    for t in items:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            total = t.sum() if total is None else total + t.sum()
    if total is None:
        raise StratagemError("the model's output has no floating-point tensor to sum",
                             where="planner.calibrate",
                             fix="pass loss_fn=lambda out: ... returning a scalar loss")
    return total


def _touched_rows(grad: torch.Tensor | None) -> int | None:
    if grad is None:
        return None
    if grad.is_sparse:
        return int(torch.unique(grad.coalesce().indices()[0]).numel())
    if grad.dim() == 0:
        return 1
    return int(grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).sum())


def _lookups(model: nn.Module, names: dict[int, str]) -> tuple[list[Any], dict[str, list]]:
    """Forward pre-hooks on embedding modules recording the ids they look up."""
    ids: dict[str, list[torch.Tensor]] = {}
    handles = []
    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            name = names.get(id(mod.weight))
            if name is None:
                continue

            def pre(_m: nn.Module, args: tuple, name: str = name) -> None:
                if args and isinstance(args[0], torch.Tensor):
                    ids.setdefault(name, []).append(args[0].detach().reshape(-1))

            handles.append(mod.register_forward_pre_hook(pre))
    return handles, ids


def clock(model: nn.Module) -> Callable[[], float]:
    """``time.perf_counter`` for a CPU model; for one with CUDA parameters, the same after
    ``torch.cuda.synchronize()`` (kernels run asynchronously: without it a pass would be
    timed as the seconds its kernels took to launch)."""
    devices = {p.device for p in model.parameters() if p.is_cuda}
    if not devices:
        return time.perf_counter

    def synchronized() -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        return time.perf_counter()

    return synchronized


def _one_pass(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor],
              params: dict[str, nn.Parameter], timed: bool
              ) -> tuple[float, float, dict[str, float], dict[str, float], dict[str, int]]:
    """(forward s, backward s, grad ready s by name, leaf forward s, touched rows)."""
    now = clock(model)
    for p in params.values():
        p.grad = None
    layer: dict[str, float] = {}
    starts: dict[int, float] = {}
    handles = []
    if timed:
        for mname, mod in model.named_modules():
            if next(mod.children(), None) is not None:
                continue

            def pre(m: nn.Module, _a: tuple) -> None:
                starts[id(m)] = now()

            def post(m: nn.Module, _a: tuple, _o: Any, mname: str = mname) -> None:
                layer[mname] = layer.get(mname, 0.0) + now() - starts[id(m)]

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    ready: dict[str, float] = {}
    t_back = [0.0]
    for name, p in params.items():
        def hook(_p: torch.Tensor, name: str = name) -> None:
            ready[name] = now() - t_back[0]

        handles.append(p.register_post_accumulate_grad_hook(hook))
    try:
        t0 = now()
        out = call_model(model, sample)
        loss = loss_fn(out)
        t1 = now()
        t_back[0] = t1
        loss.backward()
        t2 = now()
    finally:
        for h in handles:
            h.remove()
    touched = {n: r for n, p in params.items() if (r := _touched_rows(p.grad)) is not None}
    return t1 - t0, t2 - t1, ready, layer, touched


def _half_pass(model: nn.Module, sample: Any, batch: int,
               loss_fn: Callable[[Any], torch.Tensor], params: dict[str, nn.Parameter],
               touched: dict[str, int]) -> dict[str, int]:
    """Touched rows on half of the batch; the full batch's when halving does not make a
    valid input for this model (then no growth with the batch is assumed: overlap 0)."""
    if batch < 2:
        return touched
    try:
        return _one_pass(model, _half(sample, batch), loss_fn, params, timed=False)[4]
    except (RuntimeError, ValueError, IndexError, TypeError):
        return touched


@torch.no_grad()
def _update_pass(params: dict[str, nn.Parameter], now: Callable[[], float] = time.perf_counter
                 ) -> tuple[float, int]:
    """(seconds, parameter bytes) of one pass the size of an SGD update over every
    parameter (each adds 0 times itself: the memory traffic of adding its gradient,
    whether or not a gradient is there)."""
    nbytes = 0
    t = now()
    for p in params.values():
        p.add_(p, alpha=0.0)
        nbytes += p.numel() * p.element_size()
    return now() - t, nbytes


def _passes_for(pass_s: float, steps: int, together: bool) -> int:
    """Timed passes to take when the first took ``pass_s``: ``steps``, or as many as fill
    ``MIN_TIMED_S`` (at most ``MAX_PASSES``); ``together``, the most any rank needs (every
    rank takes as many)."""
    n = max(steps, min(MAX_PASSES, math.ceil(MIN_TIMED_S / max(pass_s, 1e-9))))
    return int(agreed(float(n), dist.ReduceOp.MAX)) if together else n


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if s else 0.0


def _pooled(fw: list[float], bw: list[float], together: bool) -> tuple[float, float]:
    """Median forward and backward seconds over every rank's timed passes (``together``:
    each rank timed as many), else over this rank's: a rank disturbed while it timed its
    passes does not set its own plan apart, and every rank plans from the same compute."""
    if not together:
        return _median(fw), _median(bw)
    return _median(gathered(fw)), _median(gathered(bw))


def _cached_everywhere(key: tuple, together: bool) -> bool:
    """Whether ``key`` is cached here and, ``together``, on every rank (else all measure
    again, so that their passes stay in step)."""
    have = key in _CACHE
    if not together:
        return have
    flag = torch.tensor([int(have)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def calibrate(model: nn.Module, sample_input: Any, *,
              loss_fn: Callable[[Any], torch.Tensor] | None = None, steps: int = STEPS,
              use_cache: bool = True, together: bool = False) -> Calibration:
    """Measure ``model`` on ``sample_input`` (one worker's batch): forward, backward and
    update times, when each gradient is ready, and each parameter's touched rows.

    ``together`` (every worker of the default process group calls it at once): each pass
    starts after a barrier, so that compute is timed as training runs it, every worker
    computing at the same time -- four workers sharing two cores computed a DLRM forward
    2.5x slower in their steps than each had alone. The forward and backward times are
    then the medians over every rank's passes, the same on every rank. Short passes are
    repeated to fill ``MIN_TIMED_S``, and passes are added (``MORE_STEPS`` at most) while
    the slowest and fastest differ by more than ``STEADY``.

    The model's parameters and gradients are left as they were (values are not updated;
    gradients are cleared)."""
    batch = _batch_size(sample_input)
    key = (signature(model), batch, _shapes(sample_input))
    if use_cache and _cached_everywhere(key, together):
        return _CACHE[key]
    sync = dist.barrier if together else (lambda: None)
    started = time.perf_counter()
    loss_fn = loss_fn or default_loss
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in params.items()}
    saved = {n: p.grad for n, p in params.items()}
    was_training = model.training
    model.train()
    fw, bw, ready_all, layer_all = [], [], [], []
    shares: list[float] = []  # each timed pass's wall seconds per CPU second
    hooks, ids = _lookups(model, names)
    need = steps
    try:
        i = 0
        while True:
            ids.clear()
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            f, b, ready, layer, touched = _one_pass(model, sample_input, loss_fn, params,
                                                    timed=i >= WARMUP)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            i += 1
            if i <= WARMUP:
                continue
            shares.append(wall / max(cpu, 1e-9))
            fw.append(f)
            bw.append(b)
            ready_all.append(ready)
            layer_all.append(layer)
            if len(fw) == 1:
                need = _passes_for(f + b, steps, together)
            if len(fw) < need:
                continue
            totals = [x + y for x, y in zip(fw, bw, strict=True)]
            spread = max(totals) / max(min(totals), 1e-12)
            if together:  # every rank adds a pass, or none
                spread = agreed(spread, dist.ReduceOp.MAX)
            if len(fw) >= need + MORE_STEPS or spread <= STEADY:
                break
        lookups = {n: torch.cat(v) for n, v in ids.items()}  # the last pass's
        calls = {n: len(v) for n, v in ids.items()}
        for h in hooks:
            h.remove()
        hooks = []
        touched_half = _half_pass(model, sample_input, batch, loss_fn, params, touched)
        passes = []
        for _ in range(steps):
            sync()
            passes.append(_update_pass(params, clock(model)))
        pass_s, update_bytes = _median([t for t, _ in passes]), passes[0][1]
        update_bps = update_bytes / pass_s if update_bytes and pass_s > 0 else 0.0
        opt_s = analyze(model).dense_bytes / update_bps if update_bps else 0.0
    finally:
        for h in hooks:
            h.remove()
        for n, p in params.items():
            p.grad = saved[n]
        model.train(was_training)
    access = []
    for n, p in params.items():
        if n not in touched or p.dim() == 0:
            continue
        rows = int(p.shape[0])
        full, halfr = touched[n], touched_half.get(n, touched[n])
        overlap = (min(1.0, max(0.0, math.log2(full / halfr)))
                   if halfr and full > halfr else 0.0)
        hot = 0.0
        if n in lookups and lookups[n].numel():
            counts = torch.bincount(lookups[n].long()).sort(descending=True).values
            top = max(1, math.ceil(0.01 * int((counts > 0).sum())))
            hot = float(counts[:top].sum()) / float(counts.sum())
        access.append(AccessStats(name=n, rows=rows, rows_touched=float(full),
                                  overlap=overlap, hot_share=hot, calls=calls.get(n, 1)))
    copy_bps, flops = machine_rates(together)
    # the runtime's per-tensor work is CPU work: it costs what the CPU second of compute
    # costs in wall time while every rank computes
    share = max(1.0, _median(gathered(shares) if together else shares)) \
        if all(p.device.type == "cpu" for p in params.values()) else 1.0
    tensor_s, group_s = (share * x for x in runtime_costs(together))
    piece_s = share * owner_piece_cost(together)
    forward_s, backward_s = _pooled(fw, bw, together)
    # this rank's timeline, stretched to the pooled times
    own_f, own_b = _median(fw), _median(bw)
    f_scale = forward_s / own_f if own_f > 0 else 1.0
    b_scale = backward_s / own_b if own_b > 0 else 1.0
    ready = {n: b_scale * _median([r[n] for r in ready_all if n in r]) for n in params
             if any(n in r for r in ready_all)}
    layers = {m: f_scale * _median([lay.get(m, 0.0) for lay in layer_all])
              for m in layer_all[0]} if layer_all else {}
    cal = Calibration(batch_size=batch, forward_s=forward_s, backward_s=backward_s,
                      optimizer_s=opt_s, grad_ready_s=ready, layer_forward_s=layers,
                      access=tuple(access), copy_bps=copy_bps, flops=flops, measured=True,
                      seconds=time.perf_counter() - started, tensor_s=tensor_s,
                      group_s=group_s, scan_bps=scan_rate(together) / share,
                      update_bps=update_bps, cpu_share=share, piece_s=piece_s)
    if use_cache:
        _CACHE[key] = cal
    return cal


NOMINAL_COPY_BPS = 2e9
NOMINAL_FLOPS = 1e10
NOMINAL_TENSOR_S = 40e-6
NOMINAL_GROUP_S = 20e-6
NOMINAL_PIECE_S = 60e-6
NOMINAL_SCAN_BPS = 4e9
"""Rates of :func:`estimate`: fixed, so that every rank plans the same strategy from the
same profile (a 2-core CPU's order of magnitude; calibration measures the real ones)."""


def estimate(profile: ModelProfile, batch_size: int) -> Calibration:
    """Costs from the profile alone (no sample batch): 2 FLOPs per value and sample
    forward (embedding tables: one row per sample), twice that backward, gradients ready
    in reverse registration order; row access of untied embeddings: one row per sample.
    Deterministic: nominal rates, nothing measured."""
    copy_bps, flops = NOMINAL_COPY_BPS, NOMINAL_FLOPS
    work = []
    for p in profile.params:
        row = p.numel // p.shape[0] if p.shape and p.shape[0] else 1
        per_sample = 2 * row if p.embedding_like else 2 * p.numel
        work.append(per_sample * batch_size)
    forward = sum(work) / flops
    backward = 2 * forward
    ready, t = {}, 0.0
    for p, w in zip(reversed(profile.params), reversed(work), strict=True):
        t += 2 * w / flops
        ready[p.name] = t
    access = tuple(AccessStats(name=p.name, rows=p.shape[0],
                               rows_touched=float(min(p.shape[0], batch_size)))
                   for p in profile.params
                   if p.shape and (p.sparse or (p.embedding_like and not p.aliases)))
    return Calibration(batch_size=batch_size, forward_s=forward, backward_s=backward,
                       optimizer_s=profile.total_bytes / copy_bps, grad_ready_s=ready,
                       access=access, copy_bps=copy_bps, flops=flops, measured=False,
                       tensor_s=NOMINAL_TENSOR_S, group_s=NOMINAL_GROUP_S,
                       piece_s=NOMINAL_PIECE_S,
                       scan_bps=NOMINAL_SCAN_BPS, update_bps=copy_bps)


def profile_with_access(model: nn.Module, calibration: Calibration) -> ModelProfile:
    """The model's profile carrying the measured access statistics."""
    return analyze(model).with_access(calibration.access)


def row_sparse(stats: AccessStats | None) -> bool:
    """Whether measured access makes a parameter a row-sparse candidate."""
    return stats is not None and stats.rows >= 2 and stats.density < SPARSE_DENSITY
