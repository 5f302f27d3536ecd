"""A user's training script with AutoDist and parameter servers (run by test_ps.py).

Servers run it too: ``ad.distribute`` serves there and exits the process, so nothing below
it runs on a server. Env PS_OUT (result directory; or argv[1]), PS_BUILDER, and PS_SPEC (a
spec file; else the launcher's STRATAGEM_RESOURCE_SPEC).
"""

import os
import sys
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # ps_common, and tests/ for its _spawn
from ps_common import make_model, train_slices  # noqa: E402

import stratagem as sg  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ["PS_OUT"])
ad = sg.AutoDist(resource_spec_file=os.environ.get("PS_SPEC"),
                 strategy_builder=os.environ.get("PS_BUILDER", "PartitionedPS"), verbose=False)
model = make_model(seed=ad.rank)
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)
model, optimizer = ad.distribute(model, optimizer)

assert ad.role == "worker", "servers never get past distribute()"
train_slices(model, optimizer, ad.rank, ad.world_size)
model.refresh_parameters()
torch.save({"state": model.state_dict(), "rank": ad.rank, "world": ad.world_size,
            "plan": model.plan.summary()}, OUT / f"worker{ad.rank}.pt")
