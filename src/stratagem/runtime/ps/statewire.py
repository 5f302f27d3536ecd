"""One piece's optimizer state as plain tensors on the wire (nothing pickled).

An owner answers a worker's state fetch (``fetch.py``) with two tensors: an int64
*manifest* describing each entry, and one uint8 *blob* holding every entry's bytes in
order. Manifest: ``[entries, then per entry: key length, key's UTF-8 bytes..., kind, dtype,
ndim, shape..., (sparse only) nnz]``. Kinds: a dense tensor, a sparse COO tensor with one
sparse dimension (int64 row indices, then values), or a Python int, float or bool (8 bytes).

The receiver checks every field against the piece it asked for before allocating: a dense
tensor is a scalar or of the piece's shape, a sparse one of the piece's shape with at most
one entry per row, so a malformed reply costs no more memory than the piece itself.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.errors import DistributedError

TENSOR, SPARSE, INT, FLOAT, BOOL = 0, 1, 2, 3, 4
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MAX_KEY = 64
MAX_ENTRIES = 64
MAX_MANIFEST = MAX_ENTRIES * (MAX_KEY + 16)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def encode(state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(manifest, blob) of one piece's optimizer state."""
    man: list[int] = [len(state)]
    parts: list[torch.Tensor] = []
    for key, v in state.items():
        kb = key.encode()
        man += [len(kb), *kb]
        if isinstance(v, torch.Tensor) and v.is_sparse:
            v = v.coalesce()
            vals = v.values()
            man += [SPARSE, DTYPES.index(vals.dtype), v.dim(), *v.shape, v._nnz()]
            parts += [_raw(v.indices()[0].to(torch.int64)), _raw(vals)]
        elif isinstance(v, torch.Tensor):
            man += [TENSOR, DTYPES.index(v.dtype), v.dim(), *v.shape]
            parts.append(_raw(v))
        elif isinstance(v, bool):
            man += [BOOL, 0, 0]
            parts.append(_raw(torch.tensor([int(v)], dtype=torch.int64)))
        elif isinstance(v, int):
            man += [INT, 0, 0]
            parts.append(_raw(torch.tensor([v], dtype=torch.int64)))
        elif isinstance(v, float):
            man += [FLOAT, 0, 0]
            parts.append(_raw(torch.tensor([v], dtype=torch.float64)))
        else:
            raise TypeError(f"optimizer state {key!r} is a {type(v).__name__}, not a tensor "
                            "or a number")
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return torch.tensor(man, dtype=torch.int64), blob


def _bad(problem: str, where: str) -> DistributedError:
    return DistributedError(f"malformed optimizer-state reply: {problem}", where=where,
                            fix="all ranks must run the same Stratagem version")


def layout(manifest: torch.Tensor, shape: tuple[int, ...], where: str
           ) -> list[tuple[str, int, torch.dtype, tuple[int, ...], int]]:
    """Checked entries (key, kind, dtype, shape, nnz) of a manifest for a piece of
    ``shape``."""
    m = manifest.tolist()
    pos = 0

    def take(n: int = 1) -> list[int]:
        nonlocal pos
        if pos + n > len(m):
            raise _bad("truncated manifest", where)
        pos += n
        return m[pos - n:pos]

    (count,) = take()
    if not 0 <= count <= MAX_ENTRIES:
        raise _bad(f"{count} entries", where)
    out = []
    for _ in range(count):
        (klen,) = take()
        if not 0 < klen <= MAX_KEY:
            raise _bad(f"a key of {klen} bytes", where)
        kb = take(klen)
        if not all(0 <= b < 256 for b in kb):
            raise _bad("a key that is not bytes", where)
        try:
            key = bytes(kb).decode()
        except UnicodeDecodeError:
            raise _bad("a key that is not UTF-8", where) from None
        kind, dt, ndim = take(3)
        if kind in (INT, FLOAT, BOOL):
            out.append((key, kind, torch.float64 if kind == FLOAT else torch.int64, (), 0))
            continue
        if kind not in (TENSOR, SPARSE) or not 0 <= dt < len(DTYPES) or not 0 <= ndim <= 8:
            raise _bad(f"entry {key!r}: kind {kind}, dtype {dt}, {ndim} dimensions", where)
        dims = tuple(take(ndim))
        nnz = take()[0] if kind == SPARSE else 0
        if dims not in ((), tuple(shape)) or (kind == SPARSE and (
                dims != tuple(shape) or not 0 <= nnz <= shape[0])):
            raise _bad(f"entry {key!r} of shape {list(dims)} ({nnz} rows) for a piece of "
                       f"shape {list(shape)}", where)
        out.append((key, kind, DTYPES[dt], dims, nnz))
    if pos != len(m):
        raise _bad("trailing manifest values", where)
    return out


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def blob_size(entries: list[tuple[str, int, torch.dtype, tuple[int, ...], int]]) -> int:
    """The blob's length in bytes for checked ``entries``."""
    total = 0
    for _key, kind, dtype, dims, nnz in entries:
        size = torch.empty((), dtype=dtype).element_size()
        if kind == SPARSE:
            total += nnz * 8 + nnz * _numel(dims[1:]) * size
        elif kind == TENSOR:
            total += _numel(dims) * size
        else:
            total += 8
    return total


def decode(entries: list[tuple[str, int, torch.dtype, tuple[int, ...], int]],
           blob: torch.Tensor) -> dict[str, Any]:
    """The state dict from checked ``entries`` and a blob of :func:`blob_size` bytes."""
    out: dict[str, Any] = {}
    off = 0

    def take(dtype: torch.dtype, n: int) -> torch.Tensor:
        nonlocal off
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        t = blob[off:off + nbytes].clone().view(dtype)
        off += nbytes
        return t

    for key, kind, dtype, dims, nnz in entries:
        if kind == SPARSE:
            rows = take(torch.int64, nnz)
            vals = take(dtype, nnz * _numel(dims[1:])).view(nnz, *dims[1:])
            out[key] = torch.sparse_coo_tensor(rows.view(1, -1), vals, dims,
                                               check_invariants=True).coalesce()
        elif kind == TENSOR:
            out[key] = take(dtype, _numel(dims)).view(dims)
        elif kind == FLOAT:
            out[key] = float(take(torch.float64, 1).item())
        elif kind == BOOL:
            out[key] = bool(take(torch.int64, 1).item())
        else:
            out[key] = int(take(torch.int64, 1).item())
    return out
