"""Models and spawned-worker cases of the planner tests (2 gloo workers on 127.0.0.1).

Every case trains the same global batches as :func:`reference` (plain torch, one process)
and returns the final state, so the parent compares the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

STEPS = 12
BATCH = 8
VOCAB = 40
DIM = 6
NEG = 5


class SampledLM(nn.Module):
    """A table read with ``F.embedding`` (no module, dense gradient) and an output layer
    used through a sampled softmax: both are declared dense and row-sparse in practice."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)
        self.hidden = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(F.embedding(ids, self.table).sum(dim=1)))
        return h @ self.out.weight[cand].t() + self.out.bias[cand]


class DenseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 9)
        self.fc3 = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


BAG_ROWS = 20000


class SparseBag(nn.Module):
    """A large table declared sparse (``nn.Embedding(sparse=True)``) and a small head:
    a batch touches a few of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(BAG_ROWS, DIM, sparse=True)
        self.fc = nn.Linear(DIM, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).sum(dim=1))


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    models = {"sampled": SampledLM, "bag": SparseBag}
    return models.get(name, DenseNet)().double()


def batch(name: str, step: int, n: int = BATCH) -> tuple[tuple[torch.Tensor, ...], Any]:
    """(model inputs, target) of global batch ``step``; the sampled softmax's candidates
    (the batch's targets, then NEG shared negatives) are the same for every worker."""
    g = torch.Generator().manual_seed(77 + step)
    if name == "sampled":
        ids = torch.randint(0, VOCAB // 2, (n, 3), generator=g)
        y = torch.randint(0, VOCAB, (n,), generator=g)
        neg = torch.randint(0, VOCAB, (NEG,), generator=g)
        cand, inverse = torch.unique(torch.cat([y, neg]), return_inverse=True)
        return (ids, cand), inverse[:n]
    if name == "bag":
        ids = torch.randint(0, BAG_ROWS, (n, 3), generator=g)
        return (ids,), torch.randn(n, 4, generator=g, dtype=torch.float64)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return (x,), torch.randn(n, 4, generator=g, dtype=torch.float64)


def slice_inputs(name: str, inputs: tuple, target: Any, sl: slice) -> tuple[tuple, Any]:
    if name == "sampled":
        return (inputs[0][sl], inputs[1]), target[sl]
    return (inputs[0][sl],), target[sl]


def loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "sampled":
        return F.cross_entropy(out, target)
    return F.mse_loss(out, target)


def reference(name: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain torch, one process, the global batch, SGD without momentum."""
    m = make(name)
    opt = torch.optim.SGD(m.parameters(), lr=0.3)
    for step in range(steps):
        inputs, target = batch(name, step)
        opt.zero_grad()
        loss(name, m(*inputs), target).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def suite(rank: int, world: int, cases: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Every case ``name -> (model, strategy JSON)`` in one PS cluster joined the way
    AutoDist does (colocated owners: each worker node owns some pieces)."""
    from stratagem.runtime.ps import join_cluster

    cluster = join_cluster(two_nodes().replicas, [])
    return {case: train_with(cluster, rank, world, name, strategy_json)
            for case, (name, strategy_json) in cases.items()}


def train_with(cluster: Any, rank: int, world: int, name: str, strategy_json: str
               ) -> dict[str, Any]:
    """One worker: ``strategy_json`` compiled and run for STEPS steps."""
    import json

    from stratagem.analysis import analyze
    from stratagem.runtime import DistributedModel, compile_plan
    from stratagem.strategy import Strategy, validate

    spec = two_nodes()
    model = make(name, seed=rank)  # different seeds: worker 0's values are broadcast
    profile = analyze(model)
    strategy = validate(Strategy.from_dict(json.loads(strategy_json)), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    dm = DistributedModel(model, plan, optimizer=opt, cluster=cluster)
    state = train_steps(dm, opt, name, rank, world)
    out = {"state": state, "plan": plan.summary()}
    dm.close()
    return out


def train_steps(dm: Any, opt: torch.optim.Optimizer, name: str, rank: int, world: int
                ) -> dict[str, torch.Tensor]:
    """STEPS steps on this worker's slice of each global batch; the current state."""
    per = BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    for step in range(STEPS):
        inputs, target = batch(name, step)
        mine, y = slice_inputs(name, inputs, target, sl)
        opt.zero_grad()
        loss(name, dm(*mine), y).backward()
        opt.step()
    dm.refresh_parameters()
    state = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    return state


def gather_strategy() -> Any:
    """The bag's table with its rows all-gathered, the head all-reduced."""
    from stratagem.strategy import AllReduceSynchronizer, NodeConfig, Strategy

    return Strategy((NodeConfig("emb.weight", AllReduceSynchronizer(gather_rows=True, group=1)),
                     NodeConfig("fc.weight", AllReduceSynchronizer()),
                     NodeConfig("fc.bias", AllReduceSynchronizer())))


def two_nodes() -> Any:
    from stratagem.resource import ResourceSpec

    return ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "chief": True, "workers": 1, "cpus": [0]},
        {"address": "10.0.0.2", "workers": 1, "cpus": [0]}]})


class EmbeddingHeavy(nn.Module):
    """A large dense-declared embedding table (sparse=False) and a small tower."""

    def __init__(self, rows: int = 20000, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.fc1 = nn.Linear(dim, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids).sum(dim=1))))


def autodist_case(rank: int, world: int, name: str) -> dict[str, Any]:
    """A user's script with ``strategy_builder="Auto"``: calibrate on this worker's first
    batch, train STEPS steps on this worker's slice, return the state and explanation."""
    import stratagem as sg

    ad = sg.AutoDist(strategy_builder="Auto", verbose=False)
    model = make(name, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    per = BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    inputs, target = batch(name, 0)
    sample, _ = slice_inputs(name, inputs, target, sl)
    from stratagem.planner import explain_json, trial

    trial.INTERLEAVE_BYTES = 0  # candidates one at a time here (rigged_choice: interleaved)
    try:
        dm, opt = ad.distribute(model, opt, sample_input=sample)
    finally:
        trial.INTERLEAVE_BYTES = 2 ** 30
    state = train_steps(dm, opt, name, rank, world)

    return {"state": state, "strategy": ad.strategy.to_json(), "explain": ad.explain(),
            "json": explain_json(ad.choice), "rigged": rigged_choice(ad.resource_spec)}


def first_batch_case(rank: int, world: int, name: str, slow: bool,
                     stats: bool = False) -> dict[str, Any]:
    """Auto without a sample batch: all-reduce until the first training forward, which
    plans on its batch (an evaluation forward before it does not); then STEPS steps.
    ``slow``: two nodes on 1 Mbit/s links, priced from the spec (no probe, no trials):
    bytes decide, so the plan sends rows to parameter servers. ``stats``: the adaptive
    loop collects gradient statistics (what batch size autoscaling reads)."""
    import stratagem as sg
    from stratagem.errors import StratagemError
    from stratagem.resource import ResourceSpec

    if slow:
        import os

        spec = ResourceSpec.from_dict({"nodes": [
            dict(n, network_bandwidth=0.001) for n in two_nodes().to_dict()["nodes"]]})
        os.environ["STRATAGEM_NODE_ADDRESS"] = spec.nodes[rank].address
        os.environ["LOCAL_RANK"] = "0"  # one worker per node of the spec
        ad = sg.AutoDist(resource_spec=spec, verbose=False,
                         strategy_builder=sg.strategy.Auto(probe=False, trials=0))
    else:  # the default builder: Auto
        ad = sg.AutoDist(verbose=False)
    logged: list[str] = []
    ad.log = logged.append  # type: ignore[method-assign]
    model = make(name, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    dm, opt = ad.distribute(model, opt)
    ad.adaptive.collect_stats = stats
    before = ad.strategy.builder
    try:
        ad.explain()
        early = "explained"
    except StratagemError as exc:
        early = exc.fix
    inputs, target = batch(name, 0)
    with torch.no_grad():
        dm.eval()
        dm(*slice_inputs(name, inputs, target, slice(0, 2))[0])
        dm.train()
    planned_early = ad.choice is not None
    state = train_steps(dm, opt, name, rank, world)
    return {"state": state, "before": before, "early": early, "planned_early": planned_early,
            "strategy": ad.strategy.to_json(), "explain": ad.explain(),
            "ps": dm._ps is not None, "trials": len(ad.choice.trials), "log": logged,
            "trial_s": [(t.family, t.measured_s, t.note) for t in ad.choice.trials
                        if t.measured_s is not None],
            "rows": sorted(nc.var_name for nc in ad.strategy.node_config for leaf in nc.leaves()
                           if getattr(leaf.synchronizer, "row_sparse", False))}


def rigged_choice(spec: Any) -> dict[str, Any]:
    """A cost model rigged to rank a slow strategy first, just ahead of the rest: AllReduce
    of a 25 MB dense-declared embedding of which a batch reads 128 rows (the rows go as
    rows in every other candidate). Trial steps must correct it."""
    from dataclasses import replace

    from stratagem.planner import choose, refine
    from stratagem.planner.cost_model import StepCost

    torch.manual_seed(0)
    model = EmbeddingHeavy(rows=200_000)
    sample = torch.randint(0, 200_000, (32, 4), generator=torch.Generator().manual_seed(1))
    choice = choose(model, spec, sample_input=sample)
    slow = next(c for c in choice.candidates if c.name == "AllReduce")
    others = tuple(c for c in choice.candidates if c.name != "AllReduce")
    # ranked first, with the rest close enough to be tried (not dominated)
    rigged = replace(slow, cost=StepCost(0.9 * min(c.cost.total_s for c in others), 0.0, 0.0))
    choice = replace(choice, best=rigged, candidates=(rigged, *others))
    fixed = refine(choice, model, sample, k=2)
    # a host with too little memory free on one rank for a copy: no rank runs trials
    import torch.distributed as dist

    from stratagem.planner import trial

    real = trial.host_available_bytes
    if dist.get_rank() == 1:
        trial.host_available_bytes = lambda: 2 * 2**20  # 1 MiB each: less than a 25 MB copy
    try:
        starved = refine(choice, model, sample, k=2)
    finally:
        trial.host_available_bytes = real
    return {"chosen": fixed.best.name, "strategy": fixed.strategy.to_json(),
            "trials": [t.to_dict() for t in fixed.trials], "notes": list(fixed.notes),
            "starved": {"chosen": starved.best.name, "trials": len(starved.trials),
                        "note": starved.notes[-1]}}


W0, W1 = "10.0.0.1:CPU:0", "10.0.0.2:CPU:0"


def rows(dest: str) -> Any:
    from stratagem.strategy import PSSynchronizer

    return PSSynchronizer(reduction_destination=dest, local_replication=True, row_sparse=True)


def rows_strategy() -> Any:
    """Table on worker 1, output weight and bias split over both workers: all as rows
    (the 1-D bias's parts go dense, see test_plan_marks_rows_from_gradient); the hidden
    layer all-reduced."""
    from stratagem.strategy import AllReduceSynchronizer, NodeConfig, Partitioner, Strategy

    return Strategy(node_config=(
        NodeConfig("table", rows(W1)),
        NodeConfig("hidden.weight", AllReduceSynchronizer()),
        NodeConfig("hidden.bias", AllReduceSynchronizer()),
        NodeConfig("out.weight", partitioner=Partitioner((2, 1)), part_config=(
            NodeConfig("out.weight/part_0", rows(W0)),
            NodeConfig("out.weight/part_1", rows(W1)))),
        NodeConfig("out.bias", partitioner=Partitioner((2,)), part_config=(
            NodeConfig("out.bias/part_0", rows(W0)),
            NodeConfig("out.bias/part_1", rows(W1))))))


def pooled_calibration_case(rank: int, world: int) -> dict[str, Any]:
    """Calibrate together, rank 1's passes timed 3x slower than rank 0's (a rank
    disturbed while it timed): every rank gets the median over all ranks' passes."""
    import importlib

    c = importlib.import_module("stratagem.planner.calibrate")
    real = c._one_pass
    slow = 3.0 if rank == 1 else 1.0

    def one(*args: Any, **kwargs: Any) -> tuple:
        _, _, ready, layer, touched = real(*args, **kwargs)
        return 0.01 * slow, 0.02 * slow, ready, layer, touched

    c._one_pass = one
    try:
        model = make("dense")
        cal = c.calibrate(model, batch("dense", 0)[0][0], together=True, use_cache=False)
    finally:
        c._one_pass = real
    return {"forward_s": cal.forward_s, "backward_s": cal.backward_s}


def pooled_runtime_costs_case(rank: int, world: int) -> dict[str, Any]:
    """The reducer's timed backwards as a quiet rank reads them (a 1 ms plain backward,
    20 us more per tensor, 10 us more per group), on the last rank with the plain ones
    read 4.352 ms slow (alone, it would price a tensor at 3 us): pooled, every rank
    gets the quiet ranks' costs; the machine rates likewise."""
    import importlib

    p = importlib.import_module("stratagem.planner.probe")
    plain, n, groups = 1e-3, p.TENSORS, p.TENSORS // 4
    one = plain + n * 20e-6
    slow_plain = plain + n * 17e-6 if rank == world - 1 else plain
    p._RUNTIME.clear()
    samples = {0: [slow_plain] * p.RUNTIME_REPEATS, 1: [one] * p.RUNTIME_REPEATS,
               groups: [one + (groups - 1) * 10e-6] * p.RUNTIME_REPEATS}
    p._RUNTIME.update({False: samples, True: samples})
    alone = p.runtime_costs()
    pooled = p.runtime_costs(together=True)
    # measured afresh where one rank lacks the readings: every rank times at once
    if rank == 0:
        del p._RUNTIME[True]
    measured = p.runtime_costs(together=True)
    p._RUNTIME.clear()
    # the machine rates likewise: the last rank's copies read 4x fast
    c = importlib.import_module("stratagem.planner.calibrate")
    c._RATES.clear()
    rates = {"copy": [(96e9 if rank == world - 1 else 24e9)] * c.RATE_REPEATS,
             "flops": [1e11] * c.RATE_REPEATS, "scan": [4e9] * c.RATE_REPEATS}
    c._RATES.update({False: rates, True: rates})
    rates = {"alone": c.machine_rates(), "pooled": c.machine_rates(together=True),
             "scan": c.scan_rate(together=True)}
    c._RATES.clear()
    return {"alone": alone, "pooled": pooled, "rates": rates, "measured": measured}


def shared_core_calibration_case(rank: int, world: int) -> dict[str, Any]:
    """Calibrate together with every rank pinned to one core (one thread each), on passes
    long enough to span many time slices: what a CPU second costs in wall time; then a row
    scan on rank 0 timed while rank 1 computes on the same core, as in backward."""
    import os
    import statistics
    import time

    import torch.distributed as dist

    import stratagem.planner.probe as p
    from stratagem.planner.calibrate import calibrate, scan_rate

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
    cal = calibrate(model, torch.randn(256, 512), together=True, use_cache=False)
    g, a = torch.zeros(2 ** 17, 128), torch.randn(256, 256)
    torch.nonzero(g.any(dim=1))
    dist.barrier()
    rates, end = [], time.perf_counter() + 0.5
    while time.perf_counter() < end:
        if rank == 0 and len(rates) < 9:
            t = time.perf_counter()
            torch.nonzero(g.any(dim=1))
            rates.append(g.numel() * 4 / (time.perf_counter() - t))
        elif rank != 0:
            a @ a
    dist.barrier()
    return {"share": cal.cpu_share, "tensor_s": cal.tensor_s,
            "cpu_tensor_s": p.runtime_costs(together=True)[0], "scan_bps": cal.scan_bps,
            "cpu_scan_bps": scan_rate(together=True),
            "beside_compute_bps": statistics.median(rates) if rates else None}


def _ten_gbit_nodes(world: int) -> Any:
    """A spec of ``world`` one-worker nodes at 10 Gbit/s (the probe runs over loopback)."""
    from stratagem.resource import ResourceSpec

    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i + 1}", "chief": i == 0, "workers": 1,
         "network_bandwidth": 10.0, "cpus": [0]} for i in range(world)]})


def _probe_with(p: Any, spec: Any, **fakes: Any) -> Any:
    """``probe_links`` with the probe module's functions in ``fakes`` replaced, and its
    phases that these cases do not read (half-precision rates, small operations,
    interference) skipped, restored after."""
    class NoSmall(p._SmallOps):
        def take(self) -> None:
            self.queued, self.chained = [0.0], [0.0]

        def sparse(self, bus_bps: float) -> Any:
            return p.SparseSteps(0.0, 0.0, 0.0, 0.0)

    skipped = {"_HalfRates": type("NoHalf", (), {"sized": staticmethod(lambda *_: None)}),
               "_SmallOps": NoSmall, "_interference": lambda *_: 0.0}
    real = {k: getattr(p, k) for k in {**skipped, **fakes}}
    for k, v in {**skipped, **fakes}.items():
        setattr(p, k, v)
    try:
        return p.probe_links(spec, use_cache=False)
    finally:
        for k, v in real.items():
            setattr(p, k, v)


def suspect_bus_cases(rank: int, world: int, cases: list[list[float]]) -> list[dict[str, Any]]:
    """Probe 2 nodes specified at 10 Gbit/s over loopback once per case, the bus-rate fits
    replaced by the case's readings in turn: how many fits ran and the bus rate the probe
    kept."""
    import importlib

    p = importlib.import_module("stratagem.planner.probe")
    spec = _ten_gbit_nodes(world)
    out = []
    for readings in cases:
        fits = iter(readings)
        calls = []

        def fit(*_: Any, fits: Any = fits, calls: list = calls) -> tuple[float, int]:
            calls.append(1)
            return next(fits), 1  # one size: no 64 MiB follow-up

        probe = _probe_with(p, spec, _bus_rate=fit)
        assert probe is not None
        out.append({"fits": len(calls), "bus_bps": probe.bus_bps})
    return out


def disturbed_link_cases(rank: int, world: int, cases: list[tuple[float, list[float]]]
                         ) -> list[dict[str, Any]]:
    """Probe 2 nodes specified at 10 Gbit/s over loopback once per case ``(bus,
    readings)``, the bus-rate fit replaced by ``bus`` and rank 0's link-alone timings by
    ``readings`` in turn (0 on the other rank, as the real one returns): how many timings
    ran and the link rate the probe kept."""
    import importlib

    p = importlib.import_module("stratagem.planner.probe")
    spec = _ten_gbit_nodes(world)
    out = []
    for bus, readings in cases:
        timed = iter(readings)
        calls = []

        def one_link(*_: Any, timed: Any = timed, calls: list = calls) -> float:
            calls.append(1)
            return next(timed) if rank == 0 else 0.0

        probe = _probe_with(p, spec, _bus_rate=lambda *_, bus=bus: (bus, 1),
                            _one_link=one_link)
        assert probe is not None
        out.append({"timings": len(calls), "link_bps": probe.link_bps})
    return out


def auto_metrics_case(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Auto (the default builder) planning on the first batch of its data loader, with
    rank 0's metrics file in ``run_dir``: three steps."""
    import os

    import stratagem as sg

    os.environ["STRATAGEM_RUN_DIR"] = run_dir
    ad = sg.AutoDist(verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    dm, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(48, 8)
    loader = ad.data_loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                            batch_size=16)
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(dm(xb), yb).backward()
        opt.step()
    if ad.adaptive.recorder is not None:
        ad.adaptive.recorder.close()  # (the harness's workers end without atexit)
    return {"planned": ad.choice is not None}
