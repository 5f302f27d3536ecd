"""A worker script that never calls ``model.close()`` (test_ps.py): bounded-staleness or
asynchronous parameter servers (PS_MODE ``ssp`` or ``async``) on a dedicated server.

Servers serve inside ``distribute()`` until every worker said it is done; the workers
leave at the end of the script, and their exit must say it for them. Env as
ps_script.py (PS_OUT, PS_SPEC).
"""

import os
import sys
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # ps_common, and tests/ for its _spawn
from ps_common import make_model, train_slices  # noqa: E402

import stratagem as sg  # noqa: E402

builder = (sg.strategy.PS(staleness=1) if os.environ["PS_MODE"] == "ssp"
           else sg.strategy.PS(sync=False))
ad = sg.AutoDist(resource_spec_file=os.environ["PS_SPEC"], strategy_builder=builder,
                 verbose=False)
model = make_model(seed=ad.rank)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = ad.distribute(model, optimizer)
train_slices(model, optimizer, ad.rank, ad.world_size)
(Path(os.environ["PS_OUT"]) / f"trained{ad.rank}").touch()
