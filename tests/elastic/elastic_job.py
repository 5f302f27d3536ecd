"""A small elastic training job, and its plain-torch reference.

Run by torchrun (``python -m torch.distributed.run ... elastic_job.py --out DIR``) or called
in-process (:func:`train`). Every step appends the sample ids it trained on to
``DIR/ids-<pid>.jsonl``. With ``--stop-at S`` each rank, in the middle of step ``S`` (after
backward, before the optimizer step), writes ``DIR/ready-<rank>`` and waits for SIGTERM; the
step then completes and the loader's exit point saves the job state and exits 143. At the
end rank 0 writes ``DIR/final.pt`` (model and optimizer state).

The job: 3 epochs over 40 samples, global batch 8, switched to 12 during step 3 (a batch
size change mid-epoch), Adam, and a user State counting steps. After its first step, rank 0
of each run writes ``DIR/run-<pid>.json``: its world size, strategy id, and whether Auto
planned in this run (a resumed run on the same workers keeps the checkpoint's strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stratagem as sg
from stratagem.adapt import State, exit_requested, load_state
from stratagem.data import epoch_permutation

N, EPOCHS, BATCH, NEW_BATCH, RESIZE_AT, SEED = 40, 3, 8, 12, 3, 0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.arange(N), torch.randn(N, 5, generator=g),
                         torch.randn(N, 2, generator=g))


class StepCounter(State):
    """User state: the global step (JSON)."""

    format = "json"

    def __init__(self) -> None:
        self.step = 0
        super().__init__("steps")

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _wait_for_sigterm(out: Path, rank: int, timeout: float = 60.0) -> None:
    (out / f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not exit_requested():
        if time.monotonic() > deadline:
            raise TimeoutError("no SIGTERM arrived")
        time.sleep(0.005)


def train(out: Path, stop_at: int | None = None, on_step: Any = None,
          zero: int = 0) -> dict[str, Any]:
    """The training script; returns the final model and optimizer state dicts. ``zero``:
    shard with ZeRO at that stage (default: AutoDist's default builder)."""
    builder = None
    if zero:
        from stratagem.strategy.builders import ZeRO

        builder = ZeRO(stage=zero)
    ad = sg.AutoDist(strategy_builder=builder, verbose=False)
    plain = make_model()
    model, opt = ad.distribute(plain, make_optimizer(plain))
    loader = ad.data_loader(dataset(), batch_size=BATCH, shuffle=True, seed=SEED)
    counter = StepCounter()
    load_state(counter)
    log = (out / f"ids-{os.getpid()}.jsonl").open("a")
    first = True
    for epoch in ad.remaining_epochs_until(EPOCHS):
        for ids, x, y in loader:
            counter.step += 1
            log.write(json.dumps({"step": counter.step, "epoch": epoch, "rank": ad.rank,
                                  "world": ad.world_size, "ids": ids.tolist(),
                                  "sharded": model.is_sharded}) + "\n")
            log.flush()
            if counter.step == RESIZE_AT:
                loader.batch_size = NEW_BATCH  # from the next batch on, mid-epoch
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if counter.step == stop_at:
                _wait_for_sigterm(out, ad.rank)
            if on_step is not None:
                on_step(counter.step)
            opt.step()
            if first and ad.rank == 0:
                (out / f"run-{os.getpid()}.json").write_text(json.dumps(
                    {"world": ad.world_size, "strategy": ad.strategy.id,
                     "planned": ad.choice is not None,
                     "explain": ad.explain() if builder is None else ""}))
            first = False
    log.close()
    # whole state on every rank (collective when the model is sharded)
    final = {"model": model.full_state_dict(), "optimizer": model.full_optimizer_state_dict(opt)}
    if ad.rank == 0:
        torch.save(final, out / "final.pt")
    return final


def reference() -> dict[str, Any]:
    """The same training, uninterrupted, in one process with plain torch."""
    model = make_model()
    opt = make_optimizer(model)
    _, xs, ys = dataset().tensors
    step, batch = 0, BATCH
    for epoch in range(EPOCHS):
        order = epoch_permutation(N, epoch, SEED, shuffle=True)
        offset = 0
        while offset < N:
            idx = order[offset:offset + batch]
            offset += len(idx)
            step += 1
            if step == RESIZE_AT:
                batch = NEW_BATCH
            opt.zero_grad()
            nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def reference_batches() -> list[list[int]]:
    """The global batches, in order, over all epochs (ids)."""
    out, batch = [], BATCH
    for epoch in range(EPOCHS):
        order = epoch_permutation(N, epoch, SEED, shuffle=True)
        offset = 0
        while offset < N:
            out.append(order[offset:offset + batch])
            offset += len(out[-1])
            if len(out) == RESIZE_AT:
                batch = NEW_BATCH
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    args = parser.parse_args()
    train(args.out, args.stop_at, zero=args.zero)
