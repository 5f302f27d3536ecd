"""Model analysis: a :class:`ModelProfile` of every trainable parameter."""

from stratagem.analysis.profile import ModelProfile, ParamInfo, analyze, named_trainable_parameters

__all__ = ["ModelProfile", "ParamInfo", "analyze", "named_trainable_parameters"]
