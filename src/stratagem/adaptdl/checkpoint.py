"""AdaptDL's ``adaptdl.checkpoint`` on Stratagem's job-state registry.

Subclass :class:`State` and override ``save(fileobj)`` / ``load(fileobj)`` (and ``sync()``)
as in AdaptDL. Checkpoints go to ``ADAPTDL_CHECKPOINT_PATH`` (or
``STRATAGEM_CHECKPOINT_DIR``) as Stratagem checkpoints: atomic, checksummed, the previous one
kept as a fallback (see docs/how-to/elastic-training.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from stratagem.elastic import state as job_state


class State(job_state.State):
    """A named piece of job state saved with every checkpoint; names must be unique."""

    def __init__(self, name: str) -> None:
        if name in job_state.registered_states():
            raise ValueError(f"State '{name}' already exists")
        super().__init__(name)

    def save(self, fileobj: BinaryIO) -> None:
        """Write the state to ``fileobj`` (default: nothing)."""

    def load(self, fileobj: BinaryIO) -> None:
        """Read the state back from ``fileobj`` (default: nothing)."""

    def sync(self) -> None:
        """Make the state consistent across replicas before a save (default: nothing)."""


def save_all_states() -> Path | None:
    """Collectively save every registered state (all replicas call it)."""
    return job_state.save_all_states()


def save_state(state: State, sync: bool = True) -> Path | None:
    """Collectively save ``state`` alone (its ``sync`` first unless ``sync=False``) as a new
    checkpoint; every other state keeps what the latest checkpoint holds."""
    return job_state.save_all_states(only=[state.name], sync=sync)


def load_state(state: State) -> bool:
    """Restore ``state`` from the latest good checkpoint; True if it was saved there."""
    return job_state.load_state(state)


__all__ = ["State", "load_state", "save_all_states", "save_state"]
