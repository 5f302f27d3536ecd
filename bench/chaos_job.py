"""A deterministic elastic training job for chaos runs (``bench/chaos.py``).

Run by ``stratagem run --checkpoint-dir ... chaos_job.py --out DIR``. Every rank appends one
line per step to ``DIR/steps-rank<R>.jsonl``: the attempt (``STRATAGEM_RESTART_COUNT``),
the global step (a job State, so it is restored with everything else), the epoch, the sample
ids this rank trained on, its pid, the wall time, and the world size, global batch size and
accumulation steps it ran at. At the end rank 0 writes
``DIR/final.pt`` (model and optimizer state dicts).

The job: 4 epochs over 96 samples, global batch 8 (12 steps per epoch), an MLP, Adam; every
step sleeps ``--step-sleep`` seconds so that a kill lands in the middle of training.
:func:`reference` trains the same thing in one process with plain torch.
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

N, EPOCHS, BATCH, SEED = 96, 4, 8, 0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.arange(N), torch.randn(N, 6, generator=g),
                         torch.randn(N, 2, generator=g))


# --adaptive: the base batch BATCH may grow to ADAPTIVE_MAX; at most ADAPTIVE_LOCAL samples
# per replica and micro-batch, so one replica accumulates two micro-batches for the base batch
# that two replicas take in one step: the configuration follows the world size.
ADAPTIVE_MAX, ADAPTIVE_LOCAL = 32, 4


def train(out: Path, step_sleep: float, adaptive: bool = False, epochs: int = EPOCHS) -> None:
    import stratagem as sg
    from stratagem import env
    from stratagem.adapt import ObjectState, load_state

    ad = sg.AutoDist(verbose=False)
    plain = make_model()
    model, opt = ad.distribute(plain, make_optimizer(plain))
    loader = ad.data_loader(dataset(), batch_size=BATCH, shuffle=True, seed=SEED)
    if adaptive:
        loader.autoscale_batch_size(ADAPTIVE_MAX, local_bsz_bounds=(1, ADAPTIVE_LOCAL),
                                    gradient_accumulation=True)
    counter = {"step": 0}
    load_state(ObjectState("steps", lambda: dict(counter), counter.update, format="json"))
    attempt = env.restart_count()
    with (out / f"steps-rank{ad.rank}.jsonl").open("a") as log:
        for epoch in ad.remaining_epochs_until(epochs):
            for ids, x, y in loader:
                counter["step"] += 1
                log.write(json.dumps({"attempt": attempt, "step": counter["step"],
                                      "epoch": epoch, "rank": ad.rank, "pid": os.getpid(),
                                      "time": time.time(), "ids": ids.tolist(),
                                      "world": ad.world_size, "batch": loader.batch_size,
                                      "accum": loader.accum_steps}) + "\n")
                log.flush()
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                time.sleep(step_sleep)
                opt.step()
    if ad.rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   out / "final.pt")


def reference() -> dict[str, Any]:
    """The same training, undisturbed, in one process with plain torch."""
    from stratagem.data import epoch_permutation

    model = make_model()
    opt = make_optimizer(model)
    _, xs, ys = dataset().tensors
    for epoch in range(EPOCHS):
        order = epoch_permutation(N, epoch, SEED, shuffle=True)
        for start in range(0, N, BATCH):
            idx = order[start:start + BATCH]
            opt.zero_grad()
            nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def reference_batches() -> list[list[int]]:
    """The global batches of the undisturbed run, in order (sample ids)."""
    from stratagem.data import epoch_permutation

    out = []
    for epoch in range(EPOCHS):
        order = epoch_permutation(N, epoch, SEED, shuffle=True)
        out += [sorted(order[s:s + BATCH]) for s in range(0, N, BATCH)]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--adaptive", action="store_true",
                        help="adaptive batch size (the final parameters then depend on the "
                             "world sizes the job ran at; samples are still exactly once)")
    parser.add_argument("--epochs", type=int, default=EPOCHS,
                        help="(not the reference's: for runs checked per epoch only)")
    args = parser.parse_args()
    train(args.out, args.step_sleep, args.adaptive, args.epochs)
