"""A small adaptive Stratagem job: the cluster-service tutorial, tests and benchmark.

Four Gaussian classes in 8 dimensions (fixed seed), an MLP, SGD; ``--epochs`` epochs of the
elastic data loader (global batch 32, autoscaled up to 256 with ``--adaptive``), sleeping
``--step-sleep`` seconds per 32 local samples (simulated compute, so that a scheduler has
time to act and more replicas go faster). Rank 0 prints ``training on N replicas at T``
after its first step at every new world size (the benchmark's decision-to-training end), and
writes the held-out accuracy and the final parameters to ``--out`` (JSON) at the end.
``--ids DIR``: every replica appends the sample indices of each of its steps to a file there
(the tests check that every sample is seen exactly once per epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import stratagem as sg


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 1.5
    y = torch.randint(0, 4, (n,), generator=g)
    return centers[y] + torch.randn(n, 8, generator=g), y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--adaptive", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--ids", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    ad = sg.AutoDist(verbose=False)
    plain = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = ad.distribute(plain, torch.optim.SGD(plain.parameters(), lr=0.05))
    x, y = data(1024, 1)
    index = torch.arange(len(x))
    loader = ad.data_loader(torch.utils.data.TensorDataset(x, y, index), batch_size=32,
                            shuffle=True)
    if a.adaptive:
        loader.autoscale_batch_size(256, (8, 128), gradient_accumulation=False)
    ids = Path(a.ids) / f"ids-{os.getpid()}.jsonl" if a.ids else None
    world = 0
    for epoch in ad.remaining_epochs_until(a.epochs):
        for xb, yb, ib in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            if ids is not None:
                with ids.open("a") as f:
                    f.write(json.dumps({"epoch": epoch, "world": ad.world_size,
                                        "ids": ib.tolist()}) + "\n")
            if world != ad.world_size and ad.rank == 0:  # decision-to-training ends here
                print(f"training on {ad.world_size} replicas at {time.time():.3f}", flush=True)
            world = ad.world_size
            time.sleep(a.step_sleep * len(xb) / 32)  # "compute" grows with the local batch
        print(f"epoch {epoch} done on {ad.world_size} replicas", flush=True)
    if ad.rank == 0 and a.out:
        xt, yt = data(2000, 2)
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        params = [v for t in plain.parameters() for v in t.detach().flatten().tolist()]
        Path(a.out).write_text(json.dumps({"accuracy": acc, "params": params}))


if __name__ == "__main__":
    main()
