"""The planner: a calibrated cost model of one training step, a search over strategies,
and the explanation of what it chose (docs/concepts/auto-strategy.md).

``choose(model, spec, ...)`` calibrates (or estimates) and searches; the ``Auto`` builder
(``stratagem.strategy.Auto``, registered as "Auto") calls :func:`plan_from_profile` when it
has no model; :func:`predict_step_time` prices any strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratagem.analysis.profile import ModelProfile, analyze
from stratagem.planner.calibrate import Calibration, calibrate, estimate
from stratagem.planner.cost_model import StepCost, predict
from stratagem.planner.explain import explain_json, explain_text
from stratagem.planner.links import LinkModel, ring_allreduce_time
from stratagem.planner.search import Candidate, Choice, search
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.auto import Auto, set_planner
from stratagem.strategy.schema import Strategy
from stratagem.strategy.validate import validate

__all__ = ["Auto", "Calibration", "Candidate", "Choice", "LinkModel", "StepCost",
           "calibrate", "choose", "estimate", "explain_json", "explain_text",
           "plan_from_profile", "predict", "predict_step_time", "ring_allreduce_time"]


def _calibration(model: nn.Module, profile: ModelProfile, batch_size: int | None,
                 sample_input: Any, loss_fn: Callable[[Any], torch.Tensor] | None
                 ) -> tuple[Calibration, ModelProfile]:
    if sample_input is not None:
        cal = calibrate(model, sample_input, loss_fn=loss_fn)
        return cal, profile.with_access(cal.access)
    return estimate(profile, batch_size or Auto().batch_size), profile


def choose(model: nn.Module, spec: ResourceSpec, *, batch_size: int | None = None,
           sample_input: Any = None, options: Auto | None = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Choice:
    """Calibrate ``model`` on ``sample_input`` (one worker's batch; without it, estimate
    from the profile at ``batch_size`` per worker) and search for its best strategy."""
    options = options or Auto()
    profile = analyze(model)
    cal, profile = _calibration(model, profile, batch_size or options.batch_size,
                                sample_input, loss_fn)
    return search(profile, spec, cal, options)


def plan_from_profile(options: Auto, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
    """What ``Auto().build(profile, spec)`` returns: the search on estimated costs (no
    model to measure), deterministic for a given profile, spec and machine rates."""
    cal = estimate(profile, options.batch_size)
    return search(profile, spec, cal, options).strategy


set_planner(plan_from_profile)


def predict_step_time(model: nn.Module, strategy: Strategy, spec: ResourceSpec,
                      batch_size: int, sample_input: Any = None) -> float:
    """Predicted seconds of one training step of ``model`` under ``strategy`` on ``spec``
    with ``batch_size`` samples per worker; calibrates on ``sample_input`` when given
    (cached per model signature and input shapes), else estimates from the profile."""
    profile = analyze(model)
    cal, profile = _calibration(model, profile, batch_size, sample_input, None)
    strategy = validate(strategy, profile, spec)
    return predict(strategy, profile, spec, cal).total_s
