"""DistributedModel: the user's module plus the synchronizers of its plan."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.distributed.process_group import comm_device
from stratagem.errors import StratagemError, UnsupportedModelError
from stratagem.runtime.allreduce import AllReduceReducer, LocalReducer, check_params
from stratagem.runtime.comm import (
    SHARDED_BROADCAST_BYTES,
    BufferSync,
    broadcast_coalesced,
    make_comms,
)
from stratagem.runtime.ddp_engine import DDPReducer
from stratagem.runtime.materialize import MetaInit, has_meta, materialize, rebind
from stratagem.runtime.plan import Plan
from stratagem.runtime.stats import CommStats


class DistributedModel(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves gradients averaged across replicas.

    At construction, parameters and buffers are broadcast from rank 0 (so differently
    seeded replicas start equal). With ``plan.world_size == 1`` no process group is needed
    and nothing is communicated.

    Buffers (e.g. BatchNorm running statistics) follow DDP's ``broadcast_buffers``: every
    forward sees rank 0's buffers. Each replica normalizes with its own batch statistics in
    training mode; after a training-mode forward, rank 0's updated buffers are broadcast at
    the end of the next synced backward (or, if no backward came, before the next forward).
    So between steps all replicas hold rank 0's buffers -- identical, also after training
    -- and running statistics are estimated from rank 0's batches only (use SyncBatchNorm
    for statistics over the global batch). Eval-mode forwards communicate nothing, so
    evaluating on rank 0 alone is safe.

    Parameters with PS synchronizers (``plan.ps``) are run by a parameter-server engine
    (see docs/concepts/parameter-server.md); it needs the user's ``optimizer`` (one or a
    sequence), whose ``step()`` triggers the owners' update, and a ``cluster`` when the job
    has dedicated servers (from ``join_cluster``; default: the workers' default group).
    """

    def __init__(self, module: nn.Module, plan: Plan,
                 process_group: dist.ProcessGroup | None = None, *,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
                 cluster: Any = None, materialize: MetaInit | None = None) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.comm_stats = CommStats()
        if plan.role != "worker":
            raise StratagemError(f"the plan is for a parameter server (rank {plan.rank})",
                                 where="DistributedModel",
                                 fix="run it with stratagem.runtime.ps.run_server")
        self._process_group = process_group
        self._shard = None
        self._awaiting_regroup = False  # stage 3 gathered by before_regroup, not resharded
        self._optimizer = optimizer  # sharding needs it again after a regroup
        built = self._materialize(optimizer, materialize)
        params = check_params(plan, module)
        self._ps = None
        if plan.ps is not None and (plan.world_size > 1 or plan.ps.servers):
            from stratagem.runtime.ps import make_engine

            self._ps = make_engine(plan, module, optimizer, cluster, process_group,
                                   self.comm_stats)
        # A PS engine broadcast everything already (servers included).
        self._install_synchronizers(params, process_group, broadcast=self._ps is None,
                                    sharded=built)
        if not built:
            self._install_sharding(params, optimizer)
        self._scaler_link: Any = None
        self._first_training_forward: Callable[[tuple, dict], None] | None = None
        self._hand_optimizer_state_to_owners()
        # The initial broadcast is not training traffic.
        self.comm_stats.reset()

    def _materialize(self, optimizer: Any, options: MetaInit | None) -> bool:
        """Values for a model built on the meta device (runtime/materialize.py): stage-3
        units sharded as they get them, by the sharding engine, made here first. Whether
        that engine exists now (its units already sharded)."""
        module, plan = self.module, self.plan
        if not has_meta(module):
            return False
        if options is None:
            raise StratagemError(
                "the model is on the meta device (no values)", where="DistributedModel",
                fix="pass materialize=MetaInit(seed=...) so that each worker gives it values "
                    "(docs/how-to/meta-device.md), or build it on a real device")
        if plan.ps is not None:
            raise StratagemError(
                "a meta-device model with parameter-server synchronizers",
                where="DistributedModel(materialize=...)",
                fix="build the model on a real device for parameter-server strategies")
        meta = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if plan.shards is not None and plan.world_size > 1:
            from stratagem.runtime.sharded import ShardEngine

            self._shard = ShardEngine(plan, module, meta, optimizer, self._process_group,
                                      meta=options)
            return True
        from stratagem.runtime.sharded import optimizers_of

        materialize(module, options, torch.device(plan.device))
        rebind(optimizers_of(optimizer), meta, dict(module.named_parameters()))
        return False

    def _install_synchronizers(self, params: dict[str, nn.Parameter],
                               process_group: dist.ProcessGroup | None, *,
                               broadcast: bool, sharded: bool = False) -> None:
        """The all-reduce synchronizers of ``self.plan`` (a local one in a one-process job
        without servers); with ``broadcast``, rank 0's parameters and buffers first (with
        ``sharded``, stage 3 sharded already: its shards, every worker's own, are not
        broadcast)."""
        plan = self.plan
        self._buffer_sync: BufferSync | None = None
        self._buffers_dirty = False
        if plan.world_size == 1 and not (plan.ps is not None and plan.ps.servers):
            self._reducer: AllReduceReducer | LocalReducer | DDPReducer = LocalReducer(
                params, self.comm_stats)
            return
        default, comms = make_comms(plan, process_group, self.comm_stats)
        if broadcast:
            states = list(dict.fromkeys([*self.module.parameters(), *self.module.buffers()]))
            if sharded:
                from torch.distributed.tensor import DTensor

                states = [t for t in states if not isinstance(t, DTensor)]
            if plan.shards is None:
                broadcast_coalesced([t for t in states if t.numel()], default)
            else:  # a few MB at a time: the model may not fit twice
                broadcast_coalesced([t for t in states if t.numel()], default,
                                    limit=SHARDED_BROADCAST_BYTES, overlap=False)
        if plan.engine == "ddp":  # torch's reducer runs the groups (runtime/ddp_engine.py)
            self._reducer = DDPReducer(plan, self.module, params, process_group,
                                       self.comm_stats)
        else:
            self._reducer = AllReduceReducer(plan, params, comms, self.comm_stats)
        self._buffer_sync = BufferSync(self.module, default)
        self._reducer.before_wait = self._sync_buffers_if_dirty

    def _install_sharding(self, params: dict[str, nn.Parameter], optimizer: Any) -> None:
        """The sharded parameters' engine (runtime/sharded.py), after the broadcast: FSDP2
        shards the values every rank then holds."""
        if self.plan.shards is None or self.plan.world_size == 1:
            return
        from stratagem.runtime.shard_state import drop_foreign_state
        from stratagem.runtime.sharded import ShardEngine, optimizers_of

        self._shard = ShardEngine(self.plan, self.module, params, optimizer,
                                  self._process_group)
        layout = self._layout()
        for opt in optimizers_of(optimizer):  # (state a regroup or replan brought along)
            drop_foreign_state(opt, layout.owners, layout.names, layout.rank)

    def regroup(self, plan: Plan, process_group: dist.ProcessGroup | None = None, *,
                broadcast: bool = True) -> None:
        """Re-bind to a new process group and world size (in-process rescale, see
        :mod:`stratagem.adapt.rescale`): ``plan`` (compiled for the new rank and world)
        replaces the current one and its synchronizers the old ones; the optimizer and
        gradient observers (their handles too) stay. With ``broadcast``, parameters and
        buffers are broadcast from the new rank 0. Per-rank synchronizer state (PowerSGD
        error feedback) starts fresh.

        Collective over ``process_group`` (default: the default group) when
        ``plan.world_size > 1``. All-reduce and ZeRO strategies: with sharding, call
        :meth:`before_regroup` in the old group first (every rank then holds the whole
        parameters and optimizer state, and the new plan's sharding cuts its share; FSDP2
        shards stage-3 units of a model rebuilt plain, so ``.module`` is then a new
        object). Raises StratagemError with parameter-server synchronizers, or when
        stage-3 units are still sharded over the old group."""
        if self._ps is not None or plan.ps is not None:
            raise _no_in_process_rescale("DistributedModel.regroup")
        if self._shard is not None and self._shard.shards.units:
            raise StratagemError(
                "stage-3 (FSDP2) units are still sharded over the old process group",
                where="DistributedModel.regroup",
                fix="call before_regroup() in the old group first (the elastic job "
                    "lifecycle does): it gathers the units whole on every rank")
        params = check_params(plan, self.module)
        old = self._reducer
        old.remove_hooks()
        if self._shard is not None:
            self._shard.remove_hooks()
            self._shard = None
        self.plan = plan
        self._install_synchronizers(params, process_group, broadcast=broadcast)
        self._process_group = process_group
        self._install_sharding(params, self._optimizer)
        self._carry_over(old, settings=False)
        self._awaiting_regroup = False

    def before_regroup(self) -> None:
        """Collective over the current group, before an in-process rescale replaces it:
        every rank's optimizer takes the state of the stage-1/2 parameters other ranks own
        (those may leave), and stage-3 units are gathered whole -- the model is rebuilt
        plain (a new ``.module``, see runtime/skeleton.py), its optimizer holding the
        whole state -- so that any survivor can hand everything on. Until
        :meth:`regroup`, the model refuses to train (its stage-3 gradients would not be
        synchronized)."""
        if self._ps is not None:
            raise _no_in_process_rescale("DistributedModel.before_regroup")
        if self._shard is None:
            return
        for opt in self._shard.optimizers:
            self._gather_owned_state(opt)
        if self._shard.shards.units:
            self.module = self._shard.unshard(self.module)
            self._shard = None  # (its hooks went with it)
            self._awaiting_regroup = True

    def replan(self, make_plan: Callable[[], Plan], *,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
               cluster: Any = None) -> None:
        """Switch to the plan ``make_plan()`` returns, for the same rank and world (Auto
        planning on the first batch). The current synchronizers are removed first, so that
        ``make_plan`` may run the plain module (calibration, trial steps); values are not
        broadcast again (every rank holds rank 0's already). Between steps only; the
        optimizer (its state too: parameter-server owners take theirs), gradient
        observers, ``no_sync`` and ``grad_weight`` carry over. If
        ``make_plan`` raises, the current plan is put back. All-reduce models only: with
        parameter-server synchronizers raises StratagemError."""
        if self._ps is not None or self._shard is not None:
            raise StratagemError("replan needs a model without parameter-server or sharded "
                                 "synchronizers", where="DistributedModel.replan",
                                 fix="save a checkpoint and restart with the new strategy")
        old = self._reducer
        old.remove_hooks()
        try:
            plan = make_plan()
            if (plan.rank, plan.world_size) != (self.plan.rank, self.plan.world_size):
                raise StratagemError(
                    f"the new plan is for rank {plan.rank} of {plan.world_size}, this model "
                    f"is rank {self.plan.rank} of {self.plan.world_size}",
                    where="DistributedModel.replan",
                    fix="compile the plan for this rank and world size (regroup() changes "
                        "the world)")
            params = check_params(plan, self.module)
        except BaseException:
            self._install_synchronizers(check_params(self.plan, self.module),
                                        self._process_group, broadcast=False)
            self._carry_over(old)
            raise
        self.plan = plan
        if plan.ps is not None and (plan.world_size > 1 or plan.ps.servers):
            from stratagem.runtime.ps import make_engine

            self._ps = make_engine(plan, self.module, optimizer, cluster,
                                   self._process_group, self.comm_stats)
        self._install_synchronizers(params, self._process_group, broadcast=False)
        self._install_sharding(params, optimizer)
        self._hand_optimizer_state_to_owners()
        self._carry_over(old)
        if self._scaler_link is not None:  # its hooks follow the new synchronizers
            self.attach_scaler(self._scaler_link.scaler)
        self.comm_stats.reset()

    def _hand_optimizer_state_to_owners(self) -> None:
        """A new parameter-server engine's owners start with empty optimizer state. When
        the user's optimizer already holds state for PS parameters (a resumed job whose
        Auto plan switches to servers on its first batch; an optimizer trained before the
        model was wrapped), the owners take it, as after a restore -- else Adam's moments
        and step counts would silently start over. Collective: the workers agree first."""
        if self._ps is None:
            return
        held = self._ps.holds_user_state()
        if self.plan.world_size > 1:
            group = self._process_group or dist.group.WORLD
            flag = torch.tensor([1.0 if held else 0.0], device=comm_device(group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            held = bool(flag.item())
        if held:
            self._ps.after_restore()

    def _carry_over(self, old: AllReduceReducer | LocalReducer | DDPReducer,
                    settings: bool = True) -> None:
        """What the user set on the replaced reducer: gradient observers, and with
        ``settings`` no_sync and grad_weight (a new world resets them)."""
        observers = getattr(old, "observers", None)
        if observers is not None and hasattr(self._reducer, "observers"):
            self._reducer.observers = observers  # (their handles keep working)
        if not settings:
            return
        self._reducer.require_sync = old.require_sync
        self._reducer.grad_weight = old.grad_weight
        if self._ps is not None:
            self._ps.require_sync = old.require_sync
            self._ps.grad_weight = old.grad_weight

    def on_first_training_forward(self, fn: Callable[[tuple, dict], None] | None) -> None:
        """Call ``fn(args, kwargs)`` once, at the start of the next forward in training
        mode with gradients enabled (before any synchronizer runs): Auto plans on it."""
        self._first_training_forward = fn

    # -- training ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._awaiting_regroup:
            raise StratagemError(
                "the model's stage-3 units were gathered for a rescale (before_regroup) and "
                "it has not been re-bound to the new group yet", where="DistributedModel",
                fix="call regroup(plan) with the new group's plan before training again")
        fn = self._first_training_forward
        if fn is not None and self.module.training and torch.is_grad_enabled():
            self._first_training_forward = None
            fn(args, kwargs)
        self._reducer.prepare_for_forward()
        if self._shard is not None:
            self._shard.prepare_for_forward()
        if self._scaler_link is not None:
            self._scaler_link.before_forward()
        if self._ps is not None:
            self._ps.before_forward()
        if self._buffers_dirty:
            finish = self._sync_buffers_if_dirty()
            if finish is not None:
                finish()
        if (isinstance(self._reducer, DDPReducer) and self.module.training
                and torch.is_grad_enabled()):
            out = self._reducer.forward(*args, **kwargs)  # DDP prepares its backward
        else:
            out = self.module(*args, **kwargs)
        if self._ps is not None:
            self._ps.after_forward()
        if self._buffer_sync is not None and self.module.training:
            self._buffers_dirty = True
        return out

    def _sync_buffers_if_dirty(self):  # -> Callable[[], None] | None
        if not self._buffers_dirty or self._buffer_sync is None:
            return None
        self._buffers_dirty = False
        if not self._buffer_sync:
            return None
        return self._buffer_sync.launch()

    def add_grad_observer(self, fn: Any) -> Any:
        """Call ``fn(event, group, buffer, scale)`` for every all-reduced gradient group of
        each synced backward: ``"local"`` right before the group's collective (``buffer`` =
        ``scale`` x this rank's gradient) and ``"reduced"`` after it (the average). Used by
        ``stratagem.adapt`` for gradient statistics; ``fn`` must not modify the buffer.
        Groups synced otherwise (one process, parameter servers) are not observed.
        Returns a handle whose ``remove()`` detaches ``fn``."""
        observers = getattr(self._reducer, "observers", None)
        if observers is None:
            observers = []
        observers.append(fn)
        return _ObserverHandle(observers, fn)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient sync inside the block; gradients accumulate locally and the next
        synced backward averages the accumulated sum."""
        previous = self._reducer.require_sync
        self._reducer.require_sync = False
        if self._ps is not None:
            self._ps.require_sync = False
        if self._shard is not None:
            self._shard.require_sync = False
            self._shard.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._reducer.require_sync = previous
            if self._ps is not None:
                self._ps.require_sync = previous
            if self._shard is not None:
                self._shard.require_sync = previous
                self._shard.set_requires_gradient_sync(previous)

    @property
    def grad_weight(self) -> float:
        """Multiplier on this rank's gradient before averaging (``local_n*world/global_n``
        for uneven local batches; the weights of all ranks must sum to the world size)."""
        return self._reducer.grad_weight

    @grad_weight.setter
    def grad_weight(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise StratagemError(f"grad_weight must be finite and >= 0, got {value}",
                                 where="DistributedModel.grad_weight",
                                 fix="use local_n * world_size / global_n")
        if self._shard is not None:
            self._shard.set_grad_weight(value)
        self._reducer.grad_weight = value
        if self._ps is not None:
            self._ps.grad_weight = value

    # -- mixed precision -----------------------------------------------------------------
    def attach_scaler(self, scaler: Any) -> None:
        """Use ``scaler`` (a ``torch.amp.GradScaler``) with this model: its inf/NaN
        decision becomes the same on every rank and parameter-server owner (a step skipped
        on one is skipped on all), PS gradients and gradient statistics are unscaled, and
        ``stratagem.checkpoint.save`` saves it. ``None`` detaches the current one. See
        docs/how-to/mixed-precision.md and runtime/amp.py."""
        from stratagem.runtime.amp import ScalerLink

        if self._scaler_link is not None:
            self._scaler_link.detach()
            self._scaler_link = None
        if scaler is not None:
            self._scaler_link = ScalerLink(self, scaler, self._process_group)

    @property
    def scaler(self) -> Any:
        """The attached GradScaler (None without one)."""
        return self._scaler_link.scaler if self._scaler_link is not None else None

    # -- parameter servers ---------------------------------------------------------------
    @property
    def server_parameters(self) -> list[str]:
        """Parameters synchronized by parameter servers: after backward their ``.grad`` is
        None on the workers (their owners hold the gradient), so gradient clipping,
        gradient observers and other ``.grad`` readers see the all-reduced ones only."""
        if self._ps is None:
            return []
        return sorted({p.param for p in self.plan.ps.pieces})

    def wait_for_values(self) -> None:
        """Wait for the parameter values the last update sends to this worker (the next
        forward would; call it to time a whole step, or before reading pulled values)."""
        if self._ps is not None:
            self._ps.finish_pulls()

    def refresh_parameters(self) -> None:
        """Collective (every worker): make each worker's copy of every PS parameter equal to
        its owners' values (sparse tables are otherwise only fresh in the rows pulled)."""
        if self._ps is not None:
            self._ps.refresh()

    def before_checkpoint(self) -> None:
        """Before saving, on this rank alone: its copy of every PS parameter becomes
        current (the optimizers' own ``state_dict()`` pre-hooks fetch the owners' optimizer
        state), so its ``state_dict()`` and ``optimizer.state_dict()`` are what one process
        would save. Called by ``stratagem.checkpoint.save`` and the elastic job state."""
        if self._ps is not None:
            self._ps.before_checkpoint()

    def after_restore(self) -> None:
        """Collective, after every worker loaded one checkpoint into the model and the
        optimizer: owners (dedicated servers too) take their slices, whatever the strategy
        that wrote it. Called by ``stratagem.checkpoint.load`` and the elastic job state."""
        if self._ps is not None:
            self._ps.after_restore()

    def close(self) -> None:
        """Finish pending parameter-server traffic, make this worker's copy of the PS
        parameters current and release the owners and dedicated servers (the chief sends
        them STOP); an owning worker serves the others' reads until they are done too. Also
        done at interpreter exit (without the copy). No-op without PS synchronizers."""
        if self._ps is not None:
            self._ps.close()

    # -- state -------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix).

        With PS synchronizers the values are current on this rank alone (a state-dict
        pre-hook on the module waits for pending values and fetches stale embedding rows
        from their owners), also while the other workers have left the training loop."""
        return self.module.state_dict(*args, **kwargs)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective with a sharded strategy: the module's state dict with every sharded
        tensor whole, as one process would save it (``torch.save`` it; a plain model of any
        world size loads it). Without stage-3 units, this rank's :meth:`state_dict`."""
        if self._shard is None:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return self._shard.full_state_dict(self.module)

    def load_full_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Collective with stage-3 units: load whole tensors (a :meth:`full_state_dict`
        saved by a job of any world size, or a plain model's ``state_dict()``) into this
        rank's shards."""
        if self._shard is None:
            self.module.load_state_dict(state_dict)
            return
        self._shard.load_full_state_dict(self.module, dict(state_dict))

    # -- sharded state (runtime/shard_state.py) -----------------------------------------
    @property
    def is_sharded(self) -> bool:
        """Whether some state is held by one worker or in slices (a sharded strategy on
        several workers): ``state_dict()`` and ``optimizer.state_dict()`` are then this
        rank's share, and checkpoints are written by every rank."""
        return self._shard is not None

    def _layout(self) -> Any:
        from stratagem.runtime.shard_state import ShardLayout

        owners = {o.param: o.owner for o in self.plan.shards.owned} \
            if self._shard is not None else {}
        return ShardLayout(self.module, owners, self.plan.rank if self._shard else 0,
                           self.plan.world_size if self._shard else 1)

    def sharded_model_state(self) -> dict[str, Any]:
        """This rank's pieces of the model state (each tensor written once over the ranks;
        ``stratagem.checkpoint.assemble_pieces`` joins them for any world size)."""
        from stratagem.runtime.shard_state import model_pieces

        return model_pieces(self.module, self._layout())

    def sharded_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's pieces of ``optimizer``'s state (see :meth:`sharded_model_state`)."""
        from stratagem.runtime.shard_state import optimizer_pieces

        return optimizer_pieces(optimizer, self._layout())

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective with a sharded strategy: ``optimizer``'s whole state dict, as one
        process's optimizer would save it (owners' state and stage-3 slices gathered);
        plain torch optimizers load it."""
        from stratagem.runtime.shard_state import drop_foreign_state
        from stratagem.runtime.sharded import whole_copy

        if self._shard is None:
            return optimizer.state_dict()
        self._gather_owned_state(optimizer)
        try:
            state = optimizer.state_dict()
            for entry in state["state"].values():
                for k, v in entry.items():
                    if torch.is_tensor(v):
                        entry[k] = whole_copy(v)
        finally:
            layout = self._layout()
            drop_foreign_state(optimizer, layout.owners, layout.names, layout.rank)
        return state

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                       state: Mapping[str, Any]) -> None:
        """Load a whole optimizer state dict (a plain process's, or
        :meth:`full_optimizer_state_dict` of any world size) into this rank's share."""
        from stratagem.runtime.shard_state import local_optimizer_state

        if self._shard is None:
            optimizer.load_state_dict(dict(state))
            return
        layout = self._layout()
        optimizer.load_state_dict(local_optimizer_state(
            optimizer, dict(state), layout.owners, layout.names, layout.rank, layout.world))

    # -- gradient statistics of sharded parameters (stratagem.adapt.gradient_stats) ------
    def sharded_gradient_params(self) -> dict[int, str]:
        """``id(param) -> name`` of the optimizer's stage-2 and stage-3 parameters: their
        gradients are never whole and averaged on every rank, so the gradient observers
        do not see them; :meth:`gradient_squares` does (empty without sharding)."""
        return {} if self._shard is None else self._shard.gradient_param_names

    def collect_gradient_squares(self, on: bool) -> None:
        """Collective: in the next backward, sum every stage-2/3 parameter's squared
        local gradient over the ranks onto the rank that holds its (averaged) gradient.
        A synced backward does it as it produces them (one extra reduce per parameter);
        after an unsynced one (the first micro-batch of an accumulated step), call
        :meth:`reduce_local_gradient_squares`. ``on=False`` stops it."""
        if self._shard is not None:
            self._shard.collect_squares(on)

    def accumulated_gradients(self) -> list[torch.Tensor]:
        """Every gradient accumulated on this rank so far: the parameters' ``.grad`` and,
        at stage 3, FSDP2's unsharded ones (where its accumulation keeps them)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if self._shard is not None:  # (once each: FSDP2 may have them registered now)
            seen = {id(g) for g in grads}
            grads += [g for g in self._shard.local_gradients() if id(g) not in seen]
        return grads

    def reduce_local_gradient_squares(self) -> None:
        """Collective, after an unsynced backward (under :meth:`no_sync`) that
        :meth:`collect_gradient_squares` armed: the stage-2 gradients, still local and
        whole on every rank, are reduced squared onto their owners now (stage 3 did it
        during backward, from FSDP2's unsharded gradients)."""
        if self._shard is not None:
            self._shard.reduce_local_squares()

    def gradient_squares(self) -> dict[int, torch.Tensor]:
        """After such a backward: ``id(param) -> sum over ranks of grad**2``, for the
        rows of each stage-2/3 gradient this rank holds (a stage-3 slice, an owned stage-2
        parameter)."""
        if self._shard is None or self._shard.squares is None:
            return {}
        names = {n: i for i, n in self.sharded_gradient_params().items()}
        return {names[n]: t for n, t in self._shard.squares.items() if n in names}

    def share_from_owners(self, optimizer: torch.optim.Optimizer,
                          values: list[list[torch.Tensor | None]]
                          ) -> list[list[torch.Tensor | None]]:
        """Collective: ``values`` (one per parameter, grouped like
        ``optimizer.param_groups``) with each stage-1 parameter's entry taken from its
        owner, the only rank holding its optimizer state (e.g. Adam's divisors)."""
        if self._shard is None:
            return values
        layout = self._layout()
        by_name = {}
        for gi, g in enumerate(optimizer.param_groups):
            for j, p in enumerate(g["params"]):
                by_name[layout.names.get(id(p), "")] = (gi, j)
        shared = self._shard.share_owned({n: values[gi][j] for n, (gi, j) in by_name.items()})
        out = [list(row) for row in values]
        for n, t in shared.items():
            if n in by_name:
                gi, j = by_name[n]
                out[gi][j] = t
        return out

    def _gather_owned_state(self, optimizer: torch.optim.Optimizer) -> None:
        from stratagem.runtime.shard_state import gather_owned_state

        layout = self._layout()
        if layout.owners:
            gather_owned_state(optimizer, layout.owners, layout.names, layout.rank,
                               self._shard.group, self._shard.global_ranks)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        if assign:
            raise UnsupportedModelError(
                "load_state_dict(assign=True) would replace the parameters the gradient "
                "hooks are attached to", where="DistributedModel.load_state_dict",
                fix="load into the plain model before wrapping it, or use assign=False")
        return self.module.load_state_dict(state_dict, strict=strict)

    def synchronizer_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's synchronizer state (PowerSGD error feedback, Q, step), as tensors."""
        return self._reducer.state_dict()

    def load_synchronizer_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._reducer.load_state_dict(state)

    def extra_repr(self) -> str:
        hook = getattr(self._reducer, "hook_name", None)
        return (f"rank={self.plan.rank}, world_size={self.plan.world_size}, "
                f"groups={len(self.plan.groups)}, engine={self.plan.engine}"
                + (f" ({hook})" if hook else ""))


def _no_in_process_rescale(where: str) -> StratagemError:
    """The refusal of an in-process rescale of a model with parameter servers."""
    return StratagemError("in-process rescale supports all-reduce and ZeRO strategies only",
                          where=where, fix="use checkpoint-restart (SIGTERM and relaunch) for "
                                           "jobs with parameter-server synchronizers")


class _ObserverHandle:
    """Detaches a gradient observer (see :meth:`DistributedModel.add_grad_observer`)."""

    def __init__(self, observers: list, fn: Any) -> None:
        self._observers, self._fn = observers, fn

    def remove(self) -> None:
        if self._fn in self._observers:
            self._observers.remove(self._fn)
