"""Replica bodies for test_dropin_behaviour.py: each runs in a spawned process (``_spawn``,
torch elastic's variables set) and uses only AdaptDL's names from ``stratagem.adaptdl``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

N = 100


def _setup(ckpt: str) -> Any:
    os.environ["ADAPTDL_CHECKPOINT_PATH"] = ckpt
    os.environ["STRATAGEM_VERBOSE"] = "0"
    import stratagem.adaptdl.torch as adl

    adl.init_process_group("gloo")
    return adl


def save_and_restart(rank: int, world: int, ckpt: str, save_at: int | None) -> dict[str, Any]:
    """Iterate a shuffled loader of samples 0..99 (total batch 10); with ``save_at``, call
    save_all_states() in the body of that step, holding its batch, and stop there."""
    adl = _setup(ckpt)
    from stratagem import adaptdl

    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(N)), batch_size=10, shuffle=True)
    trained: list[int] = []
    sizes: list[tuple[int, int | None, int | None]] = []
    held: list[int] = []
    for i, (x,) in enumerate(loader):
        if i == save_at:
            adaptdl.checkpoint.save_all_states()
            held = x.tolist()
            break
        assert adl.current_dataloader() is loader._elastic
        sizes.append((len(x), loader.current_local_bsz, loader.current_batch_size))
        trained += x.tolist()
    return {"trained": trained, "sizes": sizes, "held": held}


def broken_loop(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Break out of the 6th batch, then loop again; also with Stratagem's own loader."""
    adl = _setup(ckpt)
    from stratagem.data import DistributedDataLoader

    data = TensorDataset(torch.arange(N))
    out: dict[str, Any] = {}
    own = DistributedDataLoader(data, 10, rank=rank, world_size=world)
    for name, loader in (("adaptdl", adl.AdaptiveDataLoader(data, batch_size=10)),
                         ("stratagem", own)):
        first, second = [], []
        for i, (x,) in enumerate(loader):
            first += x.tolist()
            if i == 5:
                break
        assert adl.current_dataloader() is None
        for (x,) in loader:
            second.append(x.tolist())
        out[name] = {"first": first, "second": second}
    return out


def collective_ops(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """AdaptDL's collective module and Accumulator over the job's replicas."""
    adl = _setup(ckpt)
    from stratagem.adaptdl import collective

    out: dict[str, Any] = {
        "sum": collective.allreduce(rank + 1),
        "union": collective.allreduce({rank, 10 + rank}, reduce_fn=lambda a, b: a | b),
        "tensor": collective.allreduce(torch.full((2,), float(rank + 1))).tolist(),
        "array": collective.allreduce(np.array([rank, 1])).tolist(),
        "nested": collective.allreduce({"ranks": (rank,), "n": 1},
                                       reduce_fn=lambda a, b: {"ranks": a["ranks"]
                                                               + b["ranks"],
                                                               "n": a["n"] + b["n"]}),
        "broadcast": collective.broadcast({"from": rank, "tag": f"r{rank}"}),
    }
    futures = [collective.allreduce_async(k * (rank + 1)) for k in (1, 2, 3)]
    out["async"] = [futures[i].result() for i in (2, 0, 1)]  # waited for out of order
    try:
        collective.allreduce(object())
    except TypeError as exc:
        out["refused"] = str(exc)
    try:
        collective.initialize()
    except RuntimeError as exc:
        out["again"] = str(exc)
    acc = adl.Accumulator()
    acc["n"] += rank + 1
    acc["v"] += torch.tensor([1.0, float(rank)])
    with acc.synchronized():
        out["acc"] = (acc["n"], acc["v"].tolist())
    return out


def custom_rule(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """An AdaptDL-style rule (only ``scale_lr``) given to AdaptiveDataParallel scales the
    learning rate of the steps Stratagem runs."""
    adl = _setup(ckpt)
    from stratagem.adaptdl.torch.scaling_rules import ScalingRuleBase

    class Quarter(ScalingRuleBase):
        def scale_lr(self, scale: float) -> float:
            return 0.25 * scale

    torch.manual_seed(0)
    x, y = torch.randn(N, 3), torch.randn(N, 1)
    model = torch.nn.Linear(3, 1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = Quarter()
    dmodel = adl.AdaptiveDataParallel(model, opt, scaling_rule=rule)
    loader = adl.AdaptiveDataLoader(TensorDataset(x, y), batch_size=20)
    bound = rule.adp is dmodel
    for _epoch in adl.remaining_epochs_until(1):
        for i, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(dmodel(xb), yb).backward()
            opt.step()
            if i == 2:
                break
    return {"initial": initial, "final": {k: v.clone() for k, v in model.state_dict().items()},
            "lr_after": opt.param_groups[0]["lr"], "bound": bound, "x": x, "y": y}


def private_names(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """AdaptDL's private names that its examples read (``model._state``,
    ``adaptdl.torch._metrics``), on a linear model trained without autoscaling at a tiny
    learning rate (the gradient statistics stay those of the initial weights)."""
    adl = _setup(ckpt)
    import stratagem.adaptdl.torch._metrics as metrics

    torch.manual_seed(0)
    x = torch.randn(1000, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + torch.randn(1000, 1)
    model = torch.nn.Linear(4, 1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    dmodel = adl.AdaptiveDataParallel(model, opt, sched)
    loader = adl.AdaptiveDataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    unscaled = metrics._metrics_state().grad_params  # AdaptDL: None without autoscaling
    # autoscaling on (the statistics are per sample: a larger batch changes nothing here)
    loader.autoscale_batch_size(40)
    before = metrics._metrics_state().grad_params
    batches = set()
    for _epoch in adl.remaining_epochs_until(1):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(dmodel(xb), yb).backward()
            opt.step()
            batches.add(loader.current_batch_size)

    class Writer:
        def __init__(self) -> None:
            self.scalars: dict[str, float] = {}

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars[tag] = float(value)

    writer = Writer()
    dmodel.to_tensorboard(writer, 0)
    state = dmodel._state
    return {"model_is_module": state.model is model, "optimizer": state.optimizer is opt,
            "scheduler": state.lr_scheduler is sched, "scaler": state.mp_scaler,
            "gain": (state.gain, dmodel.gain), "lr_factor": state.lr_factor,
            "before": before, "unscaled": unscaled,
            "grad_params": metrics._metrics_state().grad_params,
            "gns": (dmodel.gns.sqr_avg(), dmodel.gns.var_avg()),
            "hints": metrics._get_sched_hints() is not None,
            "progress": metrics.get_progress(), "goodput": metrics.get_goodput_fn(),
            "scalars": writer.scalars, "batches": batches, "initial": initial, "x": x, "y": y,
            "saved": list(torch.load(__import__("io").BytesIO(_saved(state.model)),
                                     weights_only=True))}


def _saved(module: torch.nn.Module) -> bytes:
    """What AdaptDL's NCF example does with ``model._state.model``: ``torch.save`` it."""
    import io

    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    return buf.getvalue()


def split_statistics(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """One step of a one-weight model (output ``w = 0``, MSE loss against targets 1..4,
    so sample ``t``'s gradient is ``-2t``) at batch 4 on 2 replicas, without autoscaling:
    the samples this replica got and the gradient statistics after the step."""
    adl = _setup(ckpt)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dmodel = adl.AdaptiveDataParallel(model, opt)
    targets = torch.arange(1.0, 9.0).reshape(-1, 1)
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.ones(8, 1), targets), batch_size=4)
    got: list[float] = []
    for _epoch in adl.remaining_epochs_until(1):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(dmodel(xb), yb).backward()
            opt.step()
            got = yb.reshape(-1).tolist()
            break
    return {"samples": got, "sqr": dmodel.gns.raw_sqr_avg.tolist(),
            "var": dmodel.gns.raw_var_avg.tolist()}


def statistics_trace(rank: int, world: int, ckpt: str, strategy: str) -> dict[str, Any]:
    """An AdaptDL script (AdaptiveDataParallel, AdaptiveDataLoader, Adam) on the job's
    strategy ``strategy`` (``stratagem run --strategy``; "" the default): the gradient
    statistics AdaptDL's API reports after every step, and the final parameters."""
    from torch import nn

    if strategy:
        os.environ["STRATAGEM_STRATEGY"] = strategy
    adl = _setup(ckpt)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    adp = adl.AdaptiveDataParallel(model, opt)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 6, generator=g)
    y = x.sum(1, keepdim=True) + 3 * torch.randn(256, 1, generator=g)
    loader = adl.AdaptiveDataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    trace = []
    for _ in adl.remaining_epochs_until(2):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(adp(xb), yb).backward()
            opt.step()
            trace.append(list(adp._gns()))
    dist_model = adp._dist
    return {"trace": trace, "sharded": dist_model.is_sharded,
            "params": dist_model.full_state_dict()}
