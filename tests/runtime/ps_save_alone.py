"""One rank saves a checkpoint alone after training; later a job restores it (test_ps.py).

PS_MODE=save: STEPS steps, then every worker but the saver (PS_READER, default 0) leaves
and exits; once they have, the saver calls ``stratagem.checkpoint.save(PS_CKPT, model,
optimizer)`` -- no collective call anywhere. PS_MODE=restore: every worker loads PS_CKPT,
saves it again from every rank at once (PS_CKPT + "-again"), trains MORE steps more and
writes its ``state_dict()``. Env as ps_script.py (PS_OUT, PS_BUILDER, PS_SPEC); PS_OPT:
sgd or adam1 (ps_common.make_optimizers).
"""

import os
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # ps_common, and tests/ for its _spawn
from ps_common import BATCH, STEPS, batch, loss_fn, make_model, make_optimizers  # noqa: E402

import stratagem as sg  # noqa: E402

MORE = 5
OUT = Path(os.environ["PS_OUT"])
CKPT = os.environ["PS_CKPT"]
READER = int(os.environ.get("PS_READER", "0"))
ad = sg.AutoDist(resource_spec_file=os.environ.get("PS_SPEC"),
                 strategy_builder=os.environ["PS_BUILDER"], verbose=False)
model = make_model(seed=ad.rank)
(optimizer,) = make_optimizers(os.environ["PS_OPT"], model)
model, optimizer = ad.distribute(model, optimizer)


def train(steps: range) -> None:
    per = BATCH // ad.world_size
    sl = slice(ad.rank * per, (ad.rank + 1) * per)
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        loss_fn(model(x[sl]), y[sl]).backward()
        optimizer.step()


if os.environ["PS_MODE"] == "save":
    train(range(STEPS))
    # longer than the data timeout without a read: the owners must still answer
    time.sleep(float(os.environ.get("PS_IDLE_S", "0")))
    if ad.rank != READER:
        (OUT / f"left{ad.rank}").touch()
        sys.exit(0)  # leaves while the saver still needs its state: atexit handlers run
    deadline = time.monotonic() + 60
    while not all((OUT / f"left{r}").exists() for r in range(ad.world_size) if r != READER):
        assert time.monotonic() < deadline, "the other workers never left the loop"
        time.sleep(0.05)
    time.sleep(0.5)  # (they are exiting)
    sg.checkpoint.save(CKPT, model, optimizer)
else:
    sg.checkpoint.load(CKPT, model, optimizer)
    sg.checkpoint.save(CKPT + "-again", model, optimizer)  # every rank calls it
    train(range(STEPS, STEPS + MORE))
    torch.save(model.state_dict(), OUT / f"continued{ad.rank}.pt")
