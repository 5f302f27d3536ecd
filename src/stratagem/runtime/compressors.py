"""Gradient compressors: what one group's flat buffer looks like on the wire.

A compressor compresses and decompresses; it does not communicate (as in Horovod's and
torch's compression hooks). The all-reduce reducer owns the collective: for each of the
compressor's ``rounds`` it sums ``compress(round)`` over the ranks and hands the sum back
to ``decompress(round, summed, world_size)``, always in the plan's launch order on every
rank. Round 0 starts as soon as the group's gradients are ready (during backward); a
second round (PowerSGD) starts at the end of backward. The reducer has already scaled the
buffer by ``grad_weight / world_size``, so a sum gives the (weighted) average; scaling
before the sum (rather than dividing after) keeps fp16 sums from overflowing. After the
last round the buffer holds the averaged gradient.

Each compressor owns whatever extra buffers it needs (allocated once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from stratagem.errors import CheckpointError
from stratagem.runtime.plan import GroupPlan
from stratagem.strategy.compressors import (
    SettingsCheck,
    compressor_names,
    register_compressor_name,
)

__all__ = ["Compressor", "compressor_names", "make_compressor", "register_compressor"]

_IMPLEMENTATIONS: dict[str, type[Compressor]] = {}  # names: stratagem.strategy.compressors


def register_compressor(name: str, check: SettingsCheck | None = None
                        ) -> Callable[[type[Compressor]], type[Compressor]]:
    """Class decorator: make a compressor usable as ``AllReduceSynchronizer.compressor``
    (its name goes into the one registry that validation reads; ``check`` validates its
    settings)."""

    def deco(cls: type[Compressor]) -> type[Compressor]:
        register_compressor_name(name, check)
        cls.name = name
        _IMPLEMENTATIONS[name] = cls
        return cls

    return deco


def make_compressor(group: GroupPlan, buffer: torch.Tensor) -> Compressor:
    return _IMPLEMENTATIONS[group.compressor](group, buffer)


class Compressor:
    """No compression: the flat buffer itself is summed; subclasses change what goes on
    the wire (see the module docstring)."""

    name: ClassVar[str] = ""

    def __init__(self, group: GroupPlan, buffer: torch.Tensor) -> None:
        self.group = group
        self.buffer = buffer

    @property
    def rounds(self) -> int:
        """How many all-reduces one step takes."""
        return 1

    def compress(self, round: int) -> torch.Tensor:
        """The tensor to sum over the ranks in ``round`` (summed in place)."""
        return self.buffer

    def decompress(self, round: int, summed: torch.Tensor, world_size: int) -> None:
        """Take ``round``'s sum; after the last round the buffer holds the average."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        if state:
            raise CheckpointError(f"unexpected synchronizer state {sorted(state)}", where=where,
                                  fix=f"compressor {self.name!r} keeps no state; load a state "
                                      "saved with the same strategy")


register_compressor("none")(Compressor)


class CastCompressor(Compressor):
    """Send the buffer in a narrower float type: cast the pre-scaled buffer, sum, cast back.

    gloo sums float16 and bfloat16 natively on CPU (checked with torch 2.13; the test suite
    exercises both), so no emulation is needed. The sum is accumulated in the wire type.
    """

    wire_dtype: ClassVar[torch.dtype]

    def __init__(self, group: GroupPlan, buffer: torch.Tensor) -> None:
        super().__init__(group, buffer)
        self.wire = (None if buffer.dtype == self.wire_dtype
                     else torch.empty_like(buffer, dtype=self.wire_dtype))

    def compress(self, round: int) -> torch.Tensor:
        if self.wire is None:
            return self.buffer
        self.wire.copy_(self.buffer)
        return self.wire

    def decompress(self, round: int, summed: torch.Tensor, world_size: int) -> None:
        if self.wire is not None:
            self.buffer.copy_(self.wire)


@register_compressor("fp16")
class FP16Compressor(CastCompressor):
    wire_dtype = torch.float16


@register_compressor("bf16")
class BF16Compressor(CastCompressor):
    wire_dtype = torch.bfloat16


@register_compressor("powersgd")
class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD (Vogels et al., 2019) with error feedback and warm-started Q.

    Each member whose matrix view M (n x m: first axis x the rest) is big enough is sent as
    P = M Q (n x r) and Q = M^T P (m x r), with P orthogonalized in between; 1-D members
    and matrices that would not shrink by ``MIN_COMPRESSION`` are sent whole, fused into the
    P round. So a group costs two all-reduces: [uncompressed | P], then Q.

    M is the pre-scaled local gradient plus this rank's error E; the two rounds give
    approx = P Q^T ~= sum over ranks of M (the average gradient), and E becomes
    M - approx / N, so the errors sum to what the approximation missed. Q is kept (it is
    identical on all ranks) as the next step's starting point.
    """

    MIN_COMPRESSION: ClassVar[float] = 2.0
    SEED: ClassVar[int] = 1234

    def __init__(self, group: GroupPlan, buffer: torch.Tensor) -> None:
        super().__init__(group, buffer)
        rank = group.powersgd_rank
        dense, plain = [], []
        for m in group.members:
            seg = (m.offset, m.numel)
            if len(m.shape) >= 2:
                rows = m.shape[0]
                cols = m.numel // rows
                r = min(rank, rows, cols)
                if (rows + cols) * r * self.MIN_COMPRESSION < rows * cols:
                    dense.append((seg, rows, cols, r))
                    continue
            plain.append(seg)
        n_plain = sum(n for _, n in plain)
        kw = {"dtype": buffer.dtype, "device": buffer.device}
        self.round1 = torch.empty(n_plain + sum(rows * r for _, rows, _, r in dense), **kw)
        self.q = torch.empty(sum(cols * r for _, _, cols, r in dense), **kw)
        self.error = torch.zeros(sum(rows * cols for _, rows, cols, _ in dense), **kw)
        self.step = torch.zeros((), dtype=torch.int64)
        self.plain = []  # (buffer slice, round1 slice)
        pos = 0
        for off, n in plain:
            self.plain.append((buffer[off:off + n], self.round1[pos:pos + n]))
            pos += n
        self.mats = []  # (M, E, P, Q) views
        gen = torch.Generator().manual_seed(self.SEED + group.id)
        qpos = epos = 0
        for (off, _), rows, cols, r in dense:
            mat = buffer[off:off + rows * cols].view(rows, cols)
            err = self.error[epos:epos + rows * cols].view(rows, cols)
            p = self.round1[pos:pos + rows * r].view(rows, r)
            q = self.q[qpos:qpos + cols * r].view(cols, r)
            q.copy_(torch.randn(cols, r, generator=gen, dtype=torch.float64))
            _orthogonalize(q)
            self.mats.append((mat, err, p, q))
            pos += rows * r
            qpos += cols * r
            epos += rows * cols

    @property
    def compressed(self) -> int:
        """Number of members sent as low-rank factors."""
        return len(self.mats)

    @property
    def rounds(self) -> int:
        """[uncompressed | P], then Q (only when some member is compressed)."""
        return 2 if self.mats else 1

    def compress(self, round: int) -> torch.Tensor:
        if round == 0:
            for src, dst in self.plain:
                dst.copy_(src)
            for mat, err, p, q in self.mats:
                mat.add_(err)
                torch.matmul(mat, q, out=p)
            return self.round1
        for mat, _, p, q in self.mats:  # P summed and orthogonalized: Q = M^T P
            torch.matmul(mat.t(), p, out=q)
        return self.q

    def decompress(self, round: int, summed: torch.Tensor, world_size: int) -> None:
        if round == 0:
            for dst, src in self.plain:
                dst.copy_(src)
            for _, _, p, _ in self.mats:
                _orthogonalize(p)
        else:
            inv = 1.0 / world_size
            for mat, err, p, q in self.mats:
                err.copy_(mat)
                torch.matmul(p, q.t(), out=mat)
                err.add_(mat, alpha=-inv)
        if round == self.rounds - 1:
            self.step += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"error": self.error.clone(), "q": self.q.clone(), "step": self.step.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        own = {"error": self.error, "q": self.q, "step": self.step}
        if set(state) != set(own):
            raise CheckpointError(f"PowerSGD state has keys {sorted(state)}, expected "
                                  f"{sorted(own)}", where=where,
                                  fix="load a state saved with the same strategy and model")
        for key, dst in own.items():
            src = state[key]
            if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
                raise CheckpointError(
                    f"{key}: shape {getattr(src, 'shape', None)} does not match "
                    f"{tuple(dst.shape)}", where=where,
                    fix="load a state saved with the same strategy and model")
            dst.copy_(src)


def _orthogonalize(mat: torch.Tensor) -> None:
    """Orthonormalize the columns of ``mat`` in place (zero columns stay zero)."""
    cols = mat.shape[1]
    if cols > 2 and mat.dtype in (torch.float32, torch.float64):
        q, _ = torch.linalg.qr(mat)
        mat.copy_(q)
        return
    tiny = torch.finfo(mat.dtype).tiny ** 0.5 if mat.dtype.itemsize >= 4 else 1e-7
    for i in range(cols):
        col = mat[:, i:i + 1]
        col.div_(col.norm().clamp_min(tiny))
        if i + 1 < cols:
            rest = mat[:, i + 1:]
            rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))
