"""Mixed-precision cases (bf16 autocast + GradScaler), run in spawned processes by
test_amp.py; :func:`reference` is the same loop in one process with the global batch.

Every case trains ``STEPS`` steps with ``torch.autocast("cpu", bfloat16)`` and a
``torch.amp.GradScaler("cpu")`` whose scale grows every ``GROWTH`` steps. At ``INF_STEP``
one rank (or, in the reference, the whole batch) gets an infinite gradient in the
embedding table only: under a parameter server only that table's owner would see it, so
the step is skipped everywhere only if the decision is shared.
"""

from __future__ import annotations

from typing import Any

import torch
from ps_common import BATCH, batch, loss_fn, make_model

from stratagem.analysis import analyze
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.runtime.ps import run_server
from stratagem.strategy import AllReduce, Parallax, PartitionedPS, validate
from stratagem.strategy.validate import server_devices

STEPS = 10
INF_STEP = 5
POISONED_RANK = 1
GROWTH = 3
BUILDERS = {"allreduce": lambda: AllReduce(),
            "allreduce-fp16": lambda: AllReduce(compressor="fp16"),
            "powersgd": lambda: AllReduce(compressor="powersgd"),
            "partitioned_ps": lambda: PartitionedPS(), "parallax": lambda: Parallax(),
            # torch's DDP reducer running the all-reduce groups (runtime/ddp_engine.py)
            "allreduce-ddp": lambda: AllReduce(engine="ddp"),
            "allreduce-ddp-fp16": lambda: AllReduce(compressor="fp16", engine="ddp"),
            "powersgd-ddp": lambda: AllReduce(compressor="powersgd", engine="ddp"),
            "parallax-ddp": lambda: Parallax(engine="ddp")}
# (all-reduce: dense embedding gradients)
SPARSE = {"partitioned_ps": True, "parallax": True, "parallax-ddp": True}


def _scaler(device: str = "cpu") -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=GROWTH)


def _poison(module: torch.nn.Module) -> Any:
    """An infinite gradient for the embedding table only (its output's gradient)."""
    def hook(_mod: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: g * float("inf"))

    return module.emb.register_forward_hook(hook)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, x: torch.Tensor,
          y: torch.Tensor, poison: bool, before_step: Any = None) -> None:
    opt.zero_grad()
    handle = _poison(model if not hasattr(model, "plan") else model.module) if poison else None
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    if handle is not None:
        handle.remove()
    if before_step is not None:
        before_step()
    scaler.step(opt)
    scaler.update()


def reference(case: str, poison: bool = True, device: str = "cpu") -> dict[str, Any]:
    """One process, the global batch (``poison=False``: nothing skipped, to show the
    comparison can fail); on ``device``, the state returned on the CPU."""
    model = make_model(0, sparse=SPARSE.get(case, False)).float().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(device)
    scales = []
    for step in range(STEPS):
        x, y = batch(step)
        _step(model, opt, scaler, x.to(device), y.to(device), poison and step == INF_STEP)
        scales.append(scaler.get_scale())
    return {"state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "scales": scales}


def amp_case(cluster: Any, spec: Any, case: str, device: str = "cpu") -> dict[str, Any]:
    rank, W = cluster.rank, cluster.workers
    model = make_model(seed=rank, sparse=SPARSE.get(case, False)).float()
    if cluster.role == "worker":
        model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    profile = analyze(model)
    strategy = validate(BUILDERS[case]().build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                        device=torch.device(device if cluster.role == "worker" else "cpu"),
                        servers=server_devices(spec))
    if plan.role == "server":
        if plan.ps is not None:
            run_server(model, plan, [opt], cluster)
        return {"server": True}
    dm = DistributedModel(model, plan, optimizer=opt, cluster=cluster)
    scaler = _scaler(device)
    dm.attach_scaler(scaler)
    observed: list[float] = []  # what gradient statistics see (AdaScale's input)
    dm.add_grad_observer(lambda event, _g, buf, scale: observed.append(
        float(buf.double().square().sum()) / scale ** 2) if event == "reduced" else None)
    grads: list[float] = []

    def unscaled_grads() -> None:  # (the scaler's own unscaled, averaged gradients)
        scaler.unscale_(opt)
        grads.append(sum(float(p.grad.double().square().sum()) for p in model.parameters()
                         if p.grad is not None))

    per = BATCH // W
    sl = slice(rank * per, (rank + 1) * per)
    scales, observed_per_step = [], []
    for step in range(STEPS):
        x, y = batch(step)
        observed.clear()
        _step(dm, opt, scaler, x[sl].to(device), y[sl].to(device),
              step == INF_STEP and rank == POISONED_RANK, unscaled_grads)
        scales.append(scaler.get_scale())
        observed_per_step.append(sum(observed))
    dm.refresh_parameters()
    state = {k: v.detach().cpu().clone() for k, v in dm.state_dict().items()}
    sync = {k: v.cpu().clone() for k, v in dm.synchronizer_state_dict().items()}
    dm.close()
    return {"state": state, "scales": scales, "observed": observed_per_step,
            "grads": grads, "sync": sync}


def suite(rank: int, workers: int, servers: int, cases: list[str], device: str = "cpu",
          backend: str = "gloo") -> dict[str, Any]:
    """Every case in one spawn (workers + dedicated servers), the workers on ``device``
    (``cuda``: tests/gpu, the ranks sharing one GPU) in a job whose default group is
    ``backend``."""
    from ps_common import TIMEOUT, spec_for
    from rt_common import guarded

    from stratagem.runtime.ps import join_cluster

    if device == "cuda":
        from _jobs import share_one_gpu

        share_one_gpu(rank)
    spec = spec_for(workers, servers)
    cluster = join_cluster(spec.replicas, server_devices(spec), timeout=TIMEOUT,
                           backend=backend)
    return {case: guarded(lambda c=case: amp_case(cluster, spec, c, device))
            for case in cases}
