"""Adaptive batch size and learning rate: throughput model, gradient noise scale, goodput.

Pure math here (numpy, plus torch for optimizer-facing helpers); the data loader, elastic
restarts and engine integration build on it. See ``docs/concepts/goodput.md``.
"""

from stratagem.adapt.gns import GNSEstimate, GradientNoiseScale, unbiased_estimates
from stratagem.adapt.goodput import (
    DEFAULT_SWITCH_THRESHOLD,
    BatchChoice,
    BatchGrid,
    GoodputFunction,
    choose_with_hysteresis,
    should_switch,
)
from stratagem.adapt.grad_norms import (
    ConsecutiveGradients,
    adam_preconditioner,
    group_sqr_norms,
    param_group_grads,
)
from stratagem.adapt.progress import ProgressTracker
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
from stratagem.adapt.throughput import (
    ProfileRecord,
    ThroughputParams,
    fit_throughput,
    predict_compute_time,
    predict_step_time,
    predict_sync_time,
    predict_throughput,
)

__all__ = [
    "DEFAULT_SWITCH_THRESHOLD",
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
    "ProfileRecord",
    "ProgressTracker",
    "ScalingRule",
    "SqrtScale",
    "ThroughputParams",
    "adam_preconditioner",
    "choose_with_hysteresis",
    "default_rule_for",
    "fit_throughput",
    "group_sqr_norms",
    "param_group_grads",
    "predict_compute_time",
    "predict_step_time",
    "predict_sync_time",
    "predict_throughput",
    "scaled_lr",
    "scaled_step",
    "should_switch",
    "unbiased_estimates",
]
