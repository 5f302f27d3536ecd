"""The planner: a calibrated cost model of one training step, a search over strategies,
and the explanation of what it chose (docs/concepts/auto-strategy.md).

``choose(model, spec, ...)`` calibrates (or estimates) and searches; the ``Auto`` builder
(``stratagem.strategy.Auto``, registered as "Auto") calls :func:`plan_from_profile` when it
has no model; :func:`predict_step_time` prices any strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.analysis.profile import ModelProfile, analyze
from stratagem.planner.calibrate import Calibration, calibrate, estimate
from stratagem.planner.cost_model import StepCost, predict
from stratagem.planner.explain import explain_json, explain_text
from stratagem.planner.links import LinkModel, ring_allreduce_time
from stratagem.planner.memory import (
    MemoryEstimate,
    activation_bytes,
    calibration_fits,
    estimate_memory,
    fit_memory,
)
from stratagem.planner.probe import LinkProbe, probe_links, runtime_costs
from stratagem.planner.search import Candidate, Choice, Pricer, search
from stratagem.planner.trial import Refinement, Trial, fit, refine, refined_s
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.auto import Auto, set_planner
from stratagem.strategy.schema import ShardedSynchronizer, Strategy
from stratagem.strategy.validate import validate

__all__ = ["Auto", "Calibration", "Candidate", "Choice", "LinkModel", "LinkProbe",
           "MemoryEstimate", "Refinement", "StepCost", "Trial", "calibrate", "choose",
           "collective_ready", "estimate", "estimate_memory", "explain_json", "explain_text",
           "fit", "fit_memory", "measured_links",
           "plan_from_profile", "predict", "predict_step_time", "probe_links", "refine",
           "ring_allreduce_time", "runtime_costs"]


def _calibration(model: nn.Module, profile: ModelProfile, batch_size: int | None,
                 sample_input: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                 together: bool = False) -> tuple[Calibration, ModelProfile]:
    if sample_input is not None:
        cal = calibrate(model, sample_input, loss_fn=loss_fn, together=together)
        return cal, profile.with_access(cal.access)
    return estimate(profile, batch_size or Auto().batch_size), profile


def measured_links(spec: ResourceSpec) -> tuple[LinkModel, LinkProbe | None]:
    """The spec's link model with the probed figures (:func:`probe_links`: collective,
    every worker at once) where a process group spans the spec's workers
    (:func:`collective_ready`)."""
    links = LinkModel.from_spec(spec)
    probe = probe_links(spec) if collective_ready(spec) else None
    return (links.measured(probe, spec) if probe is not None else links), probe


def choose(model: nn.Module, spec: ResourceSpec, *, batch_size: int | None = None,
           sample_input: Any = None, options: Auto | None = None,
           loss_fn: Callable[[Any], torch.Tensor] | None = None,
           probe: bool = False, trials: bool = False, optimizer: Any = None) -> Choice:
    """Calibrate ``model`` on ``sample_input`` (one worker's batch; without it, estimate
    from the profile at ``batch_size`` per worker) and search for its best strategy.

    Collective options (every worker of ``spec`` calls ``choose`` at once, a process
    group up): ``probe`` measures the links instead of trusting the spec's figures;
    with either, every worker calibrates at the same time (compute as training runs it);
    ``trials`` times the best few candidates for a few real steps and keeps the fastest
    (:func:`~stratagem.planner.trial.refine`; needs ``sample_input``). Either way
    every worker returns the same choice only with ``trials``: without it, send rank 0's
    (AutoDist does)."""
    options = options or Auto()
    profile = analyze(model)
    together = (probe or trials) and collective_ready(spec)
    limit = spec.memory_limit()
    activations, calibrated = 0, sample_input
    meta = any(p.is_meta for p in model.parameters())  # no values: nothing to time
    if limit is not None and sample_input is not None:
        activations = activation_bytes(model, sample_input)
        if not calibration_fits(profile, limit[0], activations):
            calibrated, trials = None, False  # its backward would not fit: estimate
    if meta:
        calibrated, trials = None, False
    cal, profile = _calibration(model, profile, batch_size or options.batch_size,
                                calibrated, loss_fn, together)
    links, link_probe = measured_links(spec) if probe else (None, None)
    choice = search(profile, spec, cal, options, links)
    if link_probe is not None:
        choice = replace(choice, link_probe=link_probe)
    if spec.memory_limit() is not None:  # the fastest that fits (planner/memory.py)
        choice = fit_memory(choice, activations, optimizer, Pricer(profile, spec, cal, links),
                            options.max_zero_stage)
        trials = trials and all(not isinstance(nc.synchronizer, ShardedSynchronizer)
                                for nc in choice.strategy.node_config)
    if trials and options.trials > 0 and sample_input is not None and collective_ready(spec):
        choice = refine(choice, model, sample_input, loss_fn=loss_fn, k=options.trials)
    return choice


def collective_ready(spec: ResourceSpec) -> bool:
    """Whether a process group spans exactly the spec's workers and carries CPU tensors
    (probes, trials and calibration together exchange CPU tensors: a group of NCCL alone
    cannot, so there Auto plans from calibration alone)."""
    return (dist.is_available() and dist.is_initialized()
            and dist.get_world_size() == spec.num_workers > 1
            and "gloo" in str(dist.get_backend()))


def plan_from_profile(options: Auto, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
    """What ``Auto().build(profile, spec)`` returns: the search on estimated costs (no
    model to measure), deterministic for a given profile, spec and machine rates."""
    cal = estimate(profile, options.batch_size)
    choice = search(profile, spec, cal, options)
    if spec.memory_limit() is not None:
        choice = fit_memory(choice, 0, None, Pricer(profile, spec, cal),
                            options.max_zero_stage)
    return choice.strategy


set_planner(plan_from_profile)


def predict_step_time(model: nn.Module, strategy: Strategy, spec: ResourceSpec,
                      batch_size: int, sample_input: Any = None, probe: bool = False,
                      refinement: Refinement | None = None) -> float:
    """Predicted seconds of one training step of ``model`` under ``strategy`` on ``spec``
    with ``batch_size`` samples per worker; calibrates on ``sample_input`` when given
    (cached per model signature and input shapes), else estimates from the profile.
    ``probe``: with measured links (collective the first time per spec: every worker
    calls it at once; cached). ``refinement``: refined by an Auto choice's trial steps
    (``planner.fit(choice.trials)``: factors for the CPU and the wire parts)."""
    profile = analyze(model)
    cal, profile = _calibration(model, profile, batch_size, sample_input, None,
                                probe and collective_ready(spec))
    strategy = validate(strategy, profile, spec)
    links = measured_links(spec)[0] if probe else None
    return refined_s(predict(strategy, profile, spec, cal, links), refinement)
