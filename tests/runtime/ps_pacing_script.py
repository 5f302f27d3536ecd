"""A dense model trained under PS (one owner, three senders) through ``stratagem run``
(test_ps_pacing_vcluster.py): its 4 MB bucket is paced, or not with
STRATAGEM_PS_PACE_BYTES=0. Writes each worker's parameters and paced receive count."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg

STEPS = 10
OUT = Path(sys.argv[1])
ad = sg.AutoDist(strategy_builder="PS", verbose=False)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = ad.distribute(model, optimizer)
for step in range(STEPS):
    g = torch.Generator().manual_seed(1000 * step + ad.rank)
    x, y = torch.randn(16, 1024, generator=g), torch.randn(16, 1, generator=g)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
model.refresh_parameters()
torch.save({"state": model.state_dict(), "paced": model.comm_stats.paced_receives,
            "plan": model.plan.summary()}, OUT / f"worker{ad.rank}.pt")
