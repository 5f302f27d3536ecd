"""Demo: a single-device training script made distributed with four changed lines.

Learns a random "teacher" MLP from synthetic data (so the best reachable loss is known:
the label noise variance, 0.01). Run it on 2 local workers with
``stratagem run --nproc 2 examples/train_mlp.py``, or alone with ``python``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stratagem as sg


def teacher_dataset(n: int = 8192, dim: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    x = torch.randn(n, dim, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--compressor", default="none", choices=["none", "fp16", "bf16",
                                                                  "powersgd"])
    parser.add_argument("--save", default="", help="checkpoint directory to write at the end")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ad = sg.AutoDist(strategy_builder=sg.strategy.AllReduce(chunk_size=2,
                                                            compressor=args.compressor))
    model, optimizer = ad.distribute(model, optimizer)
    loader = ad.data_loader(teacher_dataset(), batch_size=args.batch_size, shuffle=True)

    loss_fn = nn.MSELoss()
    for epoch in range(args.epochs):
        start, total, batches = time.perf_counter(), 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        ad.log(f"epoch {epoch + 1}/{args.epochs}: loss {total / batches:.4f} "
               f"({batches} steps, {time.perf_counter() - start:.2f} s, "
               f"{ad.world_size} replicas; best possible 0.0100)")
    if args.save:
        ad.save_checkpoint(args.save, epochs=args.epochs)
        ad.log(f"checkpoint written to {args.save}")


if __name__ == "__main__":
    main()
