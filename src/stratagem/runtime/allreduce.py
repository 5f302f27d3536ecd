"""The all-reduce synchronizer: fused groups, launched from gradient hooks during backward.

Life of one synced backward pass:

1. A post-accumulate-grad hook fires per parameter when its gradient is final. The hook
   copies the gradient (or each partition slice of it), pre-scaled by
   ``grad_weight / world_size``, into its group's flat buffer -- for a whole dense
   parameter whose ``.grad`` already is a view of that buffer it only scales in place --
   and makes ``param.grad`` a view of the buffer (like DDP's ``gradient_as_bucket_view``).
2. Groups launch strictly in the plan's launch order: a group starts its async collective
   as soon as it and every group before it are complete. The order is fixed by the plan, so
   every rank issues the same collectives in the same sequence even if hooks fire in a
   different order or a rank leaves some parameter unused.
3. A callback queued on the autograd engine runs when backward ends: it launches the groups
   still waiting (parameters without a gradient contribute zeros), runs second rounds
   (PowerSGD) in launch order, waits for everything and copies averaged slices back into
   ``param.grad`` where it is not a buffer view. ``loss.backward()`` returns with averaged
   gradients (a row-sparse one, ``nn.Embedding(sparse=True)``'s, summed densely: dense,
   except that a ``SparseAdam`` step gets its non-zero rows, see
   :func:`_rows_for_sparse_adam`).

A ``gather_rows`` group (one sparse-gradient parameter, :class:`_RowsGroupRT`) has no
buffer: at its turn in the launch order each rank's row count, rows and values are
all-gathered without blocking, padded to a capacity every rank derives from the last step's
counts; at the end of backward the rows beyond it, if any rank had more, go in a second
round, and every rank coalesces them all into the same sparse gradient.

Assumption (as in DDP): every rank runs the same number of synced backward passes, and each
of them produces a gradient for at least one parameter. Reentrant activation checkpointing
(which runs a nested backward) is not supported; use ``use_reentrant=False``.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stratagem.errors import CheckpointError, DistributedError, StrategyError
from stratagem.runtime.comm import Comm
from stratagem.runtime.compressors import Compressor, make_compressor
from stratagem.runtime.plan import GroupPlan, Member, Plan
from stratagem.runtime.stats import CommStats

GATHER_HEADROOM = 1.125
"""A ``gather_rows`` group's first round has room for the last step's most rows times this:
a batch touching a few more rows than the last needs no second round."""

GradObserver = Callable[[str, GroupPlan, torch.Tensor, float], None]
"""``fn(event, group, buffer, scale)``: ``event`` is ``"local"`` (``buffer`` holds ``scale`` x
this rank's gradient, about to be averaged) or ``"reduced"`` (the average, ``scale`` 1).
Observers must not modify the buffer."""


def _queue_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_ROW_SPARSE = "_stratagem_row_sparse"  # a parameter attribute: its sparse gradient is summed
_hooked = False                         # densely here (see _rows_for_sparse_adam)


def _mark_row_sparse(param: torch.Tensor) -> None:
    global _hooked
    setattr(param, _ROW_SPARSE, True)
    if not _hooked:
        register_optimizer_step_pre_hook(_rows_for_sparse_adam)
        _hooked = True


def _rows_for_sparse_adam(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a ``SparseAdam`` step: the all-reduced gradient of a row-sparse parameter is
    dense, which SparseAdam refuses; hand it the rows whose sum is not zero instead. Only
    there: finding the rows is a pass over the table (tens of ms for DLRM's 64 MB),
    while SGD or Adagrad take the dense sum as it is."""
    if not isinstance(optimizer, torch.optim.SparseAdam):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None or g.is_sparse or not getattr(p, _ROW_SPARSE, False):
                continue
            rows = g.ne(0).flatten(1).any(1).nonzero().squeeze(1)
            p.grad = torch.sparse_coo_tensor(rows[None], g.index_select(0, rows), g.shape,
                                             is_coalesced=True, check_invariants=False)


class _MemberRT:
    """A member bound to its parameter and to its slice of the group buffer."""

    __slots__ = ("plan", "param", "view", "as_grad", "captured")

    def __init__(self, plan: Member, param: nn.Parameter, buffer: torch.Tensor) -> None:
        self.plan = plan
        self.param = param
        self.view = buffer[plan.offset:plan.offset + plan.numel].view(plan.shape)
        # param.grad can live in the buffer only if it is the whole param, same dtype, and
        # the param is contiguous (the gradient layout contract).
        self.as_grad = (plan.whole and param.dtype == buffer.dtype
                        and param.is_contiguous())
        self.captured = False

    def capture(self, factor: float) -> None:
        """Put ``factor`` x this rank's gradient into the buffer (zeros if there is none).

        Scaling is fused with the copy, so each gradient byte is touched once."""
        grad = self.param.grad
        view = self.view
        if grad is None:
            view.zero_()
            if self.as_grad:
                self.param.grad = view
            return
        if self.as_grad and not grad.is_sparse and grad.data_ptr() == view.data_ptr():
            if factor != 1.0:  # accumulated in place into the buffer
                view.mul_(factor)
            return
        if grad.is_sparse:  # densify: the sparse rows summed into zeros
            if self.plan.whole:
                view.zero_().add_(grad, alpha=factor)
                grad = None
            elif grad.sparse_dim() == 1:
                self._capture_rows(grad, factor)
                grad = None
            else:
                grad = grad.to_dense()
        if grad is not None:
            if not self.plan.whole:
                grad = grad.narrow(self.plan.axis, self.plan.start, self.plan.length)
            torch.mul(grad, factor, out=view)
        if self.as_grad:
            self.param.grad = view

    def _capture_rows(self, grad: torch.Tensor, factor: float) -> None:
        """This part of a row-sparse gradient (an embedding's), summed into zeros: only
        its rows, not the whole table made dense for every part (on DLRM's 64 MB table
        that doubled PartitionedAR's step). The coalesced gradient is kept as the
        parameter's for the other parts (``write_back`` replaces it)."""
        if not grad.is_coalesced():
            grad = grad.coalesce()
            self.param.grad = grad
        rows, vals = grad.indices()[0], grad.values()
        start, length = self.plan.start, self.plan.length
        if self.plan.axis == 0:
            keep = (rows >= start) & (rows < start + length)
            rows, vals = rows[keep] - start, vals[keep]
        else:  # a slice of every row: values are (rows, *shape[1:])
            vals = vals.narrow(self.plan.axis, start, length)
        self.view.zero_().index_add_(0, rows, vals.to(self.view.dtype), alpha=factor)

    def write_back(self, dense: Callable[[str, nn.Parameter], torch.Tensor]) -> None:
        """Copy the averaged slice into ``param.grad`` (unless it already is the buffer);
        where it has no dense gradient, ``dense(name, param)`` gives one to write into."""
        if self.as_grad:
            return
        grad = self.param.grad
        if grad is None or grad.is_sparse:
            grad = dense(self.plan.param, self.param)
            self.param.grad = grad
        if self.plan.whole:
            grad.copy_(self.view)
        else:
            grad.narrow(self.plan.axis, self.plan.start, self.plan.length).copy_(self.view)


class _GroupRT:
    __slots__ = ("plan", "buffer", "members", "compressor", "comm", "pending", "launched",
                 "round", "wire", "work")

    def __init__(self, plan: GroupPlan, params: dict[str, nn.Parameter], comm: Comm,
                 device: torch.device) -> None:
        self.plan = plan
        self.buffer = torch.zeros(plan.numel, dtype=getattr(torch, plan.dtype), device=device)
        self.members = [_MemberRT(m, params[m.param], self.buffer) for m in plan.members]
        self.compressor: Compressor = make_compressor(plan, self.buffer)
        self.comm = comm
        self.pending = len(self.members)
        self.launched = False
        self.round = 0  # the compressor's round in flight
        self.wire: torch.Tensor | None = None  # what that round sums
        self.work: Any = None

    def start_round(self, round: int) -> None:
        """Compress and launch the all-reduce of ``round`` (this reducer owns the
        collective; the compressor only shapes what is summed)."""
        self.round = round
        self.wire = self.compressor.compress(round)
        self.work = self.comm.all_reduce(self.wire)

    def end_round(self) -> None:
        """Wait for the round in flight and hand its sum to the compressor."""
        self.comm.wait(self.work)
        self.work = None
        self.compressor.decompress(self.round, self.wire, self.comm.world_size)

    def advance(self) -> None:
        """End of backward: the next round, if the compressor has one."""
        if self.work is not None and self.round + 1 < self.compressor.rounds:
            self.end_round()
            self.start_round(self.round + 1)

    def finish(self) -> None:
        """Complete every round; the buffer then holds the averaged gradient."""
        self.end_round()
        while self.round + 1 < self.compressor.rounds:
            self.start_round(self.round + 1)
            self.end_round()


class _RowsMemberRT:
    """A parameter whose sparse gradient is all-gathered as rows (``gather_rows``)."""

    __slots__ = ("plan", "param", "as_grad", "captured", "rows", "values", "factor",
                 "summed")

    def __init__(self, plan: Member, param: nn.Parameter) -> None:
        self.plan = plan
        self.param = param
        self.as_grad = False
        self.captured = False
        self.rows: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.factor = 1.0  # applied as the values are copied out (_RowsGroupRT)
        self.summed: torch.Tensor | None = None

    def capture(self, factor: float) -> None:
        """This rank's rows (coalesced: each once), their values and ``factor``; none
        where there is no gradient."""
        grad = self.param.grad
        self.factor = factor
        if grad is None:
            self.rows = torch.zeros(0, dtype=torch.int64, device=self.param.device)
            self.values = torch.zeros((0, *self.plan.shape[1:]), dtype=self.param.dtype,
                                      device=self.param.device)
            return
        if not grad.is_sparse:
            raise DistributedError(
                f"the gradient of {self.plan.param!r} is dense, but its strategy gathers its "
                "rows", where="DistributedModel backward",
                fix="declare the embedding sparse (nn.Embedding(sparse=True)), or drop "
                    "gather_rows from its synchronizer")
        grad = grad.coalesce()
        self.rows = grad.indices()[0]
        self.values = grad.values()

    def write_back(self, dense: Callable[[str, nn.Parameter], torch.Tensor]) -> None:
        """The summed rows become the parameter's (sparse) gradient."""
        self.param.grad = self.summed
        self.summed = None


class _RowsGroupRT:
    """One ``gather_rows`` parameter. The ranks' rows differ in number, so each sends its
    count with up to ``capacity`` rows (ids and values, zero-padded), launched from the
    hook like any group's collective; :meth:`finish` sends the rows beyond it in a second
    round when a rank has more. The capacity is the last step's largest count plus
    ``GATHER_HEADROOM``: every rank has those counts, so every rank agrees on it, and a
    step whose rows fit (the usual case) has no blocking round in backward (a count round
    first held every rank in its hook until the slowest reached it: 12-22 ms of a 170 ms
    wide & deep step, 4 workers on 2 cores). Every rank sums the same rows in the same
    order (the ranks' gradients coalesced together)."""

    __slots__ = ("plan", "buffer", "members", "comm", "pending", "launched", "work",
                 "capacity", "rest", "gathered_rows", "gathered_values")

    def __init__(self, plan: GroupPlan, params: dict[str, nn.Parameter], comm: Comm,
                 device: torch.device) -> None:
        self.plan = plan
        self.buffer = torch.zeros(0, device=device)  # nothing summed in place
        self.members = [_RowsMemberRT(m, params[m.param]) for m in plan.members]
        self.comm = comm
        self.pending = len(self.members)
        self.launched = False
        self.work: list[Any] = []
        self.capacity = 0  # rows sent in the first round (0: the first step sends counts)
        self.rest: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.gathered_rows: list[torch.Tensor] = []
        self.gathered_values: list[torch.Tensor] = []

    def _padded(self, rows: torch.Tensor, values: torch.Tensor, factor: float, size: int,
                count: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(``count``, if given, then ``rows``; ``values`` x ``factor``), zero-padded to
        ``size`` rows."""
        head = 0 if count is None else 1
        ids = torch.zeros(head + size, dtype=torch.int64, device=rows.device)
        if count is not None:
            ids[0] = count
        ids[head:head + rows.numel()] = rows
        padded = values.new_zeros((size, *values.shape[1:]))
        torch.mul(values, factor, out=padded[:values.shape[0]])  # scaled as copied
        return ids, padded

    def _gather(self, ids: torch.Tensor, values: torch.Tensor
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        world = self.comm.world_size
        out_ids = [torch.empty_like(ids) for _ in range(world)]
        out_values = [torch.empty_like(values) for _ in range(world)]
        work = [self.comm.all_gather(out_ids, ids)]
        if values.shape[0]:  # (a size every rank agrees on)
            work.append(self.comm.all_gather(out_values, values))
        return out_ids, out_values, work

    def start_round(self, round: int) -> None:
        m = self.members[0]
        assert m.rows is not None and m.values is not None
        k = min(m.rows.numel(), self.capacity)
        ids, values = self._padded(m.rows[:k], m.values[:k], m.factor, self.capacity,
                                   m.rows.numel())
        self.gathered_rows, self.gathered_values, self.work = self._gather(ids, values)
        self.rest = (m.rows[k:], m.values[k:], m.factor)
        m.rows = m.values = None  # copied into the padded tensors

    def advance(self) -> None:
        """One round only."""

    def _overflow(self, counts: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The second round: every rank's rows beyond the capacity (collective; every rank
        knows the counts, so every rank takes part or none does)."""
        beyond = max(c - self.capacity for c in counts)
        if beyond <= 0:
            return [], []
        assert self.rest is not None
        rows, values, factor = self.rest
        ids, padded = self._padded(rows, values, factor, beyond, None)
        out_ids, out_values, work = self._gather(ids, padded)
        for w in work:
            self.comm.wait(w)
        return out_ids, out_values

    def finish(self) -> None:
        """Wait for the rows; the member's gradient is their sum (coalesced)."""
        for work in self.work:
            self.comm.wait(work)
        self.work = []
        m = self.members[0]
        total = m.plan.shape[0]
        heads = self.gathered_rows
        counts = torch.stack([h[0] for h in heads]).tolist()
        extra_ids, extra_values = self._overflow(counts)
        cap = self.capacity
        ids_parts, value_parts = [], []
        for r, (h, n) in enumerate(zip(heads, counts, strict=True)):
            ids, vals = h[1:1 + min(n, cap)], self.gathered_values[r][:min(n, cap)]
            if n > cap:  # (with its rows of the second round)
                ids = torch.cat([ids, extra_ids[r][:n - cap]])
                vals = torch.cat([vals, extra_values[r][:n - cap]])
            ids_parts.append(ids)
            value_parts.append(vals)
        rows = torch.cat(ids_parts)

        def outside(ids: torch.Tensor) -> bool:
            if not ids.numel():
                return False
            lo, hi = torch.aminmax(ids)  # one pass
            return int(lo) < 0 or int(hi) >= total

        if outside(rows):  # all ranks' ids at once; the sender found only on error
            rank = next(i for i, r in enumerate(ids_parts) if outside(r))
            raise DistributedError(
                f"rank {rank} sent rows of {m.plan.param!r} outside its {total} rows",
                where="DistributedModel backward",
                fix="run the same model, with the same embedding sizes, on every worker")
        values = torch.cat(value_parts)  # (every part has the value rows' shape, if empty)
        self.gathered_rows, self.gathered_values, self.rest = [], [], None
        # the next step's first round: room for this step's most rows, and some more
        self.capacity = min(total, math.ceil(max(counts) * GATHER_HEADROOM))
        # the ids are checked above (torch's own invariant check would warn, or pass again)
        m.summed = torch.sparse_coo_tensor(rows[None], values, m.plan.shape,
                                           check_invariants=False).coalesce()


class AllReduceReducer:
    """Runs a :class:`Plan`'s groups for one model replica (see the module docstring)."""

    def __init__(self, plan: Plan, params: dict[str, nn.Parameter], comms: dict[str, Comm],
                 stats: CommStats) -> None:
        self.plan = plan
        self.stats = stats
        self.world_size = plan.world_size
        device = torch.device(plan.device)
        self.groups: list[Any] = [
            (_RowsGroupRT if g.gather_rows else _GroupRT)(g, params, comms[g.backend], device)
            for g in plan.groups]
        for n in plan.densified:  # (not where a PS piece of the parameter remains)
            if plan.ps is None or not plan.ps.pieces_of(n):
                _mark_row_sparse(params[n])
        self._entries: dict[int, list[tuple[_GroupRT, _MemberRT]]] = {}
        for g in self.groups:
            for m in g.members:
                self._entries.setdefault(id(m.param), []).append((g, m))
        # A dense gradient per sliced parameter that has none (a sparse one's parts), kept
        # from step to step: a fresh 64 MB tensor each step cost DLRM's PartitionedAR more
        # than its all-reduce (page faults). Zeroed unless the parts cover every element.
        sliced: dict[str, int] = {}
        for g in self.groups:
            for m in g.members:
                if not m.as_grad and not g.plan.gather_rows:
                    sliced[m.plan.param] = sliced.get(m.plan.param, 0) + m.plan.numel
        self._covered = {n: total == params[n].numel() for n, total in sliced.items()}
        self._dense: dict[str, torch.Tensor] = {}
        self.require_sync = True
        self.grad_weight = 1.0
        self.before_wait: Callable[[], Callable[[], None] | None] | None = None
        # Gradient observers (DistributedModel.add_grad_observer): called with each group's
        # buffer before its collective ("local") and after the average ("reduced").
        self.observers: list[GradObserver] = []
        self.loss_scale = 1.0  # the gradients' factor from a GradScaler (runtime/amp.py)
        self._next = 0
        self._queued = False
        # Hooks of CPU and CUDA parameters may run on different autograd threads.
        self._lock = threading.Lock()
        self._handles = []
        ref = weakref.ref(self)
        for name in dict.fromkeys(m.param for g in plan.groups for m in g.members):
            p = params[name]

            def hook(param: torch.Tensor, ref: weakref.ref = ref) -> None:
                reducer = ref()
                if reducer is not None:
                    reducer._on_grad(param)

            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hot path ------------------------------------------------------------------------
    def prepare_for_forward(self) -> None:
        """Drop the state of a backward pass that failed before its end callback ran."""
        if self._queued:
            self._reset()

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.require_sync:
            return
        with self._lock:
            self._on_grad_locked(param)

    def _on_grad_locked(self, param: torch.Tensor) -> None:
        if not self._queued:
            _queue_callback(self._finish)
            self._queued = True
        factor = self.grad_weight / self.world_size
        for g, m in self._entries[id(param)]:
            if m.captured:
                raise DistributedError(
                    f"the gradient of {m.plan.param!r} was accumulated twice in one backward "
                    "pass", where="DistributedModel backward",
                    fix="accumulate each gradient once per backward (use "
                        "torch.utils.checkpoint with use_reentrant=False)")
            m.capture(factor)
            m.captured = True
            g.pending -= 1
        groups = self.groups
        while self._next < len(groups) and groups[self._next].pending == 0:
            self._launch(groups[self._next])
            self.stats.overlapped += 1
            self._next += 1

    def _launch(self, g: _GroupRT) -> None:
        g.launched = True
        if self.observers and not g.plan.gather_rows:  # (loss_scale: see runtime/amp.py)
            scale = self.grad_weight / self.world_size * self.loss_scale
            for fn in self.observers:
                fn("local", g.plan, g.buffer, scale)
        g.start_round(0)

    def _finish(self) -> None:
        """End of backward: launch the rest, wait, write back, reset for the next step."""
        try:
            factor = self.grad_weight / self.world_size
            for g in self.groups[self._next:]:
                for m in g.members:
                    if not m.captured:
                        m.capture(factor)
                self._launch(g)
            self._next = len(self.groups)
            for g in self.groups:
                g.advance()
            finish_extra = self.before_wait() if self.before_wait is not None else None
            for g in self.groups:
                g.finish()
            for fn in self.observers:  # (gathered rows are not observed: no buffer)
                for g in self.groups:
                    if not g.plan.gather_rows:
                        fn("reduced", g.plan, g.buffer, self.loss_scale)
            for g in self.groups:
                for m in g.members:
                    m.write_back(self._dense_grad)
            if finish_extra is not None:
                finish_extra()
            self.stats.steps += 1
        finally:
            self._reset()

    def _dense_grad(self, name: str, param: nn.Parameter) -> torch.Tensor:
        """The kept dense gradient of ``param`` (see ``__init__``), ready to be written."""
        kept = self._dense.get(name)
        if (kept is None or kept.shape != param.shape or kept.dtype != param.dtype
                or kept.device != param.device):
            kept = torch.zeros_like(param, memory_format=torch.preserve_format)
            self._dense[name] = kept
        elif not self._covered[name]:
            kept.zero_()
        return kept

    def _reset(self) -> None:
        self._queued = False
        self._next = 0
        for g in self.groups:
            g.pending = len(g.members)
            g.launched = False
            for m in g.members:
                m.captured = False

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.groups:
            if g.plan.gather_rows:  # no compressor, no state
                continue
            for key, value in g.compressor.state_dict().items():
                out[f"group{g.plan.id}.{g.plan.compressor}.{key}"] = value
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        per_group: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            prefix, _, rest = key.partition(".")
            per_group.setdefault(prefix, {})[rest] = value
        known = {f"group{g.plan.id}": g for g in self.groups if not g.plan.gather_rows}
        unknown = sorted(set(per_group) - set(known))
        if unknown:
            raise CheckpointError(f"synchronizer state for unknown groups {unknown}",
                                  where="load_synchronizer_state_dict",
                                  fix="load a state saved with the same strategy")
        for prefix, g in known.items():
            sub = per_group.get(prefix, {})
            head = f"{g.plan.compressor}."
            bad = [k for k in sub if not k.startswith(head)]
            if bad:
                raise CheckpointError(f"{prefix}: state {bad} was saved for another compressor",
                                      where="load_synchronizer_state_dict",
                                      fix="load a state saved with the same strategy")
            g.compressor.load_state_dict({k[len(head):]: v for k, v in sub.items()},
                                         where=f"load_synchronizer_state_dict: {prefix}")


class LocalReducer:
    """World size 1: no communication; only ``grad_weight`` is applied after backward."""

    def __init__(self, params: dict[str, nn.Parameter], stats: CommStats) -> None:
        self.params = list(params.values())
        self.stats = stats
        self.require_sync = True
        self.grad_weight = 1.0
        self.loss_scale = 1.0
        self.before_wait = None
        self._queued = False
        ref = weakref.ref(self)

        def hook(param: torch.Tensor, ref: weakref.ref = ref) -> None:
            reducer = ref()
            if reducer is not None and reducer.require_sync and not reducer._queued:
                reducer._queued = True
                _queue_callback(reducer._finish)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def prepare_for_forward(self) -> None:
        self._queued = False

    @torch.no_grad()
    def _finish(self) -> None:
        self._queued = False
        self.stats.steps += 1
        if self.grad_weight != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.grad_weight)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            import warnings

            warnings.warn("single-process run: synchronizer state (e.g. PowerSGD error "
                          "feedback) is not used and was ignored", stacklevel=3)


def check_params(plan: Plan, module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's trainable parameters by name, checked against the plan."""
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if tuple(params) != plan.params:
        missing = [n for n in plan.params if n not in params]
        extra = [n for n in params if n not in plan.params]
        raise StrategyError(
            f"the plan was compiled for another model (missing {missing[:3]}, unplanned "
            f"{extra[:3]}, or a different order)", where="DistributedModel",
            fix="compile the plan from analyze(model) of this very model")
    device = torch.device(plan.device)
    for name, p in params.items():
        if p.device.type != device.type:
            raise StrategyError(f"parameter {name!r} is on {p.device}, the plan on {device}",
                                where="DistributedModel",
                                fix="move the model to the plan's device before wrapping it")
    return params
