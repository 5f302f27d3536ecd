"""Overlap of communication with the backward pass.

Transfers start in launch order, each when its data is ready (its last gradient exists) and
the one before it has finished (one link, used in turn). Communication that ends after the
backward pass is *exposed*: it adds to the step. Communication *overlapped* with the
backward pass is hidden only as far as it leaves the compute its CPU: where moving the
bytes is CPU work on the same cores (a fast link, a busy host), some of it adds too
(:attr:`~stratagem.planner.links.LinkModel.interference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One transfer on the timeline (seconds from the start of backward)."""

    name: str
    ready_s: float
    start_s: float
    end_s: float


def schedule(events: Sequence[tuple[str, float, float]]) -> list[Slot]:
    """``events``: (name, ready time, duration) in launch order -> their slots."""
    t = 0.0
    out = []
    for name, ready, duration in events:
        start = max(t, ready)
        t = start + duration
        out.append(Slot(name, ready, start, t))
    return out


def exposed(slots: Sequence[Slot], compute_end_s: float) -> float:
    """Seconds of communication left when the compute ends."""
    end = max((s.end_s for s in slots), default=0.0)
    return max(0.0, end - compute_end_s)


def overlapped(slots: Sequence[Slot], compute_end_s: float) -> float:
    """Seconds of communication that run while the compute does (before it ends)."""
    return sum(max(0.0, min(s.end_s, compute_end_s) - s.start_s) for s in slots)
