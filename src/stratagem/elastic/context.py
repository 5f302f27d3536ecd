"""The job context: everything the job lifecycle keeps for one training process.

One :class:`JobContext` per process holds the registered job states, the chosen restore
point, the SIGTERM request, the in-process rescale membership and the *participants* --
the model, loaders and training loops that follow a membership change through their own
callback (in the manner of Horovod's elastic ``State`` and its reset callbacks). The
lifecycle functions (``load_state``, ``exit_point``, ``rescale_point``...) act on
:func:`current_job`; tests and in-process restarts start from a fresh one with
:func:`job_context`.
"""

from __future__ import annotations

import contextlib
import signal
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

NOT_CHOSEN: Any = object()  # restore point not chosen yet


@dataclass(frozen=True)
class MembershipChange:
    """A new generation of an in-process elastic job, as one member sees it."""

    rank: int  # this member's rank in the new group
    world_size: int
    newcomer: bool  # this member just joined (it received the others' job state)
    joiners: bool  # someone joined (the job state was handed over)


@runtime_checkable
class Participant(Protocol):
    """Something that follows a membership change: ``before_membership_change`` runs in
    the old group before anyone leaves (collectives allowed, e.g. flush queued
    statistics); ``on_membership_change`` runs in the new group after the job state was
    handed over, on every member in the order the participants were registered."""

    def before_membership_change(self) -> None: ...

    def on_membership_change(self, change: MembershipChange) -> None: ...


class JobContext:
    """The lifecycle state of this process's job (see the module docstring)."""

    def __init__(self) -> None:
        self.states: dict[str, Any] = {}  # name -> stratagem.elastic.state.State
        self.restore_point: Path | None = NOT_CHOSEN
        self.pending: dict[str, dict[str, Any]] = {}  # rank 0's states, not created here yet
        self.exit_requested = False  # SIGTERM arrived (or request_exit)
        self.leave_requested = False  # in-process rescale: leave at the next boundary
        self.stop_agreed = False  # in-process rescale: every member leaves, the job stops
        self.exit_holds = 0  # hold_exit() depth
        self.loader_iterations = 0  # data-loader iterations in progress (all loaders)
        self.steps_since_save = 0  # training steps since the last periodic/explicit save
        self.last_save: float | None = None  # rank 0: when the periodic clock (re)started
        self.saving: Any = None  # background_save.BackgroundSave: a checkpoint being written
        self.signal_installed = False
        self.previous_signal_handler: Any = None
        self.group: Any = None  # stratagem.elastic.rescale.ElasticGroup, when in one
        self._participants: list[weakref.ref[Any]] = []
        self._control_group: Any = None

    # -- participants ----------------------------------------------------------------------
    def add_participant(self, participant: Participant) -> None:
        """Register ``participant`` for membership changes (held weakly: a loader that is
        garbage-collected simply drops out)."""
        if not isinstance(participant, Participant):
            raise TypeError(f"{type(participant).__name__} is not a Participant: it needs "
                            "before_membership_change() and on_membership_change(change)")
        self._participants.append(weakref.ref(participant))

    def participants(self) -> list[Any]:
        """The live participants, in registration order."""
        alive = [p for p in (ref() for ref in self._participants) if p is not None]
        self._participants = [weakref.ref(p) for p in alive]
        return alive

    # -- the control group ------------------------------------------------------------------
    def control_group(self) -> Any:
        """A gloo group for small per-step agreements (no GPU synchronization in NCCL
        jobs); follows the default process group of the current generation."""
        if self._control_group is None:
            self._control_group = (dist.group.WORLD if dist.get_backend() == "gloo"
                                   else dist.new_group(backend="gloo"))
        return self._control_group

    def forget_control_group(self) -> None:
        """The default group is being destroyed: a later :meth:`control_group` makes anew."""
        self._control_group = None


_current: list[JobContext] = []  # the process's job context (at most one)


def current_job() -> JobContext:
    """This process's job context (created on first use)."""
    if not _current:
        _current.append(JobContext())
    return _current[0]


def drop_job() -> None:
    """Drop this process's job context: a checkpoint being written in the background is
    finished, the SIGTERM handler goes back to the previous one and the next lifecycle
    call starts with a fresh context (no states, no requests)."""
    if _current:
        ctx = _current.pop()
        if ctx.saving is not None:  # a checkpoint being written finishes (errors reported)
            ctx.saving.join()
        if ctx.signal_installed:
            previous = ctx.previous_signal_handler
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def job_context() -> Iterator[JobContext]:
    """A fresh job context for the block, dropped at its end (tests, in-process restarts)."""
    drop_job()
    ctx = current_job()
    try:
        yield ctx
    finally:
        if _current and _current[0] is ctx:
            drop_job()
