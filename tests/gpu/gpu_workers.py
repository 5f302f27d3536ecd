"""Spawned-worker cases of the CUDA tests: two workers share the machine's one GPU.

Each case trains the planner tests' models (tests/planner/planner_workers.py: float64, the
same global batches, SGD) on ``cuda:0`` and returns the final state on the CPU, for the
parent to compare with single-process training on the CPU.

One GPU and two ranks: NCCL refuses two ranks of one host on one device ("Duplicate GPU
detected"), so the ``nccl`` variant gives each rank a host id of its own (``NCCL_HOSTID``)
and NCCL connects them over loopback sockets, as it would two machines. The ``gloo``
variant all-reduces CUDA tensors with gloo instead (``all_reduce_spec: gloo``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planner"))
import planner_workers as pw  # noqa: E402
from _jobs import share_one_gpu  # noqa: E402

CUDA = torch.device("cuda", 0)


def gpu_nodes(bandwidth: float | None = None) -> Any:
    """Two nodes of one GPU each (``10.0.0.1:GPU:0``, ``10.0.0.2:GPU:0``)."""
    from stratagem.resource import ResourceSpec

    nodes = [{"address": "10.0.0.1", "chief": True, "gpus": [0], "cpus": [0]},
             {"address": "10.0.0.2", "gpus": [0], "cpus": [0]}]
    if bandwidth is not None:
        nodes = [dict(n, network_bandwidth=bandwidth) for n in nodes]
    return ResourceSpec.from_dict({"nodes": nodes})


def on_gpus(strategy_json: str) -> str:
    """A strategy for :func:`pw.two_nodes` with its devices on :func:`gpu_nodes`."""
    return strategy_json.replace(":CPU:0", ":GPU:0")


def all_reduce_with(strategy_json: str, spec: str) -> str:
    """Every all-reduce synchronizer's collective backend set to ``spec``."""
    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("type") == "AllReduce" and "spec" in node:
                node = dict(node, spec=spec)
            return {k: fix(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    return json.dumps(fix(json.loads(strategy_json)))


def suite(rank: int, world: int, backend: str, cases: dict[str, tuple[str, str, str]]
          ) -> dict[str, Any]:
    """Every case ``name -> (model, strategy JSON, device)`` in one job whose default
    group is ``backend`` (``cpu:gloo,cuda:nccl`` or ``gloo``)."""
    from stratagem.runtime.ps import join_cluster

    share_one_gpu(rank)
    cluster = join_cluster(gpu_nodes().replicas, [], backend=backend)
    return {case: train_with(cluster, rank, world, name, strategy_json, torch.device(device))
            for case, (name, strategy_json, device) in cases.items()}


def train_with(cluster: Any, rank: int, world: int, name: str, strategy_json: str,
               device: torch.device) -> dict[str, Any]:
    """One worker: ``strategy_json`` compiled for ``device`` and run for STEPS steps."""
    from stratagem.analysis import analyze
    from stratagem.runtime import DistributedModel, compile_plan
    from stratagem.strategy import Strategy, validate

    model = pw.make(name, seed=rank).to(device)
    profile = analyze(model)
    spec = gpu_nodes() if ":GPU:" in strategy_json else pw.two_nodes()
    strategy = validate(Strategy.from_dict(json.loads(strategy_json)), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=world, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    dm = DistributedModel(model, plan, optimizer=opt, cluster=cluster)
    state = train_steps(dm, opt, name, rank, world, device)
    devices = sorted({str(p.device) for p in model.parameters()})
    out = {"state": state, "devices": devices, "backends": list(plan.backends)}
    dm.close()
    return out


def train_steps(dm: Any, opt: torch.optim.Optimizer, name: str, rank: int, world: int,
                device: torch.device) -> dict[str, torch.Tensor]:
    """STEPS steps on this worker's slice of each global batch, on ``device``; the state,
    on the CPU."""
    per = pw.BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    for step in range(pw.STEPS):
        inputs, target = pw.batch(name, step)
        mine, y = pw.slice_inputs(name, inputs, target, sl)
        mine = tuple(t.to(device) for t in mine)
        opt.zero_grad()
        pw.loss(name, dm(*mine), y.to(device)).backward()
        opt.step()
    dm.refresh_parameters()
    return {k: v.detach().cpu().clone() for k, v in dm.state_dict().items()}


def autodist_case(rank: int, world: int, stats: bool = False, starve: bool = False
                  ) -> dict[str, Any]:
    """A user's script on the GPU spec with the Auto builder: AutoDist joins the default
    group (``cpu:gloo,cuda:nccl``), calibrates on this worker's first batch on the GPU with
    the other worker, probes the links, times trial steps of copies on the GPU, then
    trains STEPS steps. ``stats``: the adaptive loop will collect gradient statistics
    (what batch size autoscaling reads, from all-reduced gradients), and Auto plans on the
    first training batch, not a sample. ``starve``: rank 1 has no GPU memory to spare for
    trial copies (the ranks agree: no trials)."""
    import torch.distributed as dist

    import stratagem as sg

    share_one_gpu(rank)
    if starve and rank == 1:
        from stratagem.planner import trial

        trial.GPU_SHARE = 0.0
    os.environ["STRATAGEM_NODE_ADDRESS"] = gpu_nodes().nodes[rank].address
    os.environ["LOCAL_RANK"] = "0"  # one worker per node of the spec
    ad = sg.AutoDist(resource_spec=gpu_nodes(), strategy_builder="Auto", verbose=False)
    model = pw.make("sampled", seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    per = pw.BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    inputs, target = pw.batch("sampled", 0)
    sample, _ = pw.slice_inputs("sampled", inputs, target, sl)
    dm, opt = ad.distribute(model, opt, sample_input=None if stats else
                            tuple(t.to(ad.device) for t in sample))
    ad.adaptive.collect_stats = stats
    state = train_steps(dm, opt, "sampled", rank, world, ad.device)
    return {"state": state, "device": str(ad.device), "backend": str(dist.get_backend()),
            "strategy": ad.strategy.to_json(), "trials": len(ad.choice.trials),
            "probed": ad.choice.link_probe is not None,
            "forward_s": ad.choice.calibration.forward_s, "ps": dm._ps is not None,
            "notes": list(ad.choice.notes)}
