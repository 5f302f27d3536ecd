"""The common idiom after training (run by test_ps.py): one rank reads the model while the
others leave -- no ``refresh_parameters()``, no extra call.

The reader (env PS_READER, default 0) waits until every other worker has finished its
script, then saves ``model.state_dict()``, ``model.module.state_dict()``, the original
module's ``state_dict()`` and the outputs of evaluation forwards (under ``no_grad``, and
in eval mode with gradients on). Env as ps_script.py (PS_OUT, PS_BUILDER, PS_SPEC);
PS_FAIL_AT: the last worker raises after that step's forward instead.
"""

import os
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # ps_common, and tests/ for its _spawn
from ps_common import STEPS, batch, make_model, train_slices  # noqa: E402

import stratagem as sg  # noqa: E402

OUT = Path(os.environ["PS_OUT"])
READER = int(os.environ.get("PS_READER", "0"))
ad = sg.AutoDist(resource_spec_file=os.environ.get("PS_SPEC"),
                 strategy_builder=os.environ.get("PS_BUILDER", "PartitionedPS"), verbose=False)
original = make_model(seed=ad.rank)
optimizer = torch.optim.Adagrad(original.parameters(), lr=0.2)
model, optimizer = ad.distribute(original, optimizer)

FAIL_AT = os.environ.get("PS_FAIL_AT")  # this step's forward: the last worker raises
train_slices(model, optimizer, ad.rank, ad.world_size,
             fail_at=int(FAIL_AT) if FAIL_AT and ad.rank == ad.world_size - 1 else None)

if ad.rank != READER:
    (OUT / f"left{ad.rank}").touch()
    sys.exit(0)  # leaves while the reader is still reading: atexit handlers run
deadline = time.monotonic() + 60
while not all((OUT / f"left{r}").exists() for r in range(ad.world_size) if r != READER):
    assert time.monotonic() < deadline, "the other workers never left the loop"
    time.sleep(0.05)
time.sleep(0.5)  # (they are exiting)
x, _ = batch(STEPS)
with torch.no_grad():
    eval_out = model(x)  # reads rows nobody pulled since the last update
model.eval()
eval_grad_out = model(x[:2]).detach()
torch.save({"state": model.state_dict(), "module": model.module.state_dict(),
            "original": original.state_dict(), "eval": eval_out, "eval_grad": eval_grad_out},
           OUT / f"reader{READER}.pt")
