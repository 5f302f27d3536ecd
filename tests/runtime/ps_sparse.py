"""Cases for the sparse PS exchange (runtime/ps/sparse.py): models, batches, steps and their
single-process references. Workers run the same case (ps_workers.sparse_case) on their slice
of each global batch; the test compares both.

Each case aims at one part of the protocol:

``proxy/*``        ``local_proxy_variable`` under bulk-synchronous training: no pulls, every
                   pushed row is an "extra" (index, row) pair, owners refresh the workers'
                   full copies after the update (compared *without* refresh_parameters).
``retain_graph``   two backward passes of one forward before the step: the second push has
                   no announcements left, so all its rows are extras.
``padding``        ``nn.Embedding(padding_idx=PAD)``: the padding id is pulled (announced)
                   but torch leaves it out of the gradient; the owner must not treat it as
                   touched. The row first trains without padding (steps < PAD_FROM, Adam
                   moments become non-zero), so a zero-gradient row taken as touched would
                   decay its moments and move it. One step gives one worker's half of the
                   batch nothing but padding (a gradient with no rows at all).
``twice``          one forward looks the same table up 2 or 3 times with overlapping ids
                   (the third call only for some samples, so workers differ in how many
                   pull rounds they run); overlapping ids are asked once.
``twice-late``     (ps_workers.late_pull_case) ``twice`` where a worker's third call waits
                   until the workers without one have started their backward: their
                   closing pull rounds must not hold their backward back.
``overflow``       batch sizes jump (1 row per worker for several steps, then 32): the
                   agreed header capacity has shrunk, the big step's id lists overflow it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from ps_common import BAG, BATCH, DIM, VOCAB, batch, loss_fn, make_optimizers
from torch import nn

PAD = 0  # the hottest id of ps_common.batch: in almost every batch
PAD_FROM = 4  # steps before it train the row like any other
ALL_PAD_STEP = 6  # the second half of this step's batch is padding only
BIG_VOCAB = 240
BIG_SIZES = (64, 2, 2, 2, 2, 2, 2, 64, 2, 2, 64, 64)  # global batch size per step
BEFORE_THIRD_CALL: Callable[[], None] | None = None  # set by ps_workers.late_pull_case


class SparseNet(nn.Module):
    """A sparse table and the dense tower of ps_common.EmbNet, looked up per ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "pad":
            self.emb: nn.Module = nn.Embedding(VOCAB, DIM, padding_idx=PAD, sparse=True)
        else:
            vocab = BIG_VOCAB if kind == "big" else VOCAB
            self.emb = nn.EmbeddingBag(vocab, DIM, mode="sum", sparse=True)
        self.fc1 = nn.Linear(DIM, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "pad":
            h = self.emb(ids).sum(dim=1)
        elif self.kind == "twice":
            h = self.emb(ids) + self.emb(shifted(ids))
            rows = third_call_rows(ids)
            if len(rows):
                if BEFORE_THIRD_CALL is not None:
                    BEFORE_THIRD_CALL()
                h = h.index_add(0, rows, self.emb(scrambled(ids[rows])))
        else:
            h = self.emb(ids)
        return self.fc2(torch.tanh(self.fc1(h)))


def shifted(ids: torch.Tensor) -> torch.Tensor:
    """The "twice" model's second lookup: mostly ids its first one asked for already."""
    return (ids + 1) % VOCAB


def scrambled(ids: torch.Tensor) -> torch.Tensor:
    return (ids * 5 + 3) % VOCAB


def third_call_rows(ids: torch.Tensor) -> torch.Tensor:
    """Samples the "twice" model looks up a third time (decided per sample, so a worker's
    slice may have none: that worker makes one embedding call less)."""
    return torch.nonzero(ids[:, 0] >= VOCAB // 2).reshape(-1)


def looked_up(ids: torch.Tensor) -> torch.Tensor:
    """Every id the "twice" model looks up for ``ids``."""
    rows = third_call_rows(ids)
    return torch.cat([ids.reshape(-1), shifted(ids).reshape(-1),
                      scrambled(ids[rows]).reshape(-1)])


@dataclass(frozen=True)
class Case:
    model: str  # SparseNet kind ("plain": one lookup of ps_common's table)
    opt: str  # ps_common.make_optimizers name
    steps: int
    builder: str = "PartitionedPS"
    proxy: bool = False  # local_proxy_variable
    retain_graph: bool = False  # a second backward pass of the same forward


CASES = {
    "proxy/PartitionedPS/sgd": Case("plain", "sgd", 12, proxy=True),
    "proxy/PS/adagrad": Case("plain", "adagrad", 12, builder="PS", proxy=True),
    "retain_graph/adagrad": Case("plain", "adagrad", 10, retain_graph=True),
    "padding/adam": Case("pad", "adam", 12),
    "twice/adagrad": Case("twice", "adagrad", 12),
    "overflow/sgd": Case("big", "sgd", len(BIG_SIZES)),
}


def make_model(case: Case, seed: int) -> SparseNet:
    torch.manual_seed(seed)
    return SparseNet(case.model).double()


def global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch; worker r of W takes the r-th of W equal slices."""
    if case.model == "big":
        n = BIG_SIZES[step]
        g = torch.Generator().manual_seed(900 + step)
        return (torch.randint(0, BIG_VOCAB, (n, BAG), generator=g),
                torch.randint(0, 3, (n,), generator=g))
    ids, y = batch(step)
    if case.model == "pad" and step == ALL_PAD_STEP:
        ids = ids.clone()
        ids[BATCH // 2:] = PAD
    return ids, y


def before_step(case: Case, model: nn.Module, step: int) -> None:
    if case.model == "pad":
        model.emb.padding_idx = None if step < PAD_FROM else PAD


def train_step(case: Case, forward: Any, ids: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward pass(es) of one step (``forward``: the model or its wrapper)."""
    out = forward(ids)
    loss_fn(out, y).backward(retain_graph=case.retain_graph)
    if case.retain_graph:
        (0.5 * loss_fn(out, (y + 1) % 3)).backward()


def table_state(opts: list[torch.optim.Optimizer], param: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of ``param`` (the embedding table) as ``optimizer.state_dict()``
    has it (under PS: the owners' state, fetched by the optimizer's hook), cloned."""
    for o in opts:
        params = [p for g in o.param_groups for p in g["params"]]
        index = next((i for i, p in enumerate(params) if p is param), None)
        if index is not None:
            state = o.state_dict()["state"].get(index, {})
            return {k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in state.items()}
    return {}


def reference(name: str) -> dict[str, Any]:
    """Plain torch, one process, the global batches: final values, the table's optimizer
    state, and the padding row after each step."""
    case = CASES[name]
    m = make_model(case, 0)
    opts = make_optimizers(case.opt, m)
    pad_rows = []
    for step in range(case.steps):
        before_step(case, m, step)
        ids, y = global_batch(case, step)
        for o in opts:
            o.zero_grad()
        train_step(case, m, ids, y)
        for o in opts:
            o.step()
        pad_rows.append(m.emb.weight[PAD].detach().clone())
    return {"state": {k: v.detach().clone() for k, v in m.state_dict().items()},
            "table_state": table_state(opts, m.emb.weight), "pad_rows": pad_rows}
