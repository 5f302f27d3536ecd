"""Error types that carry what went wrong, where, and how to fix it.

Every user-facing failure raises a subclass of :class:`StratagemError`; the CLI and the
worker excepthook print these as one readable message instead of a traceback.
"""

from __future__ import annotations

import sys
from types import TracebackType


class StratagemError(Exception):
    """Base class: a message naming the thing (``where``), the problem and the fix."""

    def __init__(self, problem: str, *, where: str | None = None, fix: str | None = None) -> None:
        self.problem = problem
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.where}: {self.problem}" if self.where else self.problem
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class ResourceSpecError(StratagemError):
    """The resource spec file is missing, malformed or inconsistent."""


class StrategyError(StratagemError):
    """A strategy is malformed, or does not fit the model or the resources."""


class UnsupportedModelError(StratagemError):
    """The model uses something the engine cannot distribute."""


class LaunchError(StratagemError):
    """Starting or supervising workers failed."""


class CheckpointError(StratagemError):
    """A checkpoint is missing, corrupt or does not match the model."""


class DistributedError(StratagemError):
    """A peer failed or the process group could not be formed."""


def install_excepthook() -> None:
    """Print uncaught :class:`StratagemError` as a one-line message, not a traceback.

    Other exceptions keep the default hook. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_stratagem", False):
        return

    def hook(
        kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        if isinstance(value, StratagemError):
            rank = _rank_prefix()
            print(f"stratagem error{rank}: {value.render()}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    hook._stratagem = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _rank_prefix() -> str:
    import os

    rank = os.environ.get("RANK")
    return f" (rank {rank})" if rank is not None else ""
