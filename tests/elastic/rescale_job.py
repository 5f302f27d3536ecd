"""A plain AutoDist training script used by the in-process rescale test and benchmark.

Started with ``STRATAGEM_RESCALE_STORE`` (and ``STRATAGEM_RESCALE_NPROC`` for the first
workers), it joins the job's elastic group. Every step appends the sample ids it trained on
to ``OUT/ids-<pid>.jsonl``. ``--leave-at S --leave-rank R``: rank R leaves after step S.
``--sigterm-at S``: rank R (``--leave-rank``) gets SIGTERM at the boundary after step S,
just after the members agreed on who leaves (the window where a SIGTERM once stopped the
whole job instead of making one worker leave). ``--wait-joiner-at S``: at step S a lone
rank 0 waits until a new worker is ready to join, so that the join lands at a known step.
``--join-after-gen G``: a worker started early waits until the job reached generation G
before it starts (joins late). At the end every worker writes ``OUT/changes-<pid>.json``
(its rescales) and rank 0 ``OUT/final.pt``. ``--uncopyable``: the model holds an attribute
``copy.deepcopy`` refuses (stage 3 is then refused).

The job: 3 epochs over 48 samples, global batch 8 (6 steps per epoch), Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stratagem as sg
from stratagem.data import epoch_permutation
from stratagem.elastic import rescale

N, EPOCHS, BATCH, SEED = 48, 3, 8, 0


def make_model(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 2))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.arange(N), torch.randn(N, 6, generator=g),
                         torch.randn(N, 2, generator=g))


def wait_for_generation(number: int) -> None:
    """Block until the job's rescale store records generation ``number``."""
    from datetime import timedelta

    host, port = rescale.parse_address(os.environ[rescale.ENV_STORE])
    store = torch.distributed.TCPStore(host, port, is_master=False,
                                       timeout=timedelta(seconds=60))
    while (gen := rescale.current_generation(store, None)) is None or gen.number < number:
        time.sleep(0.01)


def sigterm_after_next_agreement() -> None:
    """SIGTERM to this worker right after the next boundary's rescale agreement returns
    (before the boundary's own stop agreement reads the signal flag)."""
    from stratagem.elastic import boundary

    agree = boundary.rescale_point

    def then_sigterm() -> rescale.Change | None:
        boundary.rescale_point = agree
        change = agree()
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        return change

    boundary.rescale_point = then_sigterm


def train(out: Path, leave_at: int = 0, leave_rank: int = -1, wait_joiner_at: int = 0,
          width: int = 16, epochs: int = EPOCHS, step_sleep: float = 0.0,
          autoscale: bool = False, engine: str = "", zero: int = 0,
          sigterm_at: int = 0, uncopyable: bool = False) -> None:
    # engine: "" AutoDist's default builder; "stratagem"/"ddp" AllReduce on that engine
    builder = sg.strategy.AllReduce(engine=engine) if engine else None
    if zero:  # sharded: ZeRO at that stage (optimizer state split over the workers)
        from stratagem.strategy.builders import ZeRO

        builder = ZeRO(stage=zero)
    ad = sg.AutoDist(strategy_builder=builder, verbose=False)
    plain = make_model(width)
    if uncopyable:  # an attribute copy.deepcopy refuses (stage 3 rebuilds from a copy)
        plain.lock = threading.Lock()
    model, opt = ad.distribute(plain, torch.optim.Adam(plain.parameters(), lr=0.01))
    loader = ad.data_loader(dataset(), batch_size=BATCH, shuffle=True, seed=SEED)
    if autoscale:
        loader.autoscale_batch_size(32, gradient_accumulation=True)
    group = rescale.active_group()
    with (out / f"ids-{os.getpid()}.jsonl").open("a") as log:
        for epoch in ad.remaining_epochs_until(epochs):
            for ids, x, y in loader:
                # 1-based number of the batch in hand (the position counts the batches
                # before it: the one in hand is consumed when the loop asks for the next)
                step = loader.position.offset // BATCH + 1 + epoch * (N // BATCH)
                log.write(json.dumps({"step": step, "epoch": epoch, "rank": ad.rank,
                                      "world": ad.world_size, "ids": ids.tolist(),
                                "engine": model.plan.engine,
                                      "sharded": model.is_sharded,
                                      "state_numel": _state_numel(opt),
                                      "time": time.time()}) + "\n")
                log.flush()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if step == leave_at and ad.rank == leave_rank:
                    rescale.request_leave()
                if step == sigterm_at and ad.rank == leave_rank:
                    sigterm_after_next_agreement()
                if step == wait_joiner_at and ad.rank == 0 and ad.world_size == 1:
                    while not group.ready_joiners():
                        time.sleep(0.005)
                if step_sleep:
                    time.sleep(step_sleep)
    changes = [asdict(c) for c in group.history] if group is not None else []
    (out / f"changes-{os.getpid()}.json").write_text(json.dumps(changes))
    optimizer = model.full_optimizer_state_dict(opt)  # (collective when sharded)
    whole = model.full_state_dict()  # (collective with stage-3 units)
    if ad.rank == 0:
        torch.save({"model": whole, "optimizer": optimizer}, out / "final.pt")


def _state_numel(opt: torch.optim.Optimizer) -> int:
    """Elements of optimizer state this worker holds (a sharded job: its share)."""
    return sum((v.to_local() if hasattr(v, "to_local") else v).numel()  # (a DTensor: its rows)
               for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def reference(epochs: int = EPOCHS) -> dict[str, Any]:
    """The same training, uninterrupted, in one process with plain torch."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _, xs, ys = dataset().tensors
    for epoch in range(epochs):
        order = epoch_permutation(N, epoch, SEED, shuffle=True)
        for start in range(0, N, BATCH):
            idx = order[start:start + BATCH]
            opt.zero_grad()
            nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--leave-at", type=int, default=0)
    parser.add_argument("--leave-rank", type=int, default=-1)
    parser.add_argument("--wait-joiner-at", type=int, default=0)
    parser.add_argument("--sigterm-at", type=int, default=0)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--join-after-gen", type=int, default=0)
    parser.add_argument("--autoscale", action="store_true")
    parser.add_argument("--engine", default="", choices=["", "stratagem", "ddp"])
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--uncopyable", action="store_true")
    a = parser.parse_args()
    if a.join_after_gen:
        wait_for_generation(a.join_after_gen)
    train(a.out, a.leave_at, a.leave_rank, a.wait_joiner_at, a.width, a.epochs, a.step_sleep,
          a.autoscale, a.engine, a.zero, a.sigterm_at, a.uncopyable)
