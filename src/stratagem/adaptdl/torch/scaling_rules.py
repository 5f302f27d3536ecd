"""AdaptDL's ``adaptdl.torch.scaling_rules``: Stratagem's learning-rate scaling rules.

``AdaScale`` (default), ``AdamScale``, ``LinearScale``, ``SqrtScale`` and ``LEGWScale``
(also as ``LEGW``) are the rules of :mod:`stratagem.adapt.scaling_rules`; pass one to
``AdaptiveDataParallel(..., scaling_rule=...)``.
"""

from __future__ import annotations

import numpy as np

from stratagem.adapt import GradientNoiseScale
from stratagem.adapt.scaling_rules import LEGW, AdamScale, AdaScale, LinearScale, SqrtScale
from stratagem.adapt.scaling_rules import ScalingRule as ScalingRuleBase


class LEGWScale(LEGW):
    """LEGW with AdaptDL's signature; the base batch is the training loader's batch_size."""

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        super().__init__(base_warmup_epochs, data_size, base_batch_size=1)

    def lr_factors(self, scale: float, gns: GradientNoiseScale | None = None,
                   progress: float = 0.0, num_groups: int = 1) -> np.ndarray:
        from stratagem.adaptdl.torch.data import current_dataloader, training_dataloader

        loader = training_dataloader() or current_dataloader()
        if loader is not None:
            self.base_batch_size = loader.batch_size
        return super().lr_factors(scale, gns, progress, num_groups)


__all__ = ["LEGW", "AdaScale", "AdamScale", "LEGWScale", "LinearScale", "ScalingRuleBase",
           "SqrtScale"]
