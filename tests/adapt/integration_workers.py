"""Shared by the adaptive-training integration tests: data, scripts, process spawning.

Workers run in spawned processes (gloo on 127.0.0.1) through ``AutoDist``, exactly like a
user script, and return plain data that the tests compare with single-process references.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import _spawn
import torch
from torch import nn

DIM = 6


def regression_data(n: int = 1024, noise: float = 1.0, seed: int = 0
                    ) -> torch.utils.data.TensorDataset:
    """``y = x . w* + noise``: gradient noise known in closed form (see exact_noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = x @ w + noise * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_model(seed: int = 0, hidden: int = 0) -> nn.Module:
    """The linear model; ``hidden``: a two-layer MLP with that width instead."""
    torch.manual_seed(seed)
    if hidden:
        return nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    return nn.Linear(DIM, 1)


def exact_noise(model: nn.Module, data: torch.utils.data.TensorDataset) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) of the MSE loss' per-sample gradients at the model's parameters."""
    x, y = data.tensors
    with torch.no_grad():
        r = 2 * (model(x) - y)  # d/dpred of (pred - y)^2
    grads = torch.cat([r * x, r], dim=1).double()  # per-sample gradient of (weight, bias)
    mean = grads.mean(0)
    var = ((grads - mean) ** 2).sum(1).mean()
    return float(mean.pow(2).sum()), float(var)


def train(steps: int | None, *, batch_size: int = 32, accum_steps: int = 0, lr: float = 0.05,
          optimizer: str = "sgd", data: Any = None, autoscale: dict | None = None,
          collect_stats: bool = False, epochs: int = 1, shuffle: bool = True,
          seed: int = 0, options: dict | None = None, engine: str = "",
          decide: Any = None, zero: int = 0, hidden: int = 0) -> dict[str, Any]:
    """A user script through AutoDist; returns the final parameters and adaptive state.
    ``engine``: AllReduce on that engine instead of AutoDist's default strategy.
    ``decide(gns, world)``: called after every step, its results returned (``decisions``).
    ``zero``: shard with ZeRO at that stage; ``hidden``: train an MLP (make_model)."""
    import stratagem as sg
    from stratagem.strategy.builders import ZeRO

    data = data if data is not None else regression_data()
    builder = sg.strategy.AllReduce(engine=engine) if engine else None
    ad = sg.AutoDist(strategy_builder=ZeRO(stage=zero) if zero else builder, verbose=False)
    model = make_model(seed, hidden)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    model, opt = ad.distribute(model, opt)
    loader = ad.data_loader(data, batch_size=batch_size, shuffle=shuffle)
    loader.accum_steps = accum_steps
    if autoscale:
        loader.autoscale_batch_size(**autoscale)
    ad.adaptive.collect_stats = collect_stats
    for name, value in (options or {}).items():
        setattr(ad.adaptive, name, value)
    done, sizes, decisions = 0, [], []
    for _ in ad.remaining_epochs_until(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sizes.append(len(y))
            if decide is not None:
                decisions.append(decide(ad.adaptive.gns, ad.world_size))
            done += 1
            if steps is not None and done >= steps:
                break
    gns = ad.adaptive.gns
    sharded = bool(getattr(model, "is_sharded", False))  # (stage 3: gathered whole)
    state = model.full_state_dict() if sharded else model.state_dict()
    return {"params": {k: v.detach().clone() for k, v in state.items()},
            "sqr_norm": gns.sqr_norm, "var": gns.var, "updates": gns.updates,
            "biased": gns.biased, "micro_batches": done, "sizes": sizes,
            "progress": ad.adaptive.tracker.progress, "steps": ad.adaptive.steps,
            "batch_size": loader.batch_size, "accum_steps": loader.accum_steps,
            "decisions": decisions, "engine": getattr(model, "plan", None) and model.plan.engine,
            "sharded": sharded}


def reference_big_batch(micro_batches: int, batch_size: int, *, lr: float = 0.05,
                        data: Any = None, shuffle: bool = True, seed: int = 0
                        ) -> dict[str, torch.Tensor]:
    """Plain torch: ``micro_batches`` optimizer steps on consecutive global batches of the
    epoch's permutation (the loader's sample order), no Stratagem."""
    from stratagem.data import epoch_permutation

    data = data if data is not None else regression_data()
    model = make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    order = epoch_permutation(len(data), 0, 0, shuffle)
    x, y = data.tensors
    for t in range(micro_batches):
        idx = order[t * batch_size:(t + 1) * batch_size]
        if not idx:
            break
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- spawning -------------------------------------------------------------------------------
def spawn(fn: Callable, world: int, out: Path, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, **kwargs)`` in ``world`` processes; their return values. ``fn``
    joins the group itself (AutoDist), away from a surrounding launcher's spec and strategy;
    anything it raises, SystemExit included, is reported."""
    return _spawn.run(fn, world, out, kwargs, _spawn.Setup(
        args=(world,), local_rank=True, unset=("STRATAGEM_RESOURCE_SPEC", "STRATAGEM_STRATEGY"),
        catch=BaseException))


def train_worker(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    return train(**kwargs)


def accumulator_worker(rank: int, world: int) -> dict[str, Any]:
    import stratagem as sg

    sg.AutoDist(verbose=False)  # joins the process group
    stats = sg.adapt.Accumulator()
    stats["n"] += rank + 1
    stats["loss"] += 0.5 * (rank + 1)
    stats += {"only_rank1": 7} if rank == 1 else {}
    with stats.synchronized():
        first = dict(stats)
        stats["mean"] = stats["loss"] / stats["n"]
    stats["n"] += 10
    with stats.synchronized():
        second = dict(stats)
    return {"first": first, "second": second}


def autoscale_decision(gns: Any, world: int) -> list[int] | None:
    """What the autoscaler would choose from these gradient statistics, for a fixed
    throughput model (timings differ from run to run; the statistics should not):
    ``[global, local, accumulation steps]``, None before the estimate exists."""
    from stratagem.adapt import Autoscaler, BatchConfig, ThroughputParams

    if gns is None or gns.updates < 2:
        return None
    params = ThroughputParams(alpha_c=0.02, beta_c=0.0005, alpha_r=0.01, beta_r=0.0,
                              alpha_n=0.02, beta_n=0.0, gamma=1.5)
    scaler = Autoscaler(32, 1024, (8, 128), gradient_accumulation=True)
    config, _ = scaler.decide(params, gns, 1, world, BatchConfig.of(32, world))
    return [config.global_bsz, config.local_bsz, config.accum_steps]
