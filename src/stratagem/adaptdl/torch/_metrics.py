"""AdaptDL's private ``adaptdl.torch._metrics``, read side: what AdaptDL programs in the
wild use (its DCGAN example reads ``_metrics_state().grad_params``; its Ray Tune
integration calls ``_get_sched_hints()``).

The values come from Stratagem's adaptive loop, in AdaptDL's units: ``grad_params`` is
``(squared gradient norm, gradient variance at the base batch)`` summed over the job's
``AdaptiveDataParallel`` models (AdaptDL sums them the same way), None until measured and
without ``autoscale_batch_size`` (AdaptDL records them only for its batch-size decisions;
``model.gns`` and ``to_tensorboard`` always have them);
``progress`` is the scale-invariant progress. Stratagem profiles throughput with its own
model (not AdaptDL's seven ``perf_params``), so ``perf_params`` is None, ``profile`` is
empty and :func:`get_goodput_fn` returns None; the batch-size decisions are Stratagem's
(docs/how-to/adaptdl-migration.md). AdaptDL's write side (``profile_step_start``,
``update_grad_params``, ...) is its loader's and model's business and is not provided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stratagem.adaptdl.torch import job
from stratagem.adaptdl.torch.data import AdaptiveDataLoaderHelper

__all__ = ["get_goodput_fn", "get_progress", "_get_sched_hints", "_metrics_state"]


@dataclass(frozen=True)
class MetricsState:
    """A snapshot of the job's metrics with AdaptDL's ``_MetricsState`` field names."""

    grad_params: tuple[float, float] | None
    progress: float
    init_batch_size: int | None
    max_batch_size: int | None
    local_bsz_bounds: tuple[int | None, int | None] | None
    gradient_accumulation: bool
    perf_params: None = None
    profile: dict[Any, Any] = field(default_factory=dict)


def _grad_params(loader: AdaptiveDataLoaderHelper | None) -> tuple[float, float] | None:
    """AdaptDL records them for its goodput model only while the batch size may grow
    (``max_batch_size`` above ``batch_size``); None otherwise, and until measured."""
    if loader is None or not (loader.max_batch_size or 0) > loader.batch_size:
        return None
    measured = [m._gns() for m in job.models() if m.statistics_measured()]
    if not measured:
        return None
    return (float(sum(s for s, _ in measured)), float(sum(v for _, v in measured)))


def _metrics_state() -> MetricsState:
    """The job's metrics now (AdaptDL's ``_metrics_state()``)."""
    models = job.models()
    loader = AdaptiveDataLoaderHelper.training_loader()
    return MetricsState(
        grad_params=_grad_params(loader),
        progress=max((m.gns.get_progress() for m in models), default=0.0),
        init_batch_size=loader.batch_size if loader is not None else None,
        max_batch_size=loader.max_batch_size if loader is not None else None,
        local_bsz_bounds=loader.local_bsz_bounds if loader is not None else None,
        gradient_accumulation=bool(loader is not None and loader.gradient_accumulation))


def get_progress() -> float:
    """Scale-invariant training progress (AdaptDL's ``get_progress()``)."""
    return _metrics_state().progress


def get_goodput_fn() -> None:
    """None: Stratagem's goodput model is not AdaptDL's ``GoodputFunction`` (module doc)."""
    return None


def _get_sched_hints() -> MetricsState | None:
    """What AdaptDL's Ray Tune integration asks a trial for: the metrics state, or None
    before any training step (AdaptDL: before anything was profiled)."""
    state = _metrics_state()
    return state if state.grad_params is not None or state.progress else None
