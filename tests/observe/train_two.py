"""Two-worker training for the run tests: known batch sizes, losses reported per step."""

import sys

import torch
from torch import nn

import stratagem as sg

ad = sg.AutoDist(strategy_builder="AllReduce")  # a known answer: 20 bytes all-reduced a step
torch.manual_seed(0)
model = nn.Linear(4, 1)  # 5 float32 values: 20 bytes of gradient per all-reduce
model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05))
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
loader = ad.data_loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                        batch_size=16)
print(f"rank {ad.rank} says hi", flush=True)
print(f"rank {ad.rank} warns", file=sys.stderr, flush=True)
for epoch in ad.remaining_epochs_until(2):
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        ad.log_metrics(loss=loss.item(), rank=ad.rank)
        if sys.argv[1:] == ["crash"] and ad.rank == 1 and epoch == 1 and i == 1:
            raise ValueError("rank one broke")
