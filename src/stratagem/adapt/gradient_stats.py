"""Gradient statistics for the noise scale, taken from the runtime's own gradient traffic.

Per optimizer step :class:`GradStats` feeds one update into a
:class:`~stratagem.adapt.noise_scale.GradientNoiseScale`, choosing the cheapest unbiased source:

* several replicas, no accumulation: the squared norm of each replica's gradient, taken
  from the fused all-reduce buffers right before their collective (a runtime *gradient
  observer*, one dot per buffer), summed over replicas with one tiny all-reduce that runs
  while the optimizer steps; and the squared norm of the averaged gradient, from the same
  buffers after the collective;
* gradient accumulation (any number of replicas): the squared norm of the first
  micro-batch's gradient (before anything else accumulates into it) against that of the
  whole step's averaged gradient; no extra copies;
* one replica without accumulation, or gradients that no observer sees (parameter-server
  synchronisation): two consecutive steps' gradients (``ConsecutiveGradients``, biased).

Sharded parameters (ZeRO, docs/concepts/sharding.md): a stage-1 gradient is all-reduced
and observed like any other, but only its owner holds the optimizer state, so the owners
send the Adam divisors when they are refreshed. Stage-2 and stage-3 gradients are never
whole and averaged on every rank: on a sampled step the runtime also sums each squared
local gradient over the ranks onto the rank that holds that gradient's average (as
backward produces it: the owner of a stage-2 parameter, FSDP2's row slice of a stage-3
one), and each rank adds its rows' terms of both norms; the one all-reduce of the queued
statistics then sums them over the ranks. With gradient accumulation the squares are those
of the first micro-batch's local gradients, as for all-reduced ones: reduced after its
(unsynced) backward, stage 2 from the local ``.grad``, stage 3 from FSDP2's unsharded
gradient as it accumulates; the step's averaged gradient is then held as without
accumulation.

Statistics are kept per optimizer param group. For Adam-type optimizers they are of the
preconditioned gradient ``g / (sqrt(v_hat) + eps)``; the divisors change slowly, so they are
refreshed every ``precond_every`` steps rather than rebuilt at every step.

The replica sums are batched: the statistics of ``flush_every`` steps (and whatever is
queued when the loop decides or reports) go into one all-reduce, so adaptivity adds no
synchronisation point to most steps; the noise estimate lags by at most that many steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stratagem.adapt.noise_scale import GradientNoiseScale

Run = tuple[int, int, int]  # (start, end, optimizer param group) within a fused buffer


# -- per-parameter-group squared norms --------------------------------------------------------
# Gradients are lists (one per param group) of tensors or None. For Adam-type optimizers the
# noise scale is measured on *preconditioned* gradients g / (sqrt(v_hat) + eps), the
# direction the optimizer actually moves in; adam_preconditioner builds the divisors.

GroupedTensors = Sequence[Sequence["torch.Tensor | None"]]


def param_group_grads(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor | None]]:
    """The current ``.grad`` of every parameter, grouped like ``optimizer.param_groups``."""
    return [[p.grad for p in group["params"]] for group in optimizer.param_groups]


@torch.no_grad()
def group_sqr_norms(
    grads: GroupedTensors, preconditioner: GroupedTensors | None = None
) -> np.ndarray:
    """Squared L2 norm per group (float64), after dividing by ``preconditioner`` if given."""
    out = np.zeros(len(grads))
    for i, group in enumerate(grads):
        total = 0.0
        for j, g in enumerate(group):
            if g is None:
                continue
            g = g.detach().to(torch.float64)
            if preconditioner is not None and preconditioner[i][j] is not None:
                g = g / preconditioner[i][j].to(torch.float64)
            total += float(g.pow(2).sum())
        out[i] = total
    return out


@torch.no_grad()
def adam_preconditioner(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor | None]] | None:
    """Divisors ``sqrt(v_hat) + eps`` for Adam/AdamW/Adamax-like, RMSprop and Adagrad state.

    ``v_hat`` is Adam's bias-corrected ``exp_avg_sq`` (Adamax divides by ``exp_inf``), RMSprop's
    ``square_avg`` (minus ``grad_avg**2`` when centered), Adagrad's ``sum``. Returns None
    while some parameter with a gradient has no state yet (before the first step): the
    caller should then skip the noise update rather than mix preconditioned and raw norms.
    """
    out: list[list[torch.Tensor | None]] = []
    for group in optimizer.param_groups:
        eps = float(group.get("eps", 1e-8))
        betas = group.get("betas", (0.9, 0.999))
        row: list[torch.Tensor | None] = []
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if p.grad is None:
                row.append(None)
                continue
            if "exp_avg_sq" in state:
                step = float(state.get("step", 1))
                v = state["exp_avg_sq"] / (1.0 - betas[1] ** max(step, 1.0))
                row.append(v.sqrt() + eps)
            elif "exp_inf" in state:
                row.append(state["exp_inf"].clamp_min(eps))
            elif "square_avg" in state:
                v = state["square_avg"]
                if "grad_avg" in state:
                    v = v - state["grad_avg"].pow(2)
                row.append(v.clamp_min(0).sqrt() + eps)
            elif "sum" in state:
                row.append(state["sum"].sqrt() + eps)
            else:
                return None
        out.append(row)
    return out


class ConsecutiveGradients:
    """Single replica, no accumulation: pair each step's gradient with the previous one.

    :meth:`push` returns ``(local_sqr_norms (2, groups), mean_sqr_norm (groups,))`` from the
    last two gradients, ready for ``GradientNoiseScale.update(..., biased=True)``; the
    first call returns None. Biased because the parameters moved between the two steps.
    """

    def __init__(self) -> None:
        self._prev: list[list[torch.Tensor | None]] | None = None

    def reset(self) -> None:
        self._prev = None

    @torch.no_grad()
    def push(
        self, grads: GroupedTensors, preconditioner: GroupedTensors | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        current = [
            [None if g is None else g.detach().to(torch.float64).clone() for g in group]
            for group in grads
        ]
        if preconditioner is not None:
            current = [
                [
                    g if g is None or d is None else g / d.to(torch.float64)
                    for g, d in zip(gs, ds, strict=True)
                ]
                for gs, ds in zip(current, preconditioner, strict=True)
            ]
        prev, self._prev = self._prev, current
        if prev is None:
            return None
        mean = [
            [_avg(a, b) for a, b in zip(ga, gb, strict=True)]
            for ga, gb in zip(prev, current, strict=True)
        ]
        local = np.stack([group_sqr_norms(prev), group_sqr_norms(current)])
        return local, group_sqr_norms(mean)


def _avg(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return (a + b) / 2


# -- statistics from the runtime's gradient traffic -------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local slice (stage 3), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sqr(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t)
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


class GradStats:
    """Collects each step's gradient norms and updates ``gns`` (see the module docstring).

    The loop calls :meth:`begin_step` before the step's first micro-batch, :meth:`first_micro`
    after the first of several micro-batches, :meth:`before_step` right before the optimizer
    step and :meth:`after_step` after it. All ranks must make the same calls.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, gns: GradientNoiseScale,
                 *, world_size: int = 1, precond_every: int = 10, flush_every: int = 16,
                 process_group: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.gns = gns
        self.world_size = int(world_size)
        self.precond_every = max(int(precond_every), 1)
        self.process_group = process_group
        self.groups = len(optimizer.param_groups)
        self._index = {id(p): (i, j) for i, g in enumerate(optimizer.param_groups)
                       for j, p in enumerate(g["params"])}
        self._opt_group = {k: gi for k, (gi, _) in self._index.items()}
        module = getattr(model, "module", model)
        self._params = dict(module.named_parameters())
        self._runs: dict[int, list[Run]] = {}
        self._pinv: dict[int, torch.Tensor] = {}  # fused group id -> flat 1/divisor
        self._divisors: list[list[torch.Tensor | None]] | None = None
        self._precond_age = 0
        self._consecutive = ConsecutiveGradients()
        self._prev_size = 0
        self._handle = None
        if self.world_size > 1 and hasattr(model, "add_grad_observer"):
            self._handle = model.add_grad_observer(self._observe)
        self.active = False
        self.flush_every = max(int(flush_every), 1)
        self._queue: list[tuple[Any, ...]] = []  # steps whose statistics await the sum
        self._since_flush = 0
        self._seconds = 0.0  # host time spent on statistics, for the sampling rate
        self._active_steps = 0
        self._reset()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _reset(self) -> None:
        self._local: list[tuple[int, torch.Tensor]] = []
        self._reduced: list[tuple[int, torch.Tensor]] = []
        self._first: torch.Tensor | None = None

    # -- preconditioner ------------------------------------------------------------------
    @property
    def preconditioned(self) -> bool:
        return self.gns.preconditioned

    def _ready(self) -> bool:
        return not self.preconditioned or self._divisors is not None

    @torch.no_grad()
    def _refresh_preconditioner(self) -> None:
        self._divisors = adam_preconditioner(self.optimizer)
        if self._divisors is not None and self._sharded():
            self._divisors = self.model.share_from_owners(self.optimizer, self._divisors)
        self._pinv.clear()
        self._precond_age = 0

    def _flat_pinv(self, group: Any, buffer: torch.Tensor) -> torch.Tensor | None:
        flat = self._pinv.get(group.id)
        if flat is not None or self._divisors is None:
            return flat
        flat = torch.ones(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for m in group.members:
            gi, j = self._index.get(id(self._params.get(m.param)), (-1, -1))
            if gi < 0:
                continue
            d = self._divisors[gi][j]
            if d is None:
                continue
            if not m.whole:
                d = d.narrow(m.axis, m.start, m.length)
            flat[m.offset:m.offset + m.numel].copy_(d.reshape(-1)).reciprocal_()
        self._pinv[group.id] = flat
        return flat

    # -- runtime observer ----------------------------------------------------------------
    def _group_runs(self, group: Any) -> list[Run]:
        runs = self._runs.get(group.id)
        if runs is None:
            runs = []
            for m in sorted(group.members, key=lambda m: m.offset):
                gi = self._opt_group.get(id(self._params.get(m.param)), -1)
                if gi < 0:
                    continue
                if runs and runs[-1][2] == gi and runs[-1][1] == m.offset:
                    runs[-1] = (runs[-1][0], m.offset + m.numel, gi)
                else:
                    runs.append((m.offset, m.offset + m.numel, gi))
            self._runs[group.id] = runs
        return runs

    @property
    def seconds_per_step(self) -> float:
        """Mean host time of the statistics of one sampled step (0 before any)."""
        return self._seconds / self._active_steps if self._active_steps else 0.0

    @torch.no_grad()
    def _observe(self, event: str, group: Any, buffer: torch.Tensor, scale: float) -> None:
        if not self.active:
            return
        t0 = time.perf_counter()
        pinv = self._flat_pinv(group, buffer) if self.preconditioned else None
        out = self._local if event == "local" else self._reduced
        inv_scale2 = 1.0 / (scale * scale) if scale else 0.0
        for start, end, gi in self._group_runs(group):
            seg = buffer[start:end]
            if pinv is not None:
                seg = seg.float() * pinv[start:end]
            out.append((gi, _sqr(seg) * inv_scale2))
        self._seconds += time.perf_counter() - t0

    # -- sharded parameters -----------------------------------------------------------------
    def _sharded(self) -> bool:
        """Whether the model shards some state over several workers (ZeRO)."""
        return self.world_size > 1 and bool(getattr(self.model, "is_sharded", False))

    @torch.no_grad()
    def _held_terms(self, squares: bool) -> torch.Tensor | None:
        """Per param group, this rank's terms of the stage-2/3 parameters, preconditioned:
        of the squared local gradients summed over the ranks (``squares``, the model's
        :meth:`gradient_squares`), else of the squared averaged gradient (``.grad``: the
        rows held here). None when the model has no such parameter (the same on every
        rank, so every rank queues the same shapes)."""
        held = self.model.sharded_gradient_params()
        if not held:
            return None
        values = self.model.gradient_squares() if squares else None
        sums: list[list[torch.Tensor]] = [[] for _ in range(self.groups)]
        for gi, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in held:
                    continue
                t = values.get(id(p)) if values is not None else p.grad
                if t is None:  # not held here (a stage-2 parameter of another owner)
                    continue
                t = _local(t).to(torch.float64)
                sq = t if squares else t.square()
                d = self._divisors[gi][j] if self.preconditioned and self._divisors else None
                if d is not None:
                    sq = sq / _local(d).to(torch.float64).square()
                sums[gi].append(sq.sum())
        # (one device-to-host copy per group, not one per parameter)
        return torch.stack([torch.stack(t).sum().cpu() if t else
                            torch.zeros((), dtype=torch.float64) for t in sums])

    # -- parameter-level norms ------------------------------------------------------------
    def _grads(self) -> list[list[torch.Tensor | None]]:
        skip = self.model.sharded_gradient_params() if self._sharded() else {}
        return [[None if id(p) in skip else p.grad for p in g["params"]]
                for g in self.optimizer.param_groups]

    @torch.no_grad()
    def _param_sqr_norms(self) -> torch.Tensor:
        """Per param group: squared norm of the current ``.grad`` (preconditioned if so)."""
        out = []
        for gi, grads in enumerate(self._grads()):
            divs = self._divisors[gi] if self.preconditioned and self._divisors else None
            dense, total = [], None
            for j, g in enumerate(grads):
                if g is None:
                    continue
                if g.is_sparse:
                    g = g.to_dense()
                if divs is not None and divs[j] is not None:
                    g = g / divs[j]
                dense.append(g)
            if dense:
                norms = torch._foreach_norm(dense)
                total = torch.stack([n.float() for n in norms]).square().sum()
            out.append(total if total is not None else torch.zeros((), dtype=torch.float32))
        device = next((t.device for t in out if t.device.type != "cpu"), torch.device("cpu"))
        return torch.stack([t.to(device) for t in out]).double()

    def _sum(self, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        out = [None] * self.groups
        for gi, t in parts:
            out[gi] = t if out[gi] is None else out[gi] + t
        device = parts[0][1].device
        return torch.stack([torch.zeros((), device=device) if t is None else t.float()
                            for t in out]).double()

    # -- the step ------------------------------------------------------------------------
    def begin_step(self, collect: bool) -> None:
        """Start a step; ``collect=False`` (nothing needs the statistics) costs nothing."""
        self._reset()
        self.active = bool(collect) and self._ready()
        if self._sharded():  # squares of the next backward: the synced or the first one
            self.model.collect_gradient_squares(self.active)

    def first_micro(self) -> None:
        """After the backward of the first of several micro-batches (local gradient)."""
        if self.active:
            t0 = time.perf_counter()
            self._first = self._param_sqr_norms()
            if self._sharded():  # stage 2/3: the first micro-batch's squares, summed
                self.model.reduce_local_gradient_squares()
                terms = self._held_terms(squares=True)
                self.model.collect_gradient_squares(False)  # not the later micro-batches'
                if terms is not None:
                    self._first = self._first + terms.to(self._first.device)
            self._seconds += time.perf_counter() - t0

    def before_step(self, replica_sizes: Sequence[int], micros: int) -> None:
        """Right before the optimizer step: queue this step's statistics.

        ``replica_sizes``: samples of this step on each replica; ``micros``: micro-batches
        per replica (accumulation steps + 1).
        """
        if not self.active:
            self._consecutive.reset()
            return
        t0 = time.perf_counter()
        self._active_steps += 1
        try:
            self._queue_step(replica_sizes, micros)
        finally:
            self._seconds += time.perf_counter() - t0

    def _queue_step(self, replica_sizes: Sequence[int], micros: int) -> None:
        sizes = [int(s) for s in replica_sizes]
        total = sum(sizes)
        replicas = len(sizes)
        if micros > 1:
            if self._first is None:
                return
            self._consecutive.reset()
            n = replicas * micros
            if total % n == 0:  # equal micro-batches (else: skip this step)
                held = self._held_terms(squares=False) if self._sharded() else None
                self._queue.append(("pair", self._first, self._reduced_or_param(), n,
                                    total // n, replicas, held))
        elif replicas > 1 and (self._local or self._sharded()):
            self._consecutive.reset()
            local = (self._sum(self._local) if self._local
                     else torch.zeros(self.groups, dtype=torch.float64))
            held = None
            if self._sharded():
                squares = self._held_terms(squares=True)
                if squares is not None:
                    local = local + squares.to(local.device)
                    held = self._held_terms(squares=False)
            self._queue.append(("pair", local, self._reduced_or_param(), replicas, sizes,
                                replicas, held))
        else:  # one gradient per step: pair it with the previous step's (biased)
            divs = self._divisors if self.preconditioned else None
            pair = self._consecutive.push(self._grads(), divs)
            if pair is not None:
                self._queue.append(("consecutive", pair, [self._prev_size, total]))
            self._prev_size = total

    def _reduced_or_param(self) -> torch.Tensor:
        return self._sum(self._reduced) if self._reduced else self._param_sqr_norms()

    @torch.no_grad()
    def after_step(self, collecting: bool = True) -> None:
        """End of the optimizer step: every ``flush_every`` steps, :meth:`flush`. While
        ``collecting``, also refreshes the Adam preconditioner every ``precond_every``
        steps."""
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()
        if self.preconditioned and collecting:
            self._precond_age += 1
            if self._divisors is None or self._precond_age >= self.precond_every:
                t0 = time.perf_counter()
                self._refresh_preconditioner()
                self._seconds += time.perf_counter() - t0
        self.active = False

    @torch.no_grad()
    def flush(self) -> int:
        """Collective (all ranks, same points): sum the queued replica statistics over the
        replicas in one small all-reduce and update the noise scale; returns the number of
        updates applied."""
        queue, self._queue = self._queue, []
        self._since_flush = 0
        pairs = [e for e in queue if e[0] == "pair"]
        # sharded steps: each rank's terms of the averaged gradient's norm are summed too
        partial = any(e[6] is not None for e in pairs)
        if pairs and self.world_size > 1:
            # float32: NCCL builds may lack float64; one tensor for all queued steps
            rows = [e[1].float() for e in pairs]
            if partial:
                rows = [torch.stack([r, (e[6] if e[6] is not None else torch.zeros_like(r))
                                     .float().to(r.device)]) for r, e in zip(rows, pairs,
                                                                             strict=True)]
            local = torch.stack(rows)
            dist.all_reduce(local, group=self.process_group)
            summed = iter(local.double().cpu().numpy())
        else:
            summed = iter(e[1].double().cpu().numpy() for e in pairs)
        applied = 0
        for entry in queue:
            if entry[0] == "pair":
                _, _, mean, n, size, replicas, _ = entry
                total = next(summed)
                mean = mean.double().cpu().numpy()
                if partial:
                    total, mean = total[0], mean + total[1]
                s_mean = total / replicas
                applied += self.gns.update(np.tile(s_mean, (n, 1)), mean, size)
            else:
                _, (local_norms, mean_norm), sizes = entry
                applied += self.gns.update(local_norms, mean_norm, sizes, biased=True)
        return applied
