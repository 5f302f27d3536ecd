"""AdaptDL's ``adaptdl.torch.scaling_rules``: learning-rate scaling rules, AdaptDL's way.

A rule implements ``scale_lr(scale)`` (the LR factor, one number or one per param group,
for a step ``scale`` times the base batch) reading the gradient statistics from
``self.adp.gns`` (``raw_sqr_avg``, ``raw_var_avg``, ``get_progress()``, ...).
``rule.initialize(adp, optimizer, patch_optimizer=False)`` binds it; ``rule.step()`` runs
one optimizer step at the scaled LR and ``rule.zero_grad()`` starts the next accumulation
(with ``patch_optimizer=True`` the optimizer's own ``step``/``zero_grad`` do that).

Every rule here is also a Stratagem :class:`~stratagem.adapt.scaling_rules.ScalingRule`:
passed to ``AdaptiveDataParallel(..., scaling_rule=rule)`` it is bound to the model, and
Stratagem's adaptive loop asks it for the LR factors at each step (``scale_lr`` sees the
loop's measured statistics through ``adp.gns``).
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from typing import Any

import numpy as np

from stratagem.adapt.noise_scale import GradientNoiseScale as CoreGNS
from stratagem.adapt.scaling_rules import ScalingRule
from stratagem.adaptdl.torch.data import AdaptiveDataLoaderHelper, current_dataloader

__all__ = ["AdaScale", "AdamScale", "LEGWScale", "LinearScale", "ScalingRuleBase",
           "SqrtScale", "current_dataloader"]


class StatisticsView:
    """AdaptDL's ``gns`` interface over Stratagem's measured statistics (read-only):
    variances in units of the base batch, AdaptDL's starting values while nothing is
    measured."""

    def __init__(self, gns: CoreGNS | None, progress: float, num_groups: int,
                 optimizer: Any = None) -> None:
        self.gns, self.progress, self.num_groups = gns, float(progress), int(num_groups)
        self.optimizer = optimizer

    @property
    def raw_sqr_avg(self) -> np.ndarray:
        if self.gns is None or not self.gns.ready:
            return np.ones(self.num_groups)
        return np.asarray(self.gns.group_sqr_norms, dtype=float)

    @property
    def raw_var_avg(self) -> np.ndarray:
        if self.gns is None or not self.gns.ready:
            return np.zeros(self.num_groups)
        return np.asarray(self.gns.group_vars, dtype=float) / self.gns.base_batch_size

    def sqr_avg(self) -> float:
        return float(np.sum(np.maximum(self.raw_sqr_avg, 0.0)))

    def var_avg(self) -> float:
        return float(np.sum(np.maximum(self.raw_var_avg, 1e-6)))

    def get_progress(self) -> float:
        return self.progress

    def gain(self, scale: float) -> float:
        var, sqr = self.var_avg(), self.sqr_avg()
        return (var + sqr) / (var / scale + sqr)


class _LoopHost:
    """What ``self.adp`` is while Stratagem's loop asks a rule for its factors."""

    require_backward_grad_sync = True

    def __init__(self, gns: StatisticsView) -> None:
        self.gns = gns


class ScalingRuleBase(ScalingRule):
    """Base class of learning-rate scaling rules with AdaptDL's interface (module doc).

    Subclasses implement :meth:`scale_lr`. Without ``initialize`` a rule works only inside
    ``AdaptiveDataParallel`` (which binds it).
    """

    def __init__(self) -> None:
        self.adp: Any = None
        self._optimizer: Any = None
        self._orig_optimizer_step: Any = None

    def scale_lr(self, scale: float) -> float | np.ndarray:
        """The LR factor(s) for a step at ``scale`` times the base batch."""
        raise NotImplementedError

    def initialize(self, adp: Any, optimizer: Any, patch_optimizer: bool = False) -> None:
        """Bind the rule to ``adp`` (``.gns``, ``.require_backward_grad_sync``) and
        ``optimizer``; ``patch_optimizer``: route ``optimizer.step``/``zero_grad`` here."""
        self.adp = adp
        self._optimizer = optimizer
        self._orig_optimizer_step = optimizer.step
        if patch_optimizer:
            rule = self

            @functools.wraps(optimizer.step)
            def step(_opt: Any, *args: Any, **kwargs: Any) -> Any:
                return rule.step(*args, **kwargs)

            @functools.wraps(optimizer.zero_grad)
            def zero_grad(_opt: Any, *args: Any, **kwargs: Any) -> None:
                rule.zero_grad(*args, **kwargs)

            optimizer.step = types.MethodType(step, optimizer)
            optimizer.zero_grad = types.MethodType(zero_grad, optimizer)

    def _bound(self) -> Any:
        if self.adp is None:
            raise ValueError("the scaling rule is not initialized: call "
                             "rule.initialize(adp, optimizer) or pass it to "
                             "AdaptiveDataParallel(..., scaling_rule=rule)")
        return self.adp

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Zero the gradients, unless they are still accumulating (then warn)."""
        adp = self._bound()
        if getattr(adp, "runs_scaling_rule", False) is True:  # Stratagem's loop skips micro-steps
            self._optimizer.zero_grad(*args, **kwargs)
        elif adp.gns.should_zero_grad:
            adp.gns.reset_accumulation(*args, **kwargs)
        else:
            warnings.warn("skipping zero_grad for accumulated gradient", stacklevel=2)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One optimizer step at the scaled LR (nothing while gradients accumulate)."""
        adp = self._bound()
        if getattr(adp, "runs_scaling_rule", False) is True:  # Stratagem's loop scales the step
            return self._optimizer.step(*args, **kwargs)
        if not adp.require_backward_grad_sync:
            return None
        gns = adp.gns
        scale = gns.accum_scale * gns.accum_count
        groups = self._optimizer.param_groups
        initial = [group["lr"] for group in groups]
        factors = np.broadcast_to(np.asarray(self.scale_lr(scale), dtype=float),
                                  (len(groups),))
        try:
            for group, lr, factor in zip(groups, initial, factors, strict=True):
                group["lr"] = lr * float(factor)
            loss = self._orig_optimizer_step(*args, **kwargs)
        finally:
            for group, lr in zip(groups, initial, strict=True):
                group["lr"] = lr
        gns.set_progress(gns.get_progress() + gns.gain(scale))
        return loss

    # -- Stratagem's ScalingRule interface ---------------------------------------------------
    def lr_factors(self, scale: float, gns: CoreGNS | None = None, progress: float = 0.0,
                   num_groups: int = 1) -> np.ndarray:
        """The factors ``scale_lr`` gives with the loop's statistics as ``adp.gns``."""
        saved = self.adp
        self.adp = _LoopHost(StatisticsView(gns, progress, num_groups, self._optimizer))
        try:
            factors = self.scale_lr(scale)
        finally:
            self.adp = saved
        return np.array(np.broadcast_to(np.asarray(factors, dtype=float), (num_groups,)))


class AdaScale(ScalingRuleBase):
    """AdaScale (Johnson et al., 2020): LR x the gain ``(var + sqr) / (var / S + sqr)``,
    per param group."""

    def scale_lr(self, scale: float) -> np.ndarray:
        var = np.maximum(self.adp.gns.raw_var_avg, 1e-6)
        sqr = np.maximum(self.adp.gns.raw_sqr_avg, 0.0)
        return (var + sqr) / (var / scale + sqr)


class AdamScale(AdaScale):
    """AdaScale for Adam-type optimizers: LR x sqrt(gain)."""

    def scale_lr(self, scale: float) -> np.ndarray:
        return np.sqrt(super().scale_lr(scale))


class LinearScale(ScalingRuleBase):
    """LR x ``S`` (Goyal et al., 2017)."""

    def scale_lr(self, scale: float) -> float:
        return scale


class SqrtScale(ScalingRuleBase):
    """LR x ``sqrt(S)`` (Krizhevsky, 2014)."""

    def scale_lr(self, scale: float) -> float:
        return math.sqrt(scale)


class LEGWScale(ScalingRuleBase):
    """Linear-epoch gradual warmup (You et al., 2019): ``sqrt(S)``, ramped up linearly over
    the first ``base_warmup_epochs * S`` epochs of ``data_size`` samples (progress in
    scale-invariant steps of the loader's ``batch_size``)."""

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        super().__init__()
        self._base_warmup_epochs = base_warmup_epochs
        self._data_size = data_size

    def scale_lr(self, scale: float) -> float:
        loader = current_dataloader() or AdaptiveDataLoaderHelper.training_loader()
        if loader is None:
            raise ValueError("LEGWScale needs the training data loader: use it while an "
                             "AdaptiveDataLoader is being iterated")
        warmup_steps = self._base_warmup_epochs * scale * self._data_size / loader.batch_size
        peak = math.sqrt(scale)
        progress = self.adp.gns.get_progress()
        return peak * (progress / warmup_steps) if progress < warmup_steps else peak


LEGW = LEGWScale
