"""A short single-process training run for the progress tests (stdout is a pty or a pipe)."""

import sys

import torch
from torch import nn

import stratagem as sg

ad = sg.AutoDist(verbose=True)
torch.manual_seed(0)
model = nn.Linear(4, 1)
model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05))
x = torch.randn(96, 4)
loader = ad.data_loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                        batch_size=32)
if sys.argv[1:] == ["adaptive"]:
    loader.autoscale_batch_size(64, (8, 32))
if sys.argv[1:] == ["resume"]:  # as after a restart one step into the first epoch
    loader.load_state_dict(dict(loader.state_dict(), offset=32))
for epoch in ad.remaining_epochs_until(2):
    for xb, yb in loader:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        ad.log_metrics(loss=loss.item())
    print(f"script epoch {epoch} done", flush=True)
