"""Restart-aware epochs: ``for epoch in remaining_epochs_until(30): ...``.

The epoch counter is part of the job state (the state ``epoch``). After a restart the loop
resumes at the checkpointed epoch; a checkpoint taken mid-epoch resumes that same epoch,
and the data loader continues it from the next unseen sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stratagem.elastic.boundary import exit_point
from stratagem.elastic.signals import uninstall_signal_handler
from stratagem.elastic.state import State, load_state, registered_states
from stratagem.errors import StratagemError


class EpochState(State):
    """``epoch``: the epoch in progress, or the next one to start; ``active``: in the loop."""

    format = "json"

    def __init__(self) -> None:
        self.epoch = 0
        self.active = False
        super().__init__("epoch")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])


def _state() -> EpochState:
    state = registered_states().get("epoch")
    if not isinstance(state, EpochState):
        state = EpochState()
        load_state(state)
    return state


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the current one (0, or the checkpointed one) up to ``epoch - 1``.

    Between epochs, and after the last one, it is an exit point: a pending SIGTERM saves
    the job state and exits. When the loop completes, SIGTERM gets its default effect back.
    """
    state = _state()
    if state.active:
        raise StratagemError("remaining_epochs_until loops cannot be nested",
                             where="remaining_epochs_until",
                             fix="use one epoch loop per training job")
    try:
        while state.epoch < epoch:
            exit_point()
            state.active = True
            yield state.epoch
            state.active = False
            state.epoch += 1
        exit_point()
        uninstall_signal_handler()
    finally:
        state.active = False


def current_epoch() -> int | None:
    """The epoch in progress inside ``remaining_epochs_until``, else None."""
    state = registered_states().get("epoch")
    return state.epoch if isinstance(state, EpochState) and state.active else None


def finished_epochs() -> int:
    """How many epochs were completed (including those before a restart)."""
    return _state().epoch
