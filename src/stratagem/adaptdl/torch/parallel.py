"""AdaptDL's ``AdaptiveDataParallel`` on Stratagem's ``AutoDist.distribute``.

The model is distributed with the job's strategy (all-reduce by default; ``stratagem run
--strategy`` picks another). Model, optimizer, LR scheduler and AMP scaler are part of the
job state: saved on SIGTERM, restored after a restart with any number of replicas.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stratagem.adaptdl.torch import job
from stratagem.adaptdl.torch.scaling_rules import AdamScale, AdaScale, StatisticsView
from stratagem.elastic.context import MembershipChange, current_job
from stratagem.elastic.state import State, load_state, register_state


class ParallelState:
    """What AdaptDL programs read as ``model._state`` (AdaptDL's private
    ``_AdaptiveDataParallelState``): the wrapped ``model`` (not the parallel wrapper; what
    AdaptDL's NCF example saves), ``optimizer``, ``lr_scheduler``, ``mp_scaler``, and the
    last step's ``gain`` and ``lr_factor``. Read-only: the job state is saved by
    Stratagem."""

    def __init__(self, adp: AdaptiveDataParallel, lr_scheduler: Any, mp_scaler: Any) -> None:
        self._adp, self.lr_scheduler, self.mp_scaler = adp, lr_scheduler, mp_scaler

    @property
    def model(self) -> nn.Module:
        return self._adp.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._adp.optimizer

    @property
    def gain(self) -> float:
        return self._adp.gain

    @property
    def lr_factor(self) -> float:
        return self._adp._lr_factor()


class _Stats(State):
    """Gain and LR factor of the last step, kept across restarts (JSON)."""

    format = "json"

    def __init__(self, name: str) -> None:
        self.gain = 1.0
        self.lr_factor = 1.0
        super().__init__(name)

    def state_dict(self) -> dict[str, float]:
        return {"gain": self.gain, "lr_factor": self.lr_factor}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.gain, self.lr_factor = float(state["gain"]), float(state["lr_factor"])


def _distribute(ad: Any, model: nn.Module, optimizer: Any, rule: Any) -> nn.Module:
    """``ad.distribute`` with the scaling rule where this AutoDist takes one."""
    if "scaling_rule" in inspect.signature(ad.distribute).parameters:
        dmodel, _ = ad.distribute(model, optimizer, scaling_rule=rule)
    else:
        dmodel, _ = ad.distribute(model, optimizer)
    return dmodel


class AdaptiveDataParallel(nn.Module):
    """Distribute ``model`` for data-parallel training with adaptive batch sizes.

    ``optimizer`` is stepped as usual; with an autoscaled loader its learning rate follows
    ``scaling_rule`` (default :class:`AdaScale`). ``lr_scheduler`` and ``mp_scaler``
    (``torch.cuda.amp.GradScaler``) are checkpointed with the model. Extra keyword
    arguments (DistributedDataParallel options) are accepted and ignored.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, mp_scaler: Any = None, scaling_rule: Any = None,
                 name: str = "adaptdl-dataparallel", **kwargs: Any) -> None:
        super().__init__()
        ad = job.autodist()
        self.module = model
        self.optimizer = optimizer
        if scaling_rule is None:  # AdaptDL's default: AdamScale for Adam and AdamW
            adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            self.scaling_rule = AdamScale() if adam else AdaScale()
        else:
            self.scaling_rule = scaling_rule
        object.__setattr__(self, "_dist", _distribute(ad, model, optimizer,
                                                      self.scaling_rule))
        self._trainer = getattr(ad, "adaptive", None)  # the adaptive loop, when available
        if self._trainer is not None and hasattr(self._trainer, "measure_every_step"):
            # AdaptDL measures the gradient statistics at every step, with or without
            # autoscaling (its TensorBoard scalars, _metrics and scaling rules read them)
            self._trainer.measure_every_step()
            # AdaptDL preconditions the statistics only under an AdamScale the script
            # passed itself (its default AdamScale for Adam measures them plain)
            self._trainer.use_preconditioner(isinstance(scaling_rule, AdamScale))
        self._syncing = True
        initialize = getattr(self.scaling_rule, "initialize", None)
        if initialize is not None:  # an AdaptDL-style rule: its adp is this model
            initialize(self, optimizer)
        job.attach_loaders()
        if lr_scheduler is not None:
            register_state(f"{name}-lr_scheduler", lr_scheduler)
        if mp_scaler is not None:
            register_state(f"{name}-mp_scaler", mp_scaler)
        self._stats = _Stats(name)
        load_state(self._stats)
        object.__setattr__(self, "_state", ParallelState(self, lr_scheduler, mp_scaler))
        job.register_model(self)
        current_job().add_participant(self)  # (after AutoDist: its regroup runs first)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dist(*args, **kwargs)

    # -- in-process rescale (stratagem.elastic.Participant) --------------------------------
    def before_membership_change(self) -> None:
        """Nothing of its own: AutoDist gathers the model's shards."""

    def on_membership_change(self, change: MembershipChange) -> None:
        """A stage-3 rescale rebuilds the wrapped model as a new object
        (runtime/skeleton.py): ``module`` (and ``_state.model``) follow it."""
        if self._dist.module is not self.module:
            self.module = self._dist.module

    def set_grad_weight(self, weight: float) -> None:
        """This replica's share of the global batch (set by the loader for each batch)."""
        self._dist.grad_weight = weight

    # Stratagem's adaptive loop scales the optimizer's steps itself (scaling rules see it).
    runs_scaling_rule = True

    @property
    def sharded(self) -> bool:
        """Whether the job's strategy shards gradients or state (ZeRO): the gradients the
        optimizer sees are then this rank's share, not the whole average."""
        return bool(getattr(self._dist, "is_sharded", False))

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside :meth:`no_sync` (the backward only accumulates)."""
        return self._syncing

    @property
    def gns(self) -> StatisticsView:
        """The loop's gradient statistics with AdaptDL's ``gns`` interface (read-only)."""
        trainer = self._trainer
        tracker = getattr(trainer, "tracker", None)
        return StatisticsView(getattr(trainer, "gns", None),
                              tracker.progress if tracker is not None else 0.0,
                              len(self.optimizer.param_groups), self.optimizer)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (synced at the next backward)."""
        self._syncing = False
        try:
            with self._dist.no_sync():
                yield
        finally:
            self._syncing = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        warnings.warn("zero_grad has no effect with AdaptiveDataParallel", stacklevel=2)

    @property
    def gain(self) -> float:
        """The current AdaScale gain estimate r_t (1.0 until it is measured)."""
        gain = getattr(self._trainer, "gain", None)
        if gain is not None:
            self._stats.gain = float(gain)
        return self._stats.gain

    def _lr_factor(self) -> float:
        factor = getattr(self._trainer, "lr_factor", None)
        if factor is not None:
            self._stats.lr_factor = float(factor)
        return self._stats.lr_factor

    def statistics_measured(self) -> bool:
        """Whether the gradient statistics have been measured yet."""
        gns = getattr(self._trainer, "gns", None)
        return gns is not None and bool(getattr(gns, "ready", False))

    def _gns(self) -> tuple[float, float]:
        """(squared gradient norm, gradient variance at the base batch): AdaptDL's
        ``gns.sqr_avg()`` and ``gns.var_avg()``, (0, 0) until measured."""
        if not self.statistics_measured():
            return 0.0, 0.0
        view = self.gns
        return view.sqr_avg(), view.var_avg()

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write gradient statistics, gain and LR factor to TensorBoard."""
        if tag_prefix and not tag_prefix.endswith("/"):
            tag_prefix += "/"
        sqr, var = self._gns()
        writer.add_scalar(tag_prefix + "Gradient_Norm_Sqr", sqr, global_step)
        writer.add_scalar(tag_prefix + "Gradient_Variance", var, global_step)
        writer.add_scalar(tag_prefix + "Gain", self.gain, global_step)
        writer.add_scalar(tag_prefix + "Learning_Rate_Factor", self._lr_factor(), global_step)
