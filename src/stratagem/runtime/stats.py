"""Communication counters: what the runtime sent and how long it waited."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CommStats:
    """Per-rank counters, cumulative until :meth:`reset`.

    ``payload_bytes`` counts the tensors handed to collectives; ``wire_bytes`` estimates
    what this rank puts on the wire: ``2*(N-1)/N*payload`` for a ring all-reduce and
    ``(N-1)/N*payload`` for a broadcast. ``wait_seconds`` is host time blocked in
    ``Work.wait()``. ``overlapped`` counts collectives launched from gradient hooks, i.e.
    while backward was still running.

    Parameter-server traffic of a worker (to and from other ranks, not itself):
    ``push_bytes`` gradients sent to owners (dense buckets; sparse row indices, rows and
    counts), ``pull_bytes`` what it took to get values back (dense buckets; sparse
    requests and rows), ``rows_pushed``/``rows_pulled`` sparse rows. An owner's
    ``paced_receives`` counts the large pushes it received one worker at a time
    (``runtime/ps/pacing.py``).
    """

    collectives: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    wait_seconds: float = 0.0
    overlapped: int = 0
    steps: int = 0
    push_bytes: int = 0
    pull_bytes: int = 0
    rows_pushed: int = 0
    rows_pulled: int = 0
    paced_receives: int = 0

    def record(self, nbytes: int, world_size: int, kind: str = "all_reduce") -> None:
        self.collectives += 1
        self.payload_bytes += nbytes
        factor = 2.0 if kind == "all_reduce" else 1.0
        self.wire_bytes += factor * (world_size - 1) / world_size * nbytes

    def add(self, other: CommStats) -> None:
        """Add ``other``'s counters to these (counts kept apart by a background thread)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def summary(self) -> str:
        return (f"{self.steps} synced steps, {self.collectives} collectives "
                f"({self.overlapped} overlapped with backward), "
                f"{self.payload_bytes / 2**20:.2f} MiB payload, "
                f"{self.wire_bytes / 2**20:.2f} MiB on the wire, "
                f"{self.wait_seconds:.3f} s waiting"
                + (f"; PS push {self.push_bytes / 2**20:.3f} MiB ({self.rows_pushed} rows), "
                   f"pull {self.pull_bytes / 2**20:.3f} MiB ({self.rows_pulled} rows)"
                   if self.push_bytes or self.pull_bytes else ""))
