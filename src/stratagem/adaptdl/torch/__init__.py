"""AdaptDL's ``adaptdl.torch`` on Stratagem: change only the imports of an AdaptDL script.

    import stratagem.adaptdl.torch as adl
    adl.init_process_group("gloo")
    loader = adl.AdaptiveDataLoader(dataset, batch_size=128, shuffle=True)
    loader.autoscale_batch_size(4096, local_bsz_bounds=(32, 1024))
    model = adl.AdaptiveDataParallel(model, optimizer, lr_scheduler)
    for epoch in adl.remaining_epochs_until(60): ...
"""

import logging
import re

from stratagem.adaptdl.torch.accumulator import Accumulator
from stratagem.adaptdl.torch.data import (
    AdaptiveDataLoader,
    AdaptiveDataLoaderHelper,
    AdaptiveDataLoaderMixin,
    ElasticSampler,
    current_dataloader,
)
from stratagem.adaptdl.torch.epoch import current_epoch, finished_epochs, remaining_epochs_until
from stratagem.adaptdl.torch.job import init_process_group
from stratagem.adaptdl.torch.parallel import AdaptiveDataParallel
from stratagem.adaptdl.torch.scaling_rules import (
    LEGW,
    AdamScale,
    AdaScale,
    LEGWScale,
    LinearScale,
    ScalingRuleBase,
    SqrtScale,
)

LOG = logging.getLogger(__name__)


def version_check(version: str, lib: str) -> bool:
    """Whether ``version`` is a release number (``X.Y.Z``, not 0.0.0); logs otherwise.
    AdaptDL compares its trainer and scheduler versions with it."""
    if re.match(r"[0-9]+\.[0-9]+\.[0-9]+", version) and version != "0.0.0":
        return True
    LOG.info("adaptdl version of %s is a custom version", lib)
    return False


__all__ = [
    "LEGW",
    "Accumulator",
    "AdaScale",
    "AdamScale",
    "AdaptiveDataLoader",
    "AdaptiveDataLoaderHelper",
    "AdaptiveDataLoaderMixin",
    "ElasticSampler",
    "AdaptiveDataParallel",
    "LEGWScale",
    "LinearScale",
    "ScalingRuleBase",
    "SqrtScale",
    "current_dataloader",
    "current_epoch",
    "finished_epochs",
    "init_process_group",
    "remaining_epochs_until",
    "version_check",
]
