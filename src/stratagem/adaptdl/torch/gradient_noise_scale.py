"""AdaptDL's ``adaptdl.torch.gradient_noise_scale``: gradient statistics for an optimizer.

:class:`GradientNoiseScale` watches an optimizer's gradients (backward hooks) and keeps
bias-corrected moving averages of the squared gradient norm and the gradient variance per
parameter group, in AdaptDL's units (variance of a gradient at the scale ``accum_scale``,
one unit being the base batch). Several replicas (``num_replicas > 1``) or accumulation
micro-steps give the unbiased two-estimator pair; a lone gradient is paired with the
previous step's (biased, replaced as soon as real pairs exist). The one-step estimates are
Stratagem's (:func:`stratagem.adapt.noise_scale.unbiased_estimates`).

Under ``AdaptiveDataParallel`` Stratagem's adaptive loop measures these statistics itself
(``model.gns`` reads them); this class serves scripts that drive a scaling rule by hand
(``rule.initialize(adp, optimizer, patch_optimizer=True)``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from stratagem.adapt.noise_scale import unbiased_estimates
from stratagem.errors import StratagemError

LOG = logging.getLogger(__name__)

__all__ = ["GradientNoiseScale"]


def _group_sqr(grads: list[list[torch.Tensor | None]]) -> np.ndarray:
    return np.array([sum((g.double().pow(2).sum() for g in group if g is not None),
                         torch.zeros((), dtype=torch.float64)).item() for group in grads])


class GradientNoiseScale:
    """Gradient noise statistics of ``optimizer``'s parameters (AdaptDL's interface).

    ``adp`` says whether a backward pass synchronizes (``adp.require_backward_grad_sync``;
    False: an accumulation micro-step). ``num_replicas`` (default: the process group's
    size) replicas each contribute a gradient, all-reduced; ``accum_scale`` is the scale of
    one micro-step (default ``num_replicas``). ``mp_scaler`` (an AMP GradScaler) is divided
    out of the gradients.
    """

    def __init__(self, adp: Any, optimizer: torch.optim.Optimizer, mp_scaler: Any = None,
                 num_replicas: int | None = None, accum_scale: float | None = None) -> None:
        if getattr(adp, "sharded", False) is True:  # (a stand-in adp may answer anything)
            raise StratagemError(
                "GradientNoiseScale reads whole averaged gradients, but the job's strategy "
                "shards them (ZeRO)", where="adaptdl GradientNoiseScale",
                fix="read AdaptiveDataParallel's own statistics (model.gns, measured by "
                    "Stratagem's adaptive loop, sharded gradients included), or run with an "
                    "all-reduce strategy")
        self._adp = adp
        self._optimizer = optimizer
        self._orig_optimizer_zero_grad = optimizer.zero_grad
        self._should_zero_grad = True
        self._mp_scaler = mp_scaler
        self._local_sqr: torch.Tensor | None = None
        self._num_replicas = (num_replicas if num_replicas is not None
                              else dist.get_world_size() if dist.is_initialized() else 1)
        self._accum_scale = accum_scale or self._num_replicas
        self._accum_count = 0
        self._prev_grads: list[list[torch.Tensor | None]] | None = None
        self._smoothing = 0.999
        self._callback_queued = False
        self._pending: Any = None
        groups = len(optimizer.param_groups)
        optimizer.state.setdefault("gns", {  # type: ignore[call-overload]
            "progress": 0.0, "sqr_avg": np.ones(groups), "var_avg": np.zeros(groups),
            "biased": False})
        self.reset_accumulation()
        for idx, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param.requires_grad:
                    param.register_hook(functools.partial(self._backward_hook, idx))

    @property
    def _state(self) -> dict[str, Any]:
        return self._optimizer.state["gns"]  # type: ignore[index]

    # -- accumulation ---------------------------------------------------------------------
    def reset_accumulation(self, *args: Any, **kwargs: Any) -> None:
        """Zero the gradients and start a new accumulation."""
        self._orig_optimizer_zero_grad(*args, **kwargs)
        self._local_sqr = None
        self._accum_count = 0

    @property
    def should_zero_grad(self) -> bool:
        """False while gradients are accumulating (the last backward did not sync)."""
        return self._should_zero_grad

    @property
    def accum_scale(self) -> float:
        return self._accum_scale

    @property
    def accum_count(self) -> int:
        """Backward passes accumulated since the last reset."""
        return self._accum_count

    def set_accum_scale(self, accum_scale: float) -> None:
        if not np.isclose(self._accum_scale, accum_scale):
            self.reset_accumulation()
            self._accum_scale = accum_scale

    # -- estimates ------------------------------------------------------------------------
    @property
    def raw_sqr_avg(self) -> np.ndarray:
        """Per-group squared gradient norm estimates (read-only view)."""
        view = np.asarray(self._state["sqr_avg"], dtype=float).view()
        view.flags.writeable = False
        return view

    @property
    def raw_var_avg(self) -> np.ndarray:
        """Per-group gradient variance estimates at scale 1 (read-only view)."""
        view = np.asarray(self._state["var_avg"], dtype=float).view()
        view.flags.writeable = False
        return view

    def sqr_avg(self) -> float:
        """Estimate of |G|^2 (negative group estimates count as 0)."""
        return float(np.sum(np.maximum(self._state["sqr_avg"], 0.0)))

    def var_avg(self) -> float:
        """Estimate of the gradient variance at scale 1 (at least 1e-6 per group)."""
        return float(np.sum(np.maximum(self._state["var_avg"], 1e-6)))

    def get_progress(self) -> float:
        """Scale-invariant steps made so far (the scaling rule adds each step's gain)."""
        return float(self._state["progress"])

    def set_progress(self, progress: float) -> None:
        self._state["progress"] = float(progress)

    def gain(self, scale: float) -> float:
        """AdaScale gain ``(var + sqr) / (var / scale + sqr)`` of a step at ``scale``."""
        var, sqr = self.var_avg(), self.sqr_avg()
        return (var + sqr) / (var / scale + sqr)

    def _update_avg(self, name: str, value: np.ndarray, factor: float) -> None:
        biased = factor * self._state.get(name + "_biased", 0.0) + (1.0 - factor) * value
        unbias = factor * self._state.get(name + "_unbias", 0.0) + (1.0 - factor)
        self._state[name + "_biased"], self._state[name + "_unbias"] = biased, unbias
        self._state[name] = biased / unbias

    def _reset_avg(self, name: str) -> None:
        self._state.pop(name + "_biased", None)
        self._state.pop(name + "_unbias", None)

    # -- backward hooks -------------------------------------------------------------------
    def _backward_hook(self, idx: int, grad: torch.Tensor) -> None:
        """Per parameter, before gradients are synchronized: add its local |g|^2."""
        if self._local_sqr is None:
            self._local_sqr = torch.zeros(len(self._optimizer.param_groups),
                                          device=grad.device, dtype=torch.float64)
        self._local_sqr[idx] += grad.detach().double().pow(2).sum()
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        """After the backward pass (queued, so a DDP-style sync callback runs first)."""
        self._callback_queued = False
        self._accum_count += 1
        if self._adp.require_backward_grad_sync:
            if self._num_replicas > 1:
                self._pending = dist.all_reduce(self._local_sqr, async_op=True)
            Variable._execution_engine.queue_callback(self._final_callback)
            self._should_zero_grad = True
        else:
            self._should_zero_grad = False  # accumulating

    def _final_callback(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        mp_scale = self._mp_scaler.get_scale() if self._mp_scaler is not None else 1.0
        grads = [[None if p.grad is None else p.grad.detach().float() / mp_scale
                  / self._accum_count for p in group["params"]]
                 for group in self._optimizer.param_groups]
        total_sqr = _group_sqr(grads)
        if not np.all(np.isfinite(total_sqr)):
            LOG.warning("GradientNoiseScale: non-finite gradient, statistics not updated")
            return
        count = self._num_replicas * self._accum_count
        scale = self._accum_scale * self._accum_count
        if count > 1:
            local_sqr = self._local_sqr.cpu().numpy() / count / mp_scale ** 2
            if self._state["biased"]:
                self._reset_avg("sqr_avg")
                self._reset_avg("var_avg")
            self._state["biased"] = False
            self._prev_grads = None
        else:
            prev = self._prev_grads
            self._state["biased"] = True
            self._prev_grads = [[None if g is None else g.clone() for g in group]
                                for group in grads]
            if prev is None:
                return
            local_sqr = (_group_sqr(prev) + total_sqr) / 2
            total_sqr = _group_sqr([[a if b is None else b if a is None else (a + b) / 2
                                     for a, b in zip(ga, gb, strict=True)]
                                    for ga, gb in zip(grads, prev, strict=True)])
            count, scale = 2, 2 * self._accum_scale
        # ``count`` gradients of ``scale / count`` units each: the one-step estimates.
        sqr, var = unbiased_estimates(np.broadcast_to(local_sqr, (count, local_sqr.size)),
                                      total_sqr, scale / count)
        theta = self._smoothing ** scale
        self._update_avg("sqr_avg", sqr, theta)
        self._update_avg("var_avg", var, theta)
