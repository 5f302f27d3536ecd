"""Per-parameter-group gradient squared norms for :class:`GradientNoiseScale` (torch side).

Gradients are lists (one per param group) of tensors or ``None``. For Adam-type optimizers
the noise scale is measured on *preconditioned* gradients ``g / (sqrt(v_hat) + eps)``,
the direction the optimizer actually moves in; :func:`adam_preconditioner` builds the
divisors from the optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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
