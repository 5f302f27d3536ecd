"""Mixed precision: a ``torch.amp.GradScaler`` whose skip decision every rank shares.

A scaler skips ``optimizer.step()`` when a gradient it unscales is inf/NaN. Distributed,
each rank sees only some gradients: parameter-server gradients live on their owners (a
worker's ``.grad`` of a PS parameter is ``None``), a compressor may hide a value. So a rank
alone could step while another skips, and bulk-synchronous owners would wait forever or
update with inf. :class:`ScalerLink` (``DistributedModel.attach_scaler``) makes the
decision one:

* before each forward it tells the synchronizers the current loss scale: PS gradients are
  unscaled as they are captured (the owners apply true gradients), gradient observers
  (AdaScale's statistics) get the scale to divide by;
* it replaces the scaler's ``unscale_`` (which ``scaler.step`` calls) on this scaler object:
  after torch's own check, one flag -- "some gradient of this rank, PS contributions
  included, is not finite" -- is max-reduced over the workers, and the scaler's
  ``found_inf`` is set to the result on every rank;
* on a skipped step the PS owners (dedicated servers too) drop the pushed gradients, and
  compressor state (PowerSGD's error feedback and Q) returns to what it was before the
  step's backward, so one overflow does not poison later steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stratagem.distributed.process_group import comm_device
from stratagem.errors import StratagemError


class ScalerLink:
    """Binds ``scaler`` to ``model`` (a DistributedModel); see the module docstring."""

    def __init__(self, model: Any, scaler: Any, process_group: Any = None) -> None:
        if not (hasattr(scaler, "unscale_") and hasattr(scaler, "_per_optimizer_states")):
            raise StratagemError(f"expected a torch.amp.GradScaler, got "
                                 f"{type(scaler).__name__}", where="attach_scaler",
                                 fix="pass torch.amp.GradScaler(device) (CPU: 'cpu')")
        ps = model._ps
        if ps is not None and not hasattr(ps, "discard"):
            raise StratagemError(
                "a GradScaler needs a bulk-synchronous parameter server: with staleness or "
                "asynchrony an owner applies a push before any rank knows it overflowed",
                where="attach_scaler",
                fix="use sync: true, staleness: 0, or train without a GradScaler (bf16 "
                    "autocast rarely needs one)")
        self.model = model
        self.scaler = scaler
        self.group = process_group
        self._unscale = scaler.unscale_
        scaler.unscale_ = self.unscale_  # (scaler.step calls self.unscale_)
        self._saved: dict[str, torch.Tensor] | None = None
        self._snapshot_due = True
        if ps is not None:
            ps.check_finite = True

    def detach(self) -> None:
        self.scaler.__dict__.pop("unscale_", None)
        if self.model._ps is not None:
            self.model._ps.check_finite = False
            self.model._ps.loss_scale = 1.0
        self.model._reducer.loss_scale = 1.0

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def before_forward(self) -> None:
        """Tell the synchronizers the loss scale; keep the compressors' state before the
        first backward of a step (restored if the step is skipped)."""
        scale = self.loss_scale()
        reducer = self.model._reducer
        reducer.loss_scale = scale
        if self.model._ps is not None:
            self.model._ps.loss_scale = scale
        if self._snapshot_due and torch.is_grad_enabled():
            state = reducer.state_dict()
            self._saved = state or None
            self._snapshot_due = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's unscale_, then the same inf/NaN decision on every rank."""
        self._unscale(optimizer)
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        ps = self.model._ps
        seen = any(bool(t.item()) for t in found.values())  # torch's own check
        local = seen or (ps is not None and ps.nonfinite)
        flag = torch.tensor([1.0 if local else 0.0])
        if dist.is_available() and dist.is_initialized() and self.model.plan.world_size > 1:
            flag = flag.to(comm_device(self.group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        skip = bool(flag.item())
        device = self.scaler._scale.device if self.scaler._scale is not None else "cpu"
        if skip and not seen:
            found[torch.device(device)] = torch.ones((), device=device)
        elif not found:  # (only PS parameters: torch saw no gradient to check)
            found[torch.device(device)] = torch.zeros((), device=device)
        if skip:
            self._skipped()
        self._snapshot_due = True

    def _skipped(self) -> None:
        if self.model._ps is not None:
            self.model._ps.discard()
        if self._saved is not None:
            self.model._reducer.load_state_dict(self._saved)
