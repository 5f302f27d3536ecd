"""Learning-rate scaling rules for a batch ``S = M / M0`` times the base batch.

Each rule gives one LR factor per param group; :func:`scaled_step` applies them to a torch
optimizer for one step only (the user's LR is restored afterwards) and credits the step's
gain (scale-invariant iterations, :class:`~stratagem.adapt.progress.ProgressTracker`).
The gain is always the measured AdaScale gain ``r(S)`` of the noise statistics (1 while
they are unknown), whatever the rule, so progress is measured rather than assumed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from stratagem.adapt.noise_scale import GradientNoiseScale
from stratagem.adapt.progress import ProgressTracker

_ADAPTIVE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.SparseAdam,
)


def _group_gains(scale: float, gns: GradientNoiseScale | None, num_groups: int) -> np.ndarray:
    """Per-group AdaScale gains ``(v + s) / (v / S + s)`` (``v`` at the base batch)."""
    if gns is None or not gns.ready:
        return np.ones(num_groups)
    gains = [
        e.gain(scale * gns.base_batch_size, gns.base_batch_size) for e in gns.group_estimates()
    ]
    if len(gains) != num_groups:  # statistics pooled over all groups: one shared factor
        return np.full(num_groups, float(gns.gain(scale * gns.base_batch_size)))
    return np.asarray(gains, dtype=float)


class ScalingRule(ABC):
    """Maps a batch scale to per-group LR factors."""

    @abstractmethod
    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        """LR multipliers, one per param group, at ``scale`` after ``progress`` iterations."""

    def gain(self, scale: float, gns: GradientNoiseScale | None = None) -> float:
        """Scale-invariant iterations one step at ``scale`` is worth (AdaScale's ``r``)."""
        if gns is None or not gns.ready:
            return 1.0
        return float(gns.gain(scale * gns.base_batch_size))


class AdaScale(ScalingRule):
    """AdaScale (Johnson et al., 2020): LR x ``r(S)``, per group. Default for SGD."""

    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        return _group_gains(scale, gns, num_groups)


class AdamScale(ScalingRule):
    """AdaScale for adaptive optimizers: LR x ``sqrt(r(S))``, ``r`` measured on
    preconditioned gradients. Default for Adam, AdamW, RMSprop and kin."""

    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        return np.sqrt(_group_gains(scale, gns, num_groups))


class LinearScale(ScalingRule):
    """LR x ``S`` (Goyal et al., 2017)."""

    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        return np.full(num_groups, float(scale))


class SqrtScale(ScalingRule):
    """LR x ``sqrt(S)`` (Krizhevsky, 2014)."""

    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        return np.full(num_groups, math.sqrt(scale))


class LEGW(ScalingRule):
    """Linear-epoch gradual warmup (You et al., 2019): sqrt scaling with a warmup that
    lasts ``S`` times ``base_warmup_epochs``.

    Factor ``sqrt(S) * min(1, progress / (base_warmup_epochs * S * dataset_size / M0))``,
    ``progress`` in base-batch iterations.
    """

    def __init__(self, base_warmup_epochs: float, dataset_size: int, base_batch_size: int) -> None:
        self.base_warmup_epochs = float(base_warmup_epochs)
        self.dataset_size = int(dataset_size)
        self.base_batch_size = int(base_batch_size)

    def lr_factors(
        self,
        scale: float,
        gns: GradientNoiseScale | None = None,
        progress: float = 0.0,
        num_groups: int = 1,
    ) -> np.ndarray:
        warmup = self.base_warmup_epochs * scale * self.dataset_size / self.base_batch_size
        ramp = 1.0 if warmup <= 0 else min(1.0, progress / warmup)
        return np.full(num_groups, math.sqrt(scale) * ramp)


def default_rule_for(optimizer: torch.optim.Optimizer) -> ScalingRule:
    """AdamScale for optimizers that divide by a second-moment estimate, else AdaScale."""
    if isinstance(optimizer, _ADAPTIVE) or "betas" in optimizer.defaults:
        return AdamScale()
    return AdaScale()


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factors: Sequence[float]) -> Iterator[None]:
    """Multiply each param group's ``lr`` by its factor inside the block, then restore it."""
    groups = optimizer.param_groups
    if len(factors) != len(groups):
        raise ValueError(f"{len(factors)} LR factors for {len(groups)} param groups")
    saved = [group["lr"] for group in groups]
    try:
        for group, factor in zip(groups, factors, strict=True):
            group["lr"] = group["lr"] * float(factor)
        yield
    finally:
        for group, lr in zip(groups, saved, strict=True):
            group["lr"] = lr


def scaled_step(
    optimizer: torch.optim.Optimizer,
    rule: ScalingRule,
    batch_size: int,
    base_batch_size: int,
    gns: GradientNoiseScale | None = None,
    tracker: ProgressTracker | None = None,
    closure: Callable[[], float] | None = None,
) -> float | None:
    """One ``optimizer.step`` with the rule's LR factors; credits the gain to ``tracker``."""
    scale = batch_size / base_batch_size
    progress = tracker.progress if tracker is not None else 0.0
    factors = rule.lr_factors(scale, gns, progress, len(optimizer.param_groups))
    with scaled_lr(optimizer, factors):
        loss = optimizer.step(closure) if closure is not None else optimizer.step()
    if tracker is not None:
        tracker.update(rule.gain(scale, gns), batch_size)
    return loss
