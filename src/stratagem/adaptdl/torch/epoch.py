"""AdaptDL's ``adaptdl.torch.epoch``: restart-aware epoch loops (Stratagem's).

Code right before an epoch loop, and right before each data-loader loop inside it, may run
again after a restart: keep it idempotent (e.g. step LR schedulers at the end of the epoch).
"""

from stratagem.elastic.epoch import current_epoch, finished_epochs, remaining_epochs_until

__all__ = ["current_epoch", "finished_epochs", "remaining_epochs_until"]
