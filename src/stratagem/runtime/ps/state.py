"""Checkpoints of sharded PS state in the single-process format.

A checkpoint holds the model's ``state_dict`` and the user's ``optimizer.state_dict()``
exactly as one process would write them. When ``optimizer.state_dict()`` is called on any
worker, the owners' optimizer state for their pieces is fetched (``fetch.py``) and written
into the user's optimizer for that call (``state[p]`` of each PS parameter, parts
concatenated along their axis, sparse momentum buffers re-indexed), so the usual state
dict is complete. After loading, every owner slices its pieces' values and state out of
the loaded full ones (dedicated servers receive theirs from the chief, as plain tensors),
so a checkpoint restores into any shard layout, server count or strategy -- or into plain
single-process torch.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from stratagem.runtime.ps.plan import PSPiece


def to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu",
                      weights_only=True)


def export_state(state: dict[str, Any]) -> dict[str, Any]:
    """A detached CPU copy of one shard's optimizer state."""
    out = {}
    for k, v in state.items():
        out[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    return out


def _slice_like(piece: PSPiece) -> tuple[int, int, int] | None:
    return None if piece.whole else (piece.axis, piece.start, piece.length)


def consolidate(pieces: Sequence[PSPiece], states: Sequence[dict[str, Any]],
                param: torch.Tensor, user_cls: type) -> dict[str, Any]:
    """The full parameter's optimizer state from its pieces' states (in part order)."""
    if not states or not any(states):
        return {}
    keys = [k for k in states[0] if all(k in s for s in states)]
    out: dict[str, Any] = {}
    for k in keys:
        vals = [s[k] for s in states]
        first = vals[0]
        if isinstance(first, torch.Tensor) and first.is_sparse:
            idx, rows = [], []
            for p, v in zip(pieces, vals, strict=True):
                v = v.coalesce()
                idx.append(v.indices() + p.row_start)
                rows.append(v.values())
            out[k] = torch.sparse_coo_tensor(torch.cat(idx, 1), torch.cat(rows),
                                             tuple(param.shape), check_invariants=False
                                             ).coalesce()
        elif (isinstance(first, torch.Tensor) and first.dim() > 0
              and tuple(first.shape) == tuple(pieces[0].shape)):
            axis = pieces[0].axis if pieces[0].axis is not None else 0
            out[k] = first if len(vals) == 1 else torch.cat(vals, dim=axis)
        else:
            out[k] = first
    return convert_step(out, user_cls)


def convert_step(state: dict[str, Any], cls: type) -> dict[str, Any]:
    """Lazy Adam (SparseAdam) counts steps as an int, torch.optim.Adam as a tensor."""
    step = state.get("step")
    if issubclass(cls, torch.optim.SparseAdam):
        if isinstance(step, torch.Tensor):
            state["step"] = int(step.item())
    elif cls in (torch.optim.Adam, torch.optim.AdamW) and isinstance(step, int | float):
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
    return state


def slice_state(full: dict[str, Any], piece: PSPiece, param_shape: tuple[int, ...]
                ) -> dict[str, Any]:
    """One piece's share of a full parameter's optimizer state."""
    out: dict[str, Any] = {}
    for k, v in full.items():
        if isinstance(v, torch.Tensor) and v.is_sparse:
            v = v.coalesce()
            rows = v.indices()[0]
            keep = (rows >= piece.row_start) & (rows < piece.row_start + piece.rows)
            idx = v.indices()[:, keep].clone()
            idx[0] -= piece.row_start
            out[k] = torch.sparse_coo_tensor(idx, v.values()[keep], tuple(piece.shape),
                                             check_invariants=False).coalesce()
        elif isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param_shape) and v.dim():
            out[k] = (v if piece.whole else v.narrow(piece.axis, piece.start, piece.length)
                      ).clone()
        else:
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out
