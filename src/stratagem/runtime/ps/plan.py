"""The parameter-server part of a plan: pieces, their owners and the dense buckets.

Rank layout (logical ranks, see docs/concepts/parameter-server.md): the workers are ranks
``0..W-1`` in ``graph_config.replicas`` order, the dedicated servers ranks ``W..W+S-1`` in
server order (``ADDRESS:PS:0``, the resource spec's nodes with ``workers: 0``). A PS
*piece* is a whole parameter or one part of a partitioned one; its *owner* is the logical
rank named by the synchronizer's ``reduction_destination``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from stratagem.analysis.profile import ParamInfo
from stratagem.errors import StrategyError

BUCKET_BYTES = 8 * 2**20  # dense PS gradients are fused per owner up to this size


@dataclass(frozen=True)
class PSPiece:
    """One parameter (``axis`` None) or the slice ``[start, start+length)`` along ``axis``.

    ``sparse``: the piece travels as (row indices, rows): its parameter is an embedding
    table with sparse gradients, or an untied dense-declared embedding whose touched rows
    are captured from its inputs (``sparse_grad`` False), or a dense-declared parameter whose
    strategy asks for rows (``row_sparse``): ``rows_from_grad``, its rows are the non-zero
    rows of its dense gradient. ``bucket``/``offset`` place a
    dense piece in its bucket's flat buffer (-1 for sparse pieces).
    """

    id: int
    param: str
    index: int
    shape: tuple[int, ...]
    dtype: str
    owner: int
    destination: str
    axis: int | None = None
    start: int = 0
    length: int = 0
    part: int | None = None
    sparse: bool = False
    sparse_grad: bool = False
    local_replication: bool = False
    rows_from_grad: bool = False
    bucket: int = -1
    offset: int = 0

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.axis is None

    @property
    def rows(self) -> int:
        """Rows (axis-0 length) of the piece."""
        return self.shape[0] if self.shape else 1

    @property
    def row_start(self) -> int:
        """First row of the parameter this piece holds (axis-0 pieces and whole ones)."""
        return self.start if self.axis == 0 else 0

    def describe(self) -> str:
        where = ("" if self.whole
                 else f"[axis {self.axis}: {self.start}:{self.start + self.length}]")
        kind = "sparse" if self.sparse else "dense"
        return (f"{self.param}{where}{list(self.shape)} {kind} -> rank {self.owner} "
                f"({self.destination})")


@dataclass(frozen=True)
class PSBucket:
    """Dense pieces of one owner and dtype, reduced to the owner as one flat buffer.

    The buffer holds the pieces back to back, then one *presence* slot per piece (summed
    over the workers: how many had a gradient for it).
    """

    id: int
    owner: int
    dtype: str
    pieces: tuple[int, ...]
    numel: int

    @property
    def size(self) -> int:
        return self.numel + len(self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer a worker pushes (values and presence slots)."""
        return self.size * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class PSPlan:
    """All PS pieces and dense buckets (identical on every rank)."""

    workers: int
    servers: tuple[str, ...]
    pieces: tuple[PSPiece, ...]
    buckets: tuple[PSBucket, ...]  # launch order
    sync: bool = True
    staleness: int = 0
    replicas: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Workers plus dedicated servers."""
        return self.workers + len(self.servers)

    @property
    def dense(self) -> tuple[PSPiece, ...]:
        return tuple(p for p in self.pieces if not p.sparse)

    @property
    def sparse(self) -> tuple[PSPiece, ...]:
        return tuple(p for p in self.pieces if p.sparse)

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(sorted({p.owner for p in self.pieces}))

    @property
    def mode(self) -> str:
        if not self.sync:
            return "async"
        return f"staleness {self.staleness}" if self.staleness else "bsp"

    def owned_by(self, rank: int) -> tuple[PSPiece, ...]:
        return tuple(p for p in self.pieces if p.owner == rank)

    def pieces_of(self, param: str) -> tuple[PSPiece, ...]:
        return tuple(p for p in self.pieces if p.param == param)

    def summary_lines(self) -> list[str]:
        lines = [f"  parameter server ({self.mode}): {len(self.pieces)} pieces, "
                 f"{self.workers} workers, {len(self.servers)} dedicated servers "
                 f"{list(self.servers)}"]
        lines.extend(f"    {p.describe()}" for p in self.pieces)
        for b in self.buckets:
            lines.append(f"    bucket {b.id}: owner {b.owner}, {b.dtype}, {b.numel:,} values, "
                         f"pieces {list(b.pieces)}")
        return lines


def uses_sparse_path(info: ParamInfo) -> bool:
    """Whether a PS parameter travels as rows: sparse gradients, or an untied embedding."""
    return info.sparse_access


def owner_of(destination: str, replicas: tuple[str, ...], servers: tuple[str, ...],
             where: str) -> int:
    if destination in replicas:
        return replicas.index(destination)
    if destination in servers:
        return len(replicas) + servers.index(destination)
    raise StrategyError(f"reduction_destination {destination!r} is neither a worker replica "
                        f"{list(replicas)} nor a server {list(servers)}", where=where,
                        fix="use a device of the resource spec (validate the strategy)")


def make_buckets(pieces: list[PSPiece], limit: int = BUCKET_BYTES
                 ) -> tuple[list[PSPiece], list[PSBucket]]:
    """Fuse dense pieces per (owner, dtype) in backward order; returns placed pieces."""
    order = sorted((p for p in pieces if not p.sparse),
                   key=lambda p: (-p.index, p.part or 0))
    open_: dict[tuple[int, str], list[PSPiece]] = {}
    groups: list[list[PSPiece]] = []
    for p in order:
        key = (p.owner, p.dtype)
        itemsize = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
        cur = open_.get(key)
        if cur is None or (sum(q.numel for q in cur) + p.numel) * itemsize > limit:
            cur = []
            open_[key] = cur
            groups.append(cur)
        cur.append(p)
    groups.sort(key=lambda g: (-min(p.index for p in g), g[0].owner))
    placed: dict[int, PSPiece] = {p.id: p for p in pieces}
    buckets = []
    for bid, g in enumerate(groups):
        offset = 0
        for p in g:
            placed[p.id] = _replace(p, bucket=bid, offset=offset)
            offset += p.numel
        buckets.append(PSBucket(id=bid, owner=g[0].owner, dtype=g[0].dtype,
                                pieces=tuple(p.id for p in g), numel=offset))
    return [placed[p.id] for p in pieces], buckets


def _replace(p: PSPiece, **kw: object) -> PSPiece:
    from dataclasses import replace

    return replace(p, **kw)
