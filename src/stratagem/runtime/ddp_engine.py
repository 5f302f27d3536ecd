"""The ``ddp`` engine: torch's DistributedDataParallel reducer runs a plan's all-reduce groups.

Stratagem's own reducer (runtime/allreduce.py) runs a Python hook per parameter; on models
with many small tensors that costs more than DDP's C++ reducer. A strategy whose all-reduce
synchronizers say ``engine: ddp`` is executed by DDP instead:

* the parameters of the plan's groups are wrapped in ``DistributedDataParallel``; the others
  (parameter-server pieces) are on DDP's ignore list and stay with their engine;
* DDP's buckets are the groups, in the plan's launch order: one per-bucket size limit
  per group (``bucket_cap_mb_list``), DDP filling its buckets with the parameters in
  reverse registration order as the plan does (:func:`bucket_caps`). Plain DDP's 1 MiB
  first bucket is a group of the strategy's own (``AllReduce(first_bucket_bytes=...)``),
  so Auto can price layouts with and without it;
* the reduction is C++ where nothing needs Python (:func:`hook_rule`): without a
  compressor, DDP's own reducer with no comm hook (as plain DDP); with ``fp16``, torch's
  built-in C++ ``FP16_COMPRESS`` hook. ``grad_weight`` is then applied by a hook per
  parameter while it is not 1, and one parameter hook per backward starts the end-of-
  backward work (buffers, traffic counts). Gradient observers (the adaptive loop's local
  statistics, no extra pass), ``bf16`` and PowerSGD need the bucket in Python: torch's
  Python hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
  ``powerSGD_hook``) are called from one hook of this runtime that first applies
  ``grad_weight``, shows the bucket to the observers and counts the traffic. DDP takes
  one hook, once: the choice is made at the first synced training forward
  (:attr:`DDPReducer.hook_name` says it), and observers added later get a new DDP;
* the options are :data:`stratagem.runtime.plan.DDP_OPTIONS` (the plan summary lists them).

Buffers, the scaler's shared skip decision, ``no_sync``, gradient observers, ``grad_weight``,
synchronizer state (PowerSGD's) and rebuilding on a new world work as with Stratagem's own
reducer (:class:`~stratagem.runtime.model.DistributedModel` drives both). Differences,
as in DDP: ``no_sync`` applies to the forward passes run inside it, and every parameter
must get a gradient in every synced backward.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from stratagem.errors import CheckpointError, DistributedError
from stratagem.runtime.allreduce import GradObserver
from stratagem.runtime.plan import DDP_OPTIONS, GroupPlan, Member, Plan, hook_rule
from stratagem.runtime.stats import CommStats

POWERSGD_START = 2
"""torch's PowerSGD runs plain all-reduce before this step (2 is the least it allows with
error feedback); after it, every step is compressed, like Stratagem's own PowerSGD."""

_BUCKET_IDS = 1_000_000  # observer group ids of DDP buckets start here (a layout each)

BUILTIN_HOOKS: dict[str, Any] = {"none": None,
                                 "fp16": dist.BuiltinCommHookType.FP16_COMPRESS}
"""Compressors DDP runs in C++: ``none`` is DDP's own reducer with no hook at all (as plain
DDP), ``fp16`` its built-in ``FP16_COMPRESS`` hook. Others need torch's Python hooks."""

PYTHON_HOOK = "python"


def bucket_caps(plan: Plan) -> list[int]:
    """Bucket size limits in bytes, in launch order, for DDP's ``bucket_cap_mb_list``: the
    groups' exact sizes (DDP closes a bucket once it reaches its limit)."""
    return [max(g.nbytes, 1) for g in plan.groups]


def _queue_callback(fn: Any) -> None:
    """Run ``fn`` when the current backward pass ends (after the callbacks queued before)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _started(ref: Any) -> Any:
    """A parameter hook of the C++ path: a synced backward reached this parameter."""
    def hook(param: nn.Parameter) -> None:
        reducer = ref()
        if reducer is not None and reducer._armed and not reducer._queued:
            reducer._queued = True
            _queue_callback(reducer._after_hooks)
    return hook


def _weigh(ref: Any) -> Any:
    """A parameter hook of the C++ path: ``grad_weight`` on the (accumulated) gradient of a
    synced backward, before DDP copies it into its bucket."""
    def hook(param: nn.Parameter) -> None:
        reducer = ref()
        if reducer is not None and reducer._armed and reducer.grad_weight != 1.0 \
                and param.grad is not None:
            param.grad.mul_(reducer.grad_weight)
    return hook


def _hook(ref, bucket):  # (unannotated: DDP checks the annotations, and these are strings)
    """DDP's communication hook: the engine's own (``DDPReducer._reduce``)."""
    reducer = ref()
    if reducer is None:  # (the model was rebuilt; DDP keeps the hook until it goes)
        raise DistributedError("a DDP engine that was replaced ran a backward",
                               where="DistributedModel backward",
                               fix="run backward through the current DistributedModel")
    return reducer._reduce(bucket)


class DDPReducer:
    """Runs a plan whose all-reduce groups are on the ``ddp`` engine (module docstring)."""

    def __init__(self, plan: Plan, module: nn.Module, params: dict[str, nn.Parameter],
                 process_group: dist.ProcessGroup | None, stats: CommStats) -> None:
        self.plan = plan
        self.stats = stats
        self.world_size = plan.world_size
        self.module = module
        wrapped = {m.param for g in plan.groups for m in g.members}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, [n for n in params if n not in wrapped])
        group = process_group if process_group is not None else dist.group.WORLD
        if plan.ps is not None:  # the PS engine's traffic on the default group stays apart
            group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        self.group = group
        self.ddp: DistributedDataParallel | None = self._make_ddp()
        compressor = plan.groups[0].compressor
        self._powersgd: powerSGD_hook.PowerSGDState | None = None
        if compressor == "powersgd":
            self._powersgd = powerSGD_hook.PowerSGDState(
                group, matrix_approximation_rank=plan.groups[0].powersgd_rank,
                start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True)
        self._owner: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters
        self._stash: dict[tuple[str, ...], tuple[Any, Any, Any]] = {}  # state set aside
        self._compress = {"none": default_hooks.allreduce_hook,
                          "fp16": default_hooks.fp16_compress_hook,
                          "bf16": default_hooks.bf16_compress_hook}.get(compressor)
        self._wire_bytes = {"fp16": 2, "bf16": 2}.get(compressor)
        self._builtin = compressor in BUILTIN_HOOKS
        self.hook: str | None = None  # decided at the first synced forward (hook_name)
        self._wrapped = [p for n, p in params.items() if n in wrapped]
        self._handles: list[Any] = []  # parameter hooks of the C++ path (_choose_hook)
        self._weighting = False  # grad_weight hooks installed (_choose_hook)
        self._armed = False  # the last forward prepared a synced backward
        wire = self._wire_bytes
        self._bucket_bytes = [g.numel * wire if wire else g.nbytes
                              for g in plan.groups]  # (the C++ path's counts)
        self._names = {id(p): n for n, p in params.items()}
        self._layouts: dict[tuple[int, tuple[str, ...]], GroupPlan] = {}
        self.grad_weight = 1.0
        self.loss_scale = 1.0
        self.before_wait: Any = None
        self.observers: list[GradObserver] = []
        self._queued = False
        self._backwards = 0  # synced backward passes of this DDP
        self._reduced: list[tuple[int, GroupPlan, Any]] = []
        self._finish_extra: Any = None

    def _make_ddp(self) -> DistributedDataParallel:
        # Size limits in launch order: each group one bucket (bucket_caps).
        caps = [c / 2**20 for c in bucket_caps(self.plan)]  # (MiB as floats: torch takes MiB)
        return DistributedDataParallel(
            self.module, process_group=self.group, init_sync=False,
            forward_sync_buffers=False, bucket_cap_mb_list=caps, **asdict(DDP_OPTIONS))

    # -- which hook: C++ where nothing needs Python ------------------------------------
    @property
    def hook_name(self) -> str:
        """How the buckets are reduced: DDP's C++ reducer (no hook), torch's built-in C++
        FP16_COMPRESS hook, or this runtime's Python hook around torch's Python hooks
        (``undecided`` before the first synced training forward)."""
        if self.hook is None:
            return "undecided"
        if self.hook == PYTHON_HOOK:
            return f"python ({hook_rule(self.plan.groups[0].compressor).split(';')[0]})"
        return self.hook

    def _choose_hook(self) -> None:
        """At a synced training forward: register the communication hook. DDP takes one,
        once, before its first backward, so the choice waits until the gradient observers
        are known; observers added after the C++ path was chosen get a new DDP (call
        ``add_grad_observer`` on every rank before the same step, as the adaptive loop
        does: a new DDP re-cuts its buckets after its first step, a collective)."""
        if self.hook is not None:
            if self.hook == PYTHON_HOOK or not self.observers:
                return
            self._rebuild()
        assert self.ddp is not None
        if not self._builtin or self.observers:
            self.ddp.register_comm_hook(weakref.ref(self), _hook)
            self.hook = PYTHON_HOOK
            return
        kind = BUILTIN_HOOKS[self.plan.groups[0].compressor]
        if kind is not None:
            self.ddp._register_builtin_comm_hook(kind)
            self.hook = "c++ FP16_COMPRESS hook"
        else:
            self.hook = "c++ reducer, no hook"
        # One Python call per backward (the end-of-backward work: buffers, counts), and
        # grad_weight's scaling per parameter only while a weight is set (_weigh).
        ref = weakref.ref(self)
        self._handles.append(self._wrapped[0].register_post_accumulate_grad_hook(
            _started(ref)))

    def _weigh_gradients(self) -> None:
        """The C++ path with ``grad_weight != 1``: scale each gradient in a hook of its
        own (rank-local, unlike a change of DDP's hook); kept once installed."""
        if self._weighting or self.hook == PYTHON_HOOK or self.grad_weight == 1.0:
            return
        ref = weakref.ref(self)
        self._handles.extend(p.register_post_accumulate_grad_hook(_weigh(ref))
                             for p in self._wrapped)
        self._weighting = True

    def _drop_param_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._weighting = False

    def _rebuild(self) -> None:
        """A new DDP for the same plan (the old one's hook cannot change)."""
        sync = self.require_sync
        self._drop_param_hooks()
        self.ddp = None
        gc.collect()  # (the old reducer's autograd hooks go with it)
        self.ddp = self._make_ddp()
        self.require_sync = sync
        self.hook = None

    # -- the user's settings ---------------------------------------------------------
    @property
    def require_sync(self) -> bool:
        return self.ddp is None or self.ddp.require_backward_grad_sync

    @require_sync.setter
    def require_sync(self, value: bool) -> None:
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = bool(value)

    def remove_hooks(self) -> None:
        """Drop DDP (its C++ reducer removes its autograd hooks as it goes)."""
        if self.ddp is None:
            return
        self._drop_param_hooks()
        self.ddp = None
        self.module.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
        gc.collect()  # DDP's reference cycles: its reducer must go now, not later

    # -- forward ------------------------------------------------------------------------
    def prepare_for_forward(self) -> None:
        self._armed = False  # (set again by forward() where DDP prepares a synced backward)
        self._queued = False
        self._reduced.clear()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward through DDP (which prepares its reducer for backward)."""
        assert self.ddp is not None
        self._choose_hook()
        self._weigh_gradients()
        self._armed = self.ddp.require_backward_grad_sync
        try:
            return self.ddp(*args, **kwargs)
        except RuntimeError as exc:
            if "finished reduction in the prior iteration" not in str(exc):
                raise
            raise DistributedError(
                "the last synced backward left some parameter without a gradient; the ddp "
                "engine reduces every parameter in every step", where="DistributedModel",
                fix="use engine: stratagem for models with parameters unused in some steps, "
                    "or make every parameter take part in the loss") from None

    # -- backward (called by DDP per bucket) -----------------------------------------------
    def _layout(self, bucket: dist.GradBucket) -> GroupPlan:
        """The bucket as a group plan for gradient observers: members at their offsets."""
        buf = bucket.buffer()
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        key = (bucket.index(), names)
        plan = self._layouts.get(key)
        if plan is None:
            members = tuple(
                Member(param=n, index=self.plan.params.index(n), shape=tuple(p.shape),
                       offset=g.storage_offset() - buf.storage_offset())
                for n, p, g in zip(names, bucket.parameters(), bucket.gradients(),
                                   strict=True))
            first = self.plan.groups[0]
            plan = GroupPlan(id=_BUCKET_IDS + len(self._layouts), spec=first.spec,
                             backend=first.backend, compressor=first.compressor,
                             powersgd_rank=first.powersgd_rank,
                             dtype=str(buf.dtype).removeprefix("torch."), members=members,
                             engine="ddp")
            self._layouts[key] = plan
        return plan

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if not self._queued:
            self._queued = True
            _queue_callback(self._after_hooks)
        buf = bucket.buffer()
        if self.grad_weight != 1.0:
            buf.mul_(self.grad_weight)  # (the hooks divide by the world size)
        layout = self._layout(bucket) if self.observers else None
        if layout is not None:
            for fn in self.observers:
                fn("local", layout, buf, self.grad_weight * self.loss_scale)
        size = self._wire_bytes or buf.element_size()
        self.stats.record(buf.numel() * size, self.world_size)
        self.stats.overlapped += 1
        if self._powersgd is not None and (self._backwards or
                                           self._powersgd.iter < POWERSGD_START):
            self._own_state(bucket)
            fut = powerSGD_hook.powerSGD_hook(self._powersgd, bucket)
            # Its rounds are launched from future callbacks: two buckets' rounds in flight
            # at once reach gloo in an order that differs from rank to rank (a hang), so
            # each bucket's rounds finish before the next bucket starts.
            fut.wait()
        else:  # (PowerSGD restored into a new DDP: its first step, see _own_state)
            fut = (self._compress or default_hooks.allreduce_hook)(self.group, bucket)
        if layout is None:
            return fut

        def keep(f: torch.futures.Future, layout: GroupPlan = layout,
                 index: int = bucket.index()) -> torch.Tensor:
            out = f.value()
            self._reduced.append((index, layout, out))
            return out

        return fut.then(keep)

    def _after_hooks(self) -> None:
        """End of backward, before DDP's own finalization: buffers, then wait for DDP."""
        self._finish_extra = self.before_wait() if self.before_wait is not None else None
        _queue_callback(self._after_ddp)  # runs after DDP's (queued when its last bucket was)

    def _after_ddp(self) -> None:
        try:
            if self.hook != PYTHON_HOOK:  # (the Python hook counted each bucket)
                for nbytes in self._bucket_bytes:
                    self.stats.record(nbytes, self.world_size)
                    self.stats.overlapped += 1
            self._reduced.sort(key=lambda r: r[0])  # (futures complete in any order)
            for fn in self.observers:
                for _, layout, out in self._reduced:
                    fn("reduced", layout, out, self.loss_scale)
            if self._finish_extra is not None:
                self._finish_extra()
            self.stats.steps += 1
            self._backwards += 1
        finally:
            self._finish_extra = None
            self._reduced.clear()
            self._queued = False
            self._armed = False

    # -- state (PowerSGD's error feedback and warm-start factors) -----------------------
    # torch keys PowerSGD's per-bucket state by bucket index, and DDP re-cuts its buckets
    # once, after its first step. So the state is kept and saved by the bucket's parameter
    # names: before each bucket is compressed, the entries at its index are made that
    # bucket's own. A new DDP given PowerSGD state (a restored checkpoint) reduces its first
    # step uncompressed: its first buckets are not those the state was saved for.
    def _own_state(self, bucket: dist.GradBucket) -> None:
        s = self._powersgd
        assert s is not None
        index = bucket.index()
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        if self._owner.get(index) == names:
            return
        dicts = (s.error_dict, s.p_memory_dict, s.q_memory_dict)
        held = self._owner.pop(index, None)
        if held is not None:  # another bucket's state: put it aside
            self._stash[held] = tuple(d.pop(index, None) for d in dicts)
        for other, owned in list(self._owner.items()):
            if owned == names:  # this bucket's state sits at its old index
                self._stash[names] = tuple(d.pop(other, None) for d in dicts)
                del self._owner[other]
        for d, value in zip(dicts, self._stash.pop(names, (None, None, None)), strict=True):
            if value is not None:
                d[index] = value
            else:
                d.pop(index, None)
        self._owner[index] = names

    def _entries(self) -> dict[tuple[str, ...], tuple[Any, Any, Any]]:
        s = self._powersgd
        assert s is not None
        out = dict(self._stash)
        for index, names in self._owner.items():
            out[names] = (s.error_dict.get(index), s.p_memory_dict.get(index),
                          s.q_memory_dict.get(index))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``ddp.powersgd.iter``, and ``ddp.powersgd.{error,p,q}:NAME|NAME...`` per bucket
        (named by its parameters)."""
        s = self._powersgd
        if s is None:
            return {}
        out = {"ddp.powersgd.iter": torch.tensor(s.iter)}
        for names, values in self._entries().items():
            for kind, t in zip(("error", "p", "q"), values, strict=True):
                if t is not None:
                    out[f"ddp.powersgd.{kind}:{'|'.join(names)}"] = t.detach().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        s = self._powersgd
        if s is None:
            if state:
                raise CheckpointError(f"synchronizer state {sorted(state)[:3]} for a model "
                                      "without PowerSGD", where="load_synchronizer_state_dict",
                                      fix="load a state saved with the same strategy")
            return
        stash: dict[tuple[str, ...], list[Any]] = {}
        kinds = ("error", "p", "q")
        for key, value in state.items():
            if key == "ddp.powersgd.iter":
                continue
            head, _, names = key.partition(":")
            kind = head.removeprefix("ddp.powersgd.")
            if not head.startswith("ddp.powersgd.") or kind not in kinds or not names:
                raise CheckpointError(f"synchronizer state {key!r} is not the ddp engine's "
                                      "PowerSGD state", where="load_synchronizer_state_dict",
                                      fix="load a state saved with the same strategy and "
                                          "engine")
            entry = stash.setdefault(tuple(names.split("|")), [None, None, None])
            entry[kinds.index(kind)] = value.detach().clone()
        s.iter = int(state["ddp.powersgd.iter"]) if "ddp.powersgd.iter" in state else 0
        s.error_dict, s.p_memory_dict, s.q_memory_dict = {}, {}, {}
        self._owner = {}
        self._stash = {names: tuple(v) for names, v in stash.items()}
