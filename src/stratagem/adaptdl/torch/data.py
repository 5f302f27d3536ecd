"""AdaptDL's ``AdaptiveDataLoader`` on Stratagem's global-batch loader.

``batch_size`` is the total batch over all replicas, split exactly (replicas may get
batches differing by one sample; gradients are weighted so the step equals single-process
training at that batch). The position within an epoch is checkpointed as a sample offset, so
a restart with any number of replicas neither skips nor repeats a sample; a loop already
finished in the current epoch before a restart is skipped, as in AdaptDL.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

from stratagem.adaptdl.torch import _runtime
from stratagem.data import DistributedDataLoader, split_evenly
from stratagem.elastic.epoch import current_epoch
from stratagem.elastic.state import ObjectState, load_state

LOG = logging.getLogger(__name__)
_init_count: Counter[int | None] = Counter()


def current_dataloader() -> AdaptiveDataLoader | None:
    """The AdaptiveDataLoader being iterated, or None."""
    return AdaptiveDataLoader._current


def training_dataloader() -> AdaptiveDataLoader | None:
    """The loader that called ``autoscale_batch_size`` (the training loader), or None."""
    return AdaptiveDataLoader._training


class AdaptiveDataLoader:
    """A data loader over this replica's share of each global batch of ``batch_size``.

    Extra keyword arguments go to ``torch.utils.data.DataLoader`` (``num_workers``,
    ``collate_fn``, ``drop_last`` ...); ``sampler`` and ``batch_sampler`` are not supported.
    Iterate it inside ``remaining_epochs_until`` on every replica: between batches it is a
    checkpoint-restart point.
    """

    _position: ClassVar[Counter[int | None]] = Counter()  # epoch -> loops begun, all loaders
    _current: ClassVar[AdaptiveDataLoader | None] = None
    _training: ClassVar[AdaptiveDataLoader | None] = None

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False,
                 **kwargs: Any) -> None:
        if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
            raise ValueError("AdaptiveDataLoader does not support custom 'sampler' or "
                             "'batch_sampler'")
        if AdaptiveDataLoader._current is not None:
            raise RuntimeError("dataloader may not be initialized during dataloader iteration")
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        ad = _runtime.autodist()
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self._loader = DistributedDataLoader(
            dataset, self.batch_size, rank=ad.rank, world_size=ad.world_size, shuffle=shuffle,
            seed=ad.seed, on_batch=_runtime.set_grad_weight, elastic=True, **kwargs)
        self._pending_autoscale: tuple[int, Any, bool] | None = None
        _runtime.register_loader(self)
        self._max_batch_size: int | None = None
        self._local_bsz_bounds: tuple[int | None, int | None] | None = None
        self._gradient_accumulation = False
        self._last_position: dict[int, int] = {}  # epoch -> loop position last completed
        epoch = current_epoch()
        name = f"adaptdl-dataloader-epoch{epoch}-{_init_count[epoch]}"
        _init_count[epoch] += 1
        load_state(ObjectState(name, self._state_dict, self._load_state_dict, format="json"))

    # -- state ---------------------------------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        return {"loader": self._loader.state_dict(),
                "last_position": {str(k): v for k, v in self._last_position.items()}}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self._loader.load_state_dict(state["loader"])
        self._last_position = {int(k): int(v) for k, v in state["last_position"].items()}

    # -- adaptive batch size ---------------------------------------------------------------
    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int | None, int | None] | None = None,
                             gradient_accumulation: bool = False) -> None:
        """Let the batch size grow up to ``max_batch_size`` where it raises goodput.

        ``local_bsz_bounds``: (min, max) per-replica batch; ``gradient_accumulation``:
        allow several micro-batches per optimizer step. Raises ValueError on bounds that
        exclude ``batch_size``.
        """
        if not isinstance(max_batch_size, int) or max_batch_size < self.batch_size:
            raise ValueError("invalid max_batch_size")
        if local_bsz_bounds is not None and (
                local_bsz_bounds[0] is not None and local_bsz_bounds[0] > self.batch_size
                or local_bsz_bounds[1] is not None and local_bsz_bounds[1] < self.batch_size):
            raise ValueError("invalid local_bsz_bounds")
        self._max_batch_size = max_batch_size
        self._local_bsz_bounds = local_bsz_bounds
        self._gradient_accumulation = gradient_accumulation
        AdaptiveDataLoader._training = self
        self._pending_autoscale = (max_batch_size, local_bsz_bounds, gradient_accumulation)
        self.attach_autodist(_runtime.autodist())

    def attach_autodist(self, ad: Any) -> None:
        """Join the adaptive loop of the distributed model (AdaptDL scripts build loaders
        before the model); a pending ``autoscale_batch_size`` takes effect then."""
        hooks = ad.adaptive
        if hooks is None:
            return
        self._loader.hooks = hooks
        if self._pending_autoscale is not None:
            max_bsz, bounds, accumulation = self._pending_autoscale
            self._pending_autoscale = None
            if not hasattr(self._loader, "autoscale_batch_size"):
                LOG.warning("adaptive batch size is not available in this Stratagem build; "
                            "training at the fixed batch size")
                return
            self._loader.autoscale_batch_size(max_bsz, local_bsz_bounds=tuple(bounds or (
                None, None)), gradient_accumulation=accumulation)

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        return self._local_bsz_bounds

    @property
    def training(self) -> bool:
        return self is AdaptiveDataLoader._training

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step beyond the first (0: no accumulation)."""
        return int(getattr(self._loader, "accum_steps", 0))

    def _global_batch(self) -> int:
        return int(self._loader.batch_size)

    @property
    def current_local_bsz(self) -> int | None:
        """This replica's samples per micro-batch while iterating, else None."""
        if AdaptiveDataLoader._current is not self:
            return None
        return self._local_bsz()

    def _local_bsz(self) -> int:
        micro = -(-self._global_batch() // (self.accumulation_steps + 1))
        sampler = self._loader.sampler
        return split_evenly(micro, sampler.world_size)[sampler.rank][1]

    @property
    def current_batch_size(self) -> int | None:
        """Total samples per optimizer step over all replicas while iterating, else None."""
        if AdaptiveDataLoader._current is not self:
            return None
        return self._global_batch()

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write the total and local batch size and the accumulation steps to TensorBoard."""
        if tag_prefix and not tag_prefix.endswith("/"):
            tag_prefix += "/"
        writer.add_scalar(tag_prefix + "Total_Batch_Size", self._global_batch(), global_step)
        writer.add_scalar(tag_prefix + "Local_Batch_Size", self._local_bsz(), global_step)
        writer.add_scalar(tag_prefix + "Accumulation_Steps", self.accumulation_steps,
                          global_step)

    # -- iteration -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        """The rest of this epoch's batches; a loop already completed in this epoch before a
        restart yields nothing."""
        if AdaptiveDataLoader._current is not None:
            raise RuntimeError("overlapping dataloader iterations detected")
        epoch = current_epoch()
        position = AdaptiveDataLoader._position[epoch]
        AdaptiveDataLoader._position[epoch] += 1
        if epoch is not None and position <= self._last_position.get(epoch, -1):
            LOG.info("skipping %s loop at position %s in epoch %s (done before the restart)",
                     type(self).__name__, position, epoch)
            return
        AdaptiveDataLoader._current = self
        try:
            yield from self._loader
        finally:
            AdaptiveDataLoader._current = None
            if epoch is not None:
                self._last_position = {e: p for e, p in self._last_position.items()
                                       if e >= epoch}
                self._last_position[epoch] = position

