"""Model analysis: a :class:`ModelProfile` of every trainable parameter."""

from stratagem.analysis.profile import (
    AccessStats,
    ModelProfile,
    ParamInfo,
    analyze,
    named_trainable_parameters,
)

__all__ = ["AccessStats", "ModelProfile", "ParamInfo", "analyze", "named_trainable_parameters"]
