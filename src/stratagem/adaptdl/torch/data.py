"""AdaptDL's ``adaptdl.torch.data`` on Stratagem's global-batch loader.

``AdaptiveDataLoader(dataset, batch_size)``: ``batch_size`` is the target total batch; as in
AdaptDL every replica takes ``ceil(batch_size / replicas)`` samples, so the batch in use
(``current_batch_size``) is ``replicas * ceil(batch_size / replicas)``. The position within
an epoch is checkpointed as a sample offset, so a restart with any number of replicas
neither skips nor repeats a sample; a checkpoint saved inside the loop body replays the
batch in hand; a loop already finished in the current epoch before a restart is skipped,
and a loop left with ``break`` ends its pass (the next ``for`` starts a fresh one). Under
``autoscale_batch_size`` a loop is AdaptDL's epoch of scale-invariant progress, which may
take more than one pass.

``ElasticSampler``, ``AdaptiveDataLoaderHelper`` and ``AdaptiveDataLoaderMixin`` are
AdaptDL's building blocks for custom restart-safe loaders; ``current_dataloader()`` is the
helper of the loader being iterated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Sized
from typing import Any, ClassVar

from torch.utils.data import Sampler

from stratagem.adaptdl import env
from stratagem.adaptdl.torch import job
from stratagem.data import DistributedDataLoader, epoch_permutation
from stratagem.elastic.boundary import exit_point
from stratagem.elastic.epoch import current_epoch
from stratagem.elastic.state import State, load_state

LOG = logging.getLogger(__name__)

__all__ = ["AdaptiveDataLoader", "AdaptiveDataLoaderHelper", "AdaptiveDataLoaderMixin",
           "ElasticSampler", "current_dataloader"]


class ElasticSampler(Sampler[int]):
    """This replica's share of a dataset's samples, from ``index`` on, deterministic per
    epoch (``set_epoch``). Replicas take every ``num_replicas``-th sample starting at their
    rank; shorter shares are padded with one repeated sample so all have equal length.
    ``num_replicas`` and ``rank`` come from :mod:`stratagem.adaptdl.env` and may be set."""

    def __init__(self, dataset: Sized, shuffle: bool = True) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.num_replicas = env.num_replicas()
        self.rank = env.replica_rank()
        self.epoch: int | None = 0
        self.index = 0

    def _order(self) -> list[int]:
        n = len(self.dataset)
        epoch_key = 0 if self.epoch is None else int(self.epoch) + 1
        # Same order on every replica; a new one per epoch and per wrap-around of index.
        return epoch_permutation(n, self.index // n, 1_000_003 * epoch_key, self.shuffle)

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        base = self.index % len(order)
        local = order[base + self.rank::self.num_replicas]
        if len(local) < len(self):  # pad to the common length with a sample of this pass
            local.append(order[base + self.rank % (len(order) - base)])
        return iter(local)

    def __len__(self) -> int:
        base = self.index % len(self.dataset)
        return math.ceil((len(self.dataset) - base) / self.num_replicas)

    def set_epoch(self, epoch: int | None, index: int = 0) -> None:
        """Sample epoch ``epoch``'s order from ``index`` (e.g. after a restart)."""
        self.epoch = epoch
        self.index = int(index)


def current_dataloader() -> AdaptiveDataLoaderHelper | None:
    """The helper of the data loader being iterated, or None (as in AdaptDL)."""
    return AdaptiveDataLoaderHelper.current()


_init_count: Counter[int | None] = Counter()


class _HelperState(State):
    """A helper's loop position (and its loader's, see ``extra_state``), kept as JSON."""

    format = "json"

    def __init__(self, helper: AdaptiveDataLoaderHelper) -> None:
        if current_dataloader() is not None:
            raise RuntimeError("dataloader may not be initialized during dataloader iteration")
        epoch = current_epoch()
        name = f"adaptdl-dataloader-epoch{epoch}-{_init_count[epoch]}"
        _init_count[epoch] += 1
        self.helper = helper
        super().__init__(name)

    def state_dict(self) -> dict[str, Any]:
        h = self.helper
        return {"current_index": h.loop_index, "end_index": h.end_index,
                "last_position": {json.dumps(k): v for k, v in h.last_position.items()},
                "extra": h.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        h = self.helper
        h.loop_index = int(state["current_index"])
        h.end_index = int(state["end_index"])
        h.last_position = {json.loads(k): int(v) for k, v in state["last_position"].items()}
        h.load_extra_state(state.get("extra"))


class AdaptiveDataLoaderHelper:
    """Restart-safe bookkeeping for custom data loaders (AdaptDL's helper).

    A custom loader iterates inside :meth:`context`, returns at once if :meth:`skipdone`,
    wraps each batch in :meth:`profile` (a SIGTERM then saves the job state and exits at
    the next batch) and advances :attr:`current_index` by the samples all replicas took.
    ``batch_size`` is the target total batch; each replica takes ``ceil(batch_size /
    replicas)`` (``current_local_bsz``).
    """

    _position: ClassVar[Counter[int | None]] = Counter()  # epoch -> loops begun, all loaders
    _training: ClassVar[AdaptiveDataLoaderHelper | None] = None
    _current: ClassVar[AdaptiveDataLoaderHelper | None] = None

    def __init__(self, batch_size: int = 1) -> None:
        self.batch_size = int(batch_size)
        self._max_batch_size: int | None = None
        self._local_bsz_bounds: tuple[int | None, int | None] | None = None
        self._gradient_accumulation = False
        self._accum_count = 0
        self.loop_index = 0  # samples of the current loop done, all replicas
        self.end_index = 0
        self.last_position: dict[int | None, int] = {}  # epoch -> position of last loop done
        load_state(_HelperState(self))

    @staticmethod
    def current() -> AdaptiveDataLoaderHelper | None:
        """The helper being iterated, or None."""
        return AdaptiveDataLoaderHelper._current

    @staticmethod
    def training_loader() -> AdaptiveDataLoaderHelper | None:
        """The helper of the training loader (see :meth:`train`), or None."""
        return AdaptiveDataLoaderHelper._training

    @staticmethod
    def reset() -> None:
        """Forget loop positions and the training loader (tests, in-process restarts)."""
        AdaptiveDataLoaderHelper._position.clear()
        AdaptiveDataLoaderHelper._training = None
        AdaptiveDataLoaderHelper._current = None
        _init_count.clear()

    # -- state hooks (a loader that keeps its own position adds it here) -------------------
    def extra_state(self) -> Any:
        return None

    def load_extra_state(self, state: Any) -> None:
        """Restore what :meth:`extra_state` returned (None: nothing saved)."""

    # -- position --------------------------------------------------------------------------
    @property
    def current_index(self) -> int | None:
        """Samples processed so far in the current loop by all replicas (None when this
        loader is not being iterated)."""
        return self.loop_index if self.current() is self else None

    @current_index.setter
    def current_index(self, index: int) -> None:
        if self.current() is self:
            self.loop_index = int(index)

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def gradient_accumulation(self) -> bool:
        """Whether ``autoscale_batch_size`` allowed gradient accumulation."""
        return self._gradient_accumulation

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        return self._local_bsz_bounds

    @property
    def current_local_bsz(self) -> int:
        """Samples per replica per (micro-)batch."""
        return math.ceil(self.batch_size / env.num_replicas())

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step beyond the first (0: no accumulation)."""
        return 0

    @property
    def current_batch_size(self) -> int:
        """Total samples per optimizer step over all replicas."""
        return self.current_local_bsz * (self.accumulation_steps + 1) * env.num_replicas()

    def is_accum_step(self) -> bool:
        """Whether the current step only accumulates gradients."""
        return self._accum_count < self.accumulation_steps

    def is_optim_step(self) -> bool:
        return not self.is_accum_step()

    # -- training loader, adaptive batch size -----------------------------------------------
    @property
    def training(self) -> bool:
        return self is AdaptiveDataLoaderHelper._training

    def train(self) -> None:
        """Make this the training loader (the first one asked to be)."""
        if AdaptiveDataLoaderHelper._training is None:
            AdaptiveDataLoaderHelper._training = self

    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int | None, int | None] | None = None,
                             gradient_accumulation: bool = False) -> None:
        """Allow batches up to ``max_batch_size`` (ValueError on bounds that exclude
        ``batch_size``); makes this the training loader."""
        if not isinstance(max_batch_size, int) or max_batch_size < self.batch_size:
            raise ValueError("invalid max_batch_size")
        if local_bsz_bounds is not None and (
                local_bsz_bounds[0] is not None and local_bsz_bounds[0] > self.batch_size
                or local_bsz_bounds[1] is not None and local_bsz_bounds[1] < self.batch_size):
            raise ValueError("invalid local_bsz_bounds")
        self._max_batch_size = max_batch_size
        self._local_bsz_bounds = local_bsz_bounds
        self._gradient_accumulation = gradient_accumulation
        self.train()

    # -- iteration ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Iterate inside it: marks this loader current; at the end (finished or left
        early) the loop counts as done for this epoch and its index restarts at 0."""
        if AdaptiveDataLoaderHelper._current is not None:
            raise RuntimeError("overlapping dataloader iterations detected")
        epoch = current_epoch()
        AdaptiveDataLoaderHelper._current = self
        try:
            yield
        finally:
            self.loop_index = 0
            self.end_index = 0
            self.last_position[epoch] = self._position[epoch]
            self._position[epoch] += 1
            AdaptiveDataLoaderHelper._current = None

    def skipdone(self) -> bool:
        """Whether this loop finished before a restart (skip it); call inside context."""
        epoch = current_epoch()
        position = self._position[epoch]
        if position <= self.last_position.get(epoch, -1):
            LOG.info("skipping %s loop at position %s in epoch %s (done before the restart)",
                     type(self).__name__, position, epoch)
            return True
        return False

    @contextlib.contextmanager
    def profile(self, commit: bool) -> Iterator[None]:
        """Wrap each batch: first an exit point (a pending SIGTERM saves the job state and
        exits 143; collective, so every replica must profile the same batches)."""
        exit_point()
        yield
        self._accum_count = 0 if self.is_optim_step() else self._accum_count + 1

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write the total and local batch size and the accumulation steps to TensorBoard."""
        if tag_prefix and not tag_prefix.endswith("/"):
            tag_prefix += "/"
        writer.add_scalar(tag_prefix + "Total_Batch_Size", self.current_batch_size,
                          global_step)
        writer.add_scalar(tag_prefix + "Local_Batch_Size", self.current_local_bsz,
                          global_step)
        writer.add_scalar(tag_prefix + "Accumulation_Steps", self.accumulation_steps,
                          global_step)


class AdaptiveDataLoaderMixin:
    """Gives a custom loader AdaptDL's public loader API through ``self._elastic`` (an
    :class:`AdaptiveDataLoaderHelper`)."""

    _elastic: AdaptiveDataLoaderHelper

    def __init__(self, batch_size: int) -> None:
        self._elastic = AdaptiveDataLoaderHelper(batch_size)

    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int | None, int | None] | None = None,
                             gradient_accumulation: bool = False) -> None:
        """Let the batch size grow up to ``max_batch_size`` where it raises goodput."""
        self._elastic.autoscale_batch_size(max_batch_size, local_bsz_bounds,
                                           gradient_accumulation)

    @property
    def current_local_bsz(self) -> int | None:
        """This replica's samples per micro-batch while iterating, else None."""
        return self._elastic.current_local_bsz if current_dataloader() is self._elastic else None

    @property
    def accumulation_steps(self) -> int:
        return self._elastic.accumulation_steps

    @property
    def training(self) -> bool:
        return self._elastic.training

    @property
    def current_batch_size(self) -> int | None:
        """Total samples per optimizer step over all replicas while iterating, else None."""
        return (self._elastic.current_batch_size if current_dataloader() is self._elastic
                else None)

    @property
    def max_batch_size(self) -> int | None:
        return self._elastic.max_batch_size

    @property
    def local_bsz_bounds(self) -> tuple[int | None, int | None] | None:
        return self._elastic.local_bsz_bounds

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write the total and local batch size and the accumulation steps to TensorBoard."""
        self._elastic.to_tensorboard(writer, global_step, tag_prefix)


class _LoaderHelper(AdaptiveDataLoaderHelper):
    """The helper of an :class:`AdaptiveDataLoader`: the position and batch configuration
    are those of its Stratagem loader (saved with the helper's state)."""

    def __init__(self, loader: DistributedDataLoader, batch_size: int) -> None:
        self.loader = loader
        super().__init__(batch_size)

    def extra_state(self) -> Any:
        return self.loader.state_dict()

    def load_extra_state(self, state: Any) -> None:
        if state is not None:
            self.loader.load_state_dict(state)

    @property
    def current_index(self) -> int | None:
        return self.loader.position.offset if self.current() is self else None

    @current_index.setter
    def current_index(self, index: int) -> None:  # the Stratagem loader keeps the position
        pass

    def replicas(self) -> int:
        return self.loader.sampler.world_size

    @property
    def accumulation_steps(self) -> int:
        return int(self.loader.accum_steps)

    @property
    def current_local_bsz(self) -> int:
        return math.ceil(self.loader.batch_size / (self.replicas() * (self.accumulation_steps
                                                                      + 1)))

    @property
    def current_batch_size(self) -> int:
        return int(self.loader.batch_size)

    def round_batch_size(self) -> None:
        """Without autoscaling, AdaptDL's batch: ``ceil(batch_size / N)`` per replica."""
        if self.max_batch_size is None:
            n = self.replicas()
            self.loader.batch_size = n * math.ceil(self.batch_size / n)


class AdaptiveDataLoader(AdaptiveDataLoaderMixin):
    """A data loader over this replica's share of each total batch of ``batch_size``.

    Extra keyword arguments go to ``torch.utils.data.DataLoader`` (``num_workers``,
    ``collate_fn``, ``drop_last`` ...); ``sampler`` and ``batch_sampler`` are not supported.
    Iterate it inside ``remaining_epochs_until`` on every replica: between batches it is a
    checkpoint-restart point.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False,
                 **kwargs: Any) -> None:
        if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
            raise ValueError("AdaptiveDataLoader does not support custom 'sampler' or "
                             "'batch_sampler'")
        if current_dataloader() is not None:
            raise RuntimeError("dataloader may not be initialized during dataloader iteration")
        kwargs.pop("sampler", None)
        kwargs.pop("batch_sampler", None)
        ad = job.autodist()
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        world = ad.world_size
        self._loader = DistributedDataLoader(
            dataset, world * math.ceil(self.batch_size / world), rank=ad.rank,
            world_size=world, shuffle=shuffle, seed=ad.seed,
            on_batch=job.set_grad_weight, elastic=True, **kwargs)
        self._loader.base_batch_size = self.batch_size  # the LR rules' reference batch
        # AdaptDL's deal: replica r takes every N-th sample of each batch from the r-th, so
        # each replica's samples (its loss, its BatchNorm statistics, the gradient
        # statistics' local norms) are those it has under AdaptDL
        self._loader.sampler.interleave = True
        self._pending_autoscale: tuple[int, Any, bool] | None = None
        self._elastic = _LoaderHelper(self._loader, self.batch_size)
        job.register_loader(self)

    # -- adaptive batch size ---------------------------------------------------------------
    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int | None, int | None] | None = None,
                             gradient_accumulation: bool = False) -> None:
        """Let the batch size grow up to ``max_batch_size`` where it raises goodput.

        ``local_bsz_bounds``: (min, max) per-replica batch; ``gradient_accumulation``:
        allow several micro-batches per optimizer step. Raises ValueError on bounds that
        exclude ``batch_size``.
        """
        self._elastic.autoscale_batch_size(max_batch_size, local_bsz_bounds,
                                           gradient_accumulation)
        self._loader.batch_size = self.batch_size  # the goodput optimizer splits exactly
        self._pending_autoscale = (max_batch_size, local_bsz_bounds, gradient_accumulation)
        self.attach_autodist(job.autodist())

    def attach_autodist(self, ad: Any) -> None:
        """Join the adaptive loop of the distributed model (AdaptDL scripts build loaders
        before the model); a pending ``autoscale_batch_size`` takes effect then."""
        hooks = getattr(ad, "adaptive", None)
        if hooks is None:
            return
        self._loader.hooks = hooks
        if self._pending_autoscale is not None:
            max_bsz, bounds, accumulation = self._pending_autoscale
            self._pending_autoscale = None
            self._loader.autoscale_batch_size(max_bsz, local_bsz_bounds=tuple(bounds or (
                None, None)), gradient_accumulation=accumulation)

    # -- iteration -----------------------------------------------------------------------
    def __len__(self) -> int:
        self._elastic.round_batch_size()
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        """The rest of this epoch's batches; a loop already completed in this epoch before a
        restart yields nothing."""
        with self._elastic.context():
            if self._elastic.skipdone():
                return
            self._elastic.round_batch_size()  # the replicas may differ since the last loop
            epoch = current_epoch()
            if self.max_batch_size is None or epoch is None:
                yield from self._loader
                return
            yield from self._progress_epoch(epoch)

    def _progress_epoch(self, epoch: int) -> Iterator[Any]:
        """AdaptDL's epoch under autoscaling: batches until the job's scale-invariant
        progress reaches ``(epoch + 1) * len(dataset) / batch_size`` base-batch steps,
        starting further passes over the data as needed (a larger batch whose gain is below
        its scale trains on more samples), or ending a pass early. As in AdaptDL the test
        reads the progress made before the batch's own step, so the epoch ends one step
        after the target is reached. With gradient accumulation it ends after a step's
        last micro-batch (AdaptDL ends after the next micro-batch and carries its gradient
        into the next epoch's first step)."""
        target = (epoch + 1) * len(self.dataset) / self.batch_size
        while True:
            stepped = False
            for batch in self._loader:
                before = _job_progress()
                stepped = True
                yield batch
                held = getattr(self._loader.hooks, "current_batch", None)
                if before >= target and (held is None or held.final):
                    return  # leaving the pass ends it: the next epoch starts a fresh one
            if not stepped:  # an empty pass would loop for ever
                return
            # As in AdaptDL, the test is only made after a batch: a pass that ends at the
            # target still takes one batch of the next.


def _job_progress() -> float:
    """The job's scale-invariant progress (AdaptDL's ``_metrics.get_progress()``)."""
    return max((float(m.gns.get_progress()) for m in job.models()), default=0.0)

