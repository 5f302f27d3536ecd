"""Adaptive batch size and learning rate: throughput model, gradient noise scale, goodput.

The models (``throughput``, ``noise_scale``, ``goodput``, ``scaling_rules``, ``autoscale``:
numpy, plus torch for optimizer-facing helpers) and what measures their inputs while
training (``step_profiler``: step times; ``gradient_stats``: gradient norms per step). See
``docs/concepts/goodput.md``.

The adaptive training loop that AutoDist attaches (``loop``: profiling, gradient statistics,
batch-size decisions, LR scaling, hints, per-epoch progress) and the ``Accumulator`` of
metrics: see ``docs/how-to/adaptive-batch-size.md``.

Job state and elastic restarts live in :mod:`stratagem.elastic` (re-exported here under
their documented names): see ``docs/how-to/elastic-training.md``.
"""

from stratagem.adapt.accumulator import Accumulator
from stratagem.adapt.autoscale import Autoscaler, BatchConfig
from stratagem.adapt.goodput import (
    DEFAULT_SWITCH_THRESHOLD,
    BatchChoice,
    BatchGrid,
    GoodputFunction,
    choose_with_hysteresis,
    should_switch,
)
from stratagem.adapt.gradient_stats import (
    ConsecutiveGradients,
    GradStats,
    adam_preconditioner,
    group_sqr_norms,
    param_group_grads,
)
from stratagem.adapt.hints import HintsPublisher
from stratagem.adapt.loop import AdaptiveTrainer, TrainerConfig
from stratagem.adapt.noise_scale import GNSEstimate, GradientNoiseScale, unbiased_estimates
from stratagem.adapt.progress import ProgressTracker
from stratagem.adapt.progress_report import EpochReport
from stratagem.adapt.scaling_rules import (
    LEGW,
    AdamScale,
    AdaScale,
    LinearScale,
    ScalingRule,
    SqrtScale,
    default_rule_for,
    scaled_lr,
    scaled_step,
)
from stratagem.adapt.step_profiler import StepProfiler
from stratagem.adapt.throughput import (
    ProfileRecord,
    ThroughputParams,
    fit_throughput,
    predict_compute_time,
    predict_step_time,
    predict_sync_time,
    predict_throughput,
)
from stratagem.elastic import (  # the job lifecycle, documented under sg.adapt too
    ENV_ADAPTDL_CHECKPOINT,
    ENV_CHECKPOINT_DIR,
    EXIT_CODE,
    ObjectState,
    State,
    checkpoint_root,
    current_epoch,
    exit_point,
    exit_requested,
    finished_epochs,
    hold_exit,
    load_state,
    register_state,
    remaining_epochs_until,
    request_exit,
    reset_states,
    restore_point,
    save_all_states,
    wait_for_checkpoint,
)

__all__ = [
    "Accumulator",
    "AdaptiveTrainer",
    "Autoscaler",
    "BatchConfig",
    "EpochReport",
    "GradStats",
    "HintsPublisher",
    "StepProfiler",
    "TrainerConfig",
    "DEFAULT_SWITCH_THRESHOLD",
    "ENV_ADAPTDL_CHECKPOINT",
    "ENV_CHECKPOINT_DIR",
    "EXIT_CODE",
    "LEGW",
    "AdaScale",
    "AdamScale",
    "BatchChoice",
    "BatchGrid",
    "ConsecutiveGradients",
    "GNSEstimate",
    "GoodputFunction",
    "GradientNoiseScale",
    "LinearScale",
    "ObjectState",
    "ProfileRecord",
    "ProgressTracker",
    "ScalingRule",
    "SqrtScale",
    "State",
    "ThroughputParams",
    "adam_preconditioner",
    "checkpoint_root",
    "choose_with_hysteresis",
    "current_epoch",
    "default_rule_for",
    "exit_point",
    "exit_requested",
    "finished_epochs",
    "fit_throughput",
    "group_sqr_norms",
    "hold_exit",
    "load_state",
    "param_group_grads",
    "predict_compute_time",
    "predict_step_time",
    "predict_sync_time",
    "predict_throughput",
    "register_state",
    "remaining_epochs_until",
    "request_exit",
    "reset_states",
    "restore_point",
    "save_all_states",
    "wait_for_checkpoint",
    "scaled_lr",
    "scaled_step",
    "should_switch",
    "unbiased_estimates",
]


def __getattr__(name: str) -> object:
    """``sg.adapt.rescale``: the in-process rescale API under its earlier name, imported on
    first use (so ``python -m stratagem.adapt.rescale`` runs it cleanly)."""
    if name == "rescale":
        import importlib

        return importlib.import_module("stratagem.adapt.rescale")
    raise AttributeError(f"module 'stratagem.adapt' has no attribute {name!r}")
