"""Engine-side PS cases, run inside spawned processes (see ps_common.spawn_ps)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from ps_common import (
    BATCH,
    STEPS,
    TIMEOUT,
    batch,
    loss_fn,
    make_model,
    make_optimizers,
    spec_for,
)
from rt_common import guarded

from stratagem.analysis import analyze
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.runtime.ps import join_cluster, run_server
from stratagem.strategy import (
    PS,
    AllReduceSynchronizer,
    Parallax,
    PartitionedPS,
    PSLoadBalancing,
    Strategy,
    UnevenPartitionedPS,
    validate,
)
from stratagem.strategy.validate import server_devices

BUILDERS = {"PS": PS, "PSLoadBalancing": PSLoadBalancing, "PartitionedPS": PartitionedPS,
            "UnevenPartitionedPS": UnevenPartitionedPS, "Parallax": Parallax}
OPTS = ("sgd", "adagrad", "adam")
SYNC_CASES = [(b, o) for b in BUILDERS for o in OPTS]


def run_steps(dm: Any, opts: list, steps: range, sl: slice, scheds: list | None = None,
              data: Any = batch, pause_s: float = 0.0) -> None:
    """Optimizer steps ``steps`` of a user's loop on this worker's slice ``sl`` of each
    global batch ``data(step)`` (``scheds``: LR schedulers stepped after each; ``pause_s``:
    a sleep before each step, a slow worker's)."""
    import time

    for step in steps:
        if pause_s:
            time.sleep(pause_s)
        x, y = data(step)
        for o in opts:
            o.zero_grad()
        loss_fn(dm(x[sl]), y[sl]).backward()
        for o in opts:
            o.step()
        for s in scheds or []:
            s.step()


def train(cluster: Any, builder: Any, opt: str, spec: Any, steps: int = STEPS,
          sparse: bool = True, bag: bool = True, lr_decay: bool = False) -> Any:
    rank, W = cluster.rank, cluster.workers
    model = make_model(seed=rank, sparse=sparse, bag=bag)  # seeds differ (worker 0: 0)
    opts = make_optimizers(opt, model)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 5, 0.5) for o in opts] if lr_decay else []
    profile = analyze(model)
    strategy = validate(builder.build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        stats = run_server(model, plan, opts, cluster)
        return {"server": True, "stats": stats}
    dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    per = BATCH // W
    run_steps(dm, opts, range(steps), slice(rank * per, (rank + 1) * per), scheds)
    dm.refresh_parameters()
    state = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    stats = dm.comm_stats
    dm.close()
    return {"state": state, "stats": stats, "plan": plan.summary()}


def cases_for(workers: int, servers: int) -> list[tuple[str, str]]:
    """2 workers: every builder x optimizer; 4 workers: every builder once, the optimizers
    rotating (each appears), to keep the 6-process spawns short on small machines."""
    if workers <= 2:
        return SYNC_CASES
    return [(b, OPTS[i % len(OPTS)]) for i, b in enumerate(BUILDERS)]


def sync_family(cluster: Any, spec: Any, cases: list | None = None) -> dict:
    out = {}
    for b, o in cases or cases_for(cluster.workers, len(cluster.servers)):
        out[f"{b}/{o}"] = guarded(lambda b=b, o=o: train(cluster, BUILDERS[b](), o, spec))
    return out


def suite(rank: int, workers: int, servers: int, cases: list | None = None,
          ckpt_dir: str = "") -> dict:
    """Everything one spawn runs (workers + servers)."""
    spec = spec_for(workers, servers)
    cluster = join_cluster(spec.replicas, server_devices(spec), timeout=TIMEOUT)
    out = sync_family(cluster, spec, cases)
    if workers == 2 and cases is None:
        for name, kw in CONSISTENCY.items():
            out[f"consistency/{name}"] = guarded(
                lambda kw=kw: consistency_case(cluster, spec, **kw))
    if workers == 2 and cases is None:
        for mode in (True, False):
            out[f"accumulate/no_sync={mode}"] = guarded(
                lambda m=mode: accumulation_case(cluster, spec, m))
        for o in ("sgd", "adagrad"):
            out[f"checkpoint/{o}"] = guarded(lambda o=o: checkpoint_case(
                cluster, spec, o, f"{ckpt_dir}/{o}"))
        vias = ("wrap", "replan") if servers == 0 else ("wrap",)
        for via in vias:
            for o in ("sgd", "adam"):
                out[f"adopt/{via}/{o}"] = guarded(
                    lambda v=via, o=o: adoption_case(cluster, spec, o, v))
    if workers == 2 and cases is None:
        out.update(sparse_family(cluster, spec))
        out["message_order"] = guarded(lambda: message_order_case(cluster, spec))
        out["late_pull"] = guarded(lambda: late_pull_case(cluster, spec, f"{ckpt_dir}-late"))
    if workers == 2 and cases is None:
        out["release"] = guarded(lambda: release_case(cluster, spec))
    if (workers, servers) == (2, 2) and cases is None:
        for comp in ("fp16", "none"):
            out[f"mixed/{comp}"] = guarded(lambda c=comp: train(
                cluster, mixed_strategy(c), "adam", spec))
    return out


MIXED = Path(__file__).with_name("ps_mixed_strategy.yaml")
CONSISTENCY = {"ssp2": {"sync": True, "staleness": 2},
               "ssp1-proxy": {"sync": True, "staleness": 1, "local_proxy_variable": True},
               "async": {"sync": False, "staleness": 0}}


def mixed_strategy(compressor: str) -> Strategy:
    """The hand-written mixed strategy file, with the encoder's compressor replaced."""
    s = Strategy.load(MIXED)
    nodes = tuple(replace(nc, synchronizer=replace(nc.synchronizer, compressor=compressor))
                  if isinstance(nc.synchronizer, AllReduceSynchronizer) else nc
                  for nc in s.node_config)
    return replace(s, node_config=nodes)


def until_failure(rank: int, workers: int, servers: int, signal_dir: str, delay: float = 0.0
                  ) -> dict:
    """Train until the engine raises (a peer is killed by the test); report the error."""
    import time
    from pathlib import Path

    spec = spec_for(workers, servers)
    cluster = join_cluster(spec.replicas, server_devices(spec), timeout=TIMEOUT)
    model = make_model(seed=rank)
    opts = make_optimizers("sgd", model)
    profile = analyze(model)
    strategy = validate(PartitionedPS().build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=workers,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        try:
            run_server(model, plan, opts, cluster)
        except Exception as exc:  # noqa: BLE001 - the other server's view of the failure
            return {"server": True, "error": str(exc), "time": time.time()}
        return {"server": True}
    dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    per = BATCH // workers
    sl = slice(rank * per, (rank + 1) * per)
    step = 0
    try:
        while step < 100000:
            x, y = batch(step % 50)
            for o in opts:
                o.zero_grad()
            loss_fn(dm(x[sl]), y[sl]).backward()
            for o in opts:
                o.step()
            step += 1
            if step == 5:
                (Path(signal_dir) / f"ready{rank}").write_text("")
            time.sleep(delay)
    except Exception as exc:  # noqa: BLE001 - what the user would see
        return {"error": str(exc), "type": type(exc).__name__, "time": time.time(),
                "step": step}
    return {"error": None, "step": step}


def consistency_case(cluster: Any, spec: Any, sync: bool, staleness: int, slow: int = 1,
                     delay: float = 0.02, steps: int = 40,
                     local_proxy_variable: bool = False) -> Any:
    """SGD on the teacher task with worker ``slow`` sleeping ``delay`` s per step."""
    from ps_common import task_batch, task_loss

    rank, W = cluster.rank, cluster.workers
    model = make_model(seed=rank)
    opts = [torch.optim.SGD(model.parameters(), lr=0.2)]
    profile = analyze(model)
    builder = PartitionedPS(local_proxy_variable=local_proxy_variable, sync=sync,
                            staleness=staleness)
    strategy = validate(builder.build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        return {"server": True, "stats": run_server(model, plan, opts, cluster)}
    dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    before = task_loss(dm.module)
    per = BATCH // W
    run_steps(dm, opts, range(steps), slice(rank * per, (rank + 1) * per), data=task_batch,
              pause_s=delay if rank == slow else 0.0)
    history = list(dm._ps.history)
    dm.refresh_parameters()
    after = task_loss(dm.module)
    stats = dm.comm_stats
    dm.close()
    return {"history": history, "before": before, "after": after, "stats": stats,
            "state": {k: v.clone() for k, v in dm.state_dict().items()}}


def checkpoint_case(cluster: Any, spec: Any, opt: str, path: str) -> Any:
    """Train 10 steps (PartitionedPS), save, train 10 more; then a fresh model under
    another strategy (everything on one owner) loads the checkpoint and trains the same
    10 steps. Both must end where single-process training ends."""
    from stratagem import checkpoint

    rank, W = cluster.rank, cluster.workers
    per = BATCH // W
    sl = slice(rank * per, (rank + 1) * per) if rank < W else None

    def run(builder: Any, seed: int) -> tuple[Any, Any, Any]:
        model = make_model(seed=seed)
        opts = make_optimizers(opt, model)
        profile = analyze(model)
        strategy = validate(builder.build(profile, spec), profile, spec)
        plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                            device=torch.device("cpu"), servers=server_devices(spec))
        if plan.role == "server":
            run_server(model, plan, opts, cluster)
            return None, None, None
        return DistributedModel(model, plan, optimizer=opts, cluster=cluster), opts, plan

    def steps(dm: Any, opts: Any, rng: range) -> None:
        run_steps(dm, opts, rng, sl)

    dm, opts, _ = run(PartitionedPS(), seed=rank)
    if dm is not None:
        steps(dm, opts, range(10))
        checkpoint.save(path, dm, opts[0])
        steps(dm, opts, range(10, 20))
        dm.refresh_parameters()
        first = {k: v.clone() for k, v in dm.state_dict().items()}
        dm.close()
    dm, opts, plan = run(PS(), seed=100 + rank)  # one owner: a different layout
    if dm is None:
        return {"server": True}
    checkpoint.load(path, dm, opts[0])
    steps(dm, opts, range(10, 20))
    dm.refresh_parameters()
    second = {k: v.clone() for k, v in dm.state_dict().items()}
    dm.close()
    return {"continued": first, "restored": second, "plan": plan.summary()}


def adoption_case(cluster: Any, spec: Any, opt: str, via: str) -> Any:
    """The optimizer already holds state when the PS engine starts: 10 steps of plain
    torch on the global batch (the same on every rank, as after every worker loaded one
    checkpoint), then PartitionedPS for 10 more -- by wrapping the trained model
    (``via="wrap"``) or by switching an all-reduce model's plan (``via="replan"``, as
    Auto does on the first batch of a resumed job). The owners must carry the moments
    and step counts on: the end must be 20 single-process steps."""
    from ps_common import reference_run

    from stratagem.strategy import AllReduce

    rank, W = cluster.rank, cluster.workers
    model, opts = reference_run(opt, steps=10)
    profile = analyze(model)

    def plan_of(builder: Any) -> Any:
        strategy = validate(builder.build(profile, spec), profile, spec)
        return compile_plan(strategy, profile, rank=rank, world_size=W,
                            device=torch.device("cpu"), servers=server_devices(spec))

    plan = plan_of(PartitionedPS())
    if plan.role == "server":
        return {"server": True, "stats": run_server(model, plan, opts, cluster)}
    if via == "wrap":
        dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    else:
        dm = DistributedModel(model, plan_of(AllReduce()), optimizer=opts, cluster=cluster)
        dm.replan(lambda: plan, optimizer=opts, cluster=cluster)
    per = BATCH // W
    run_steps(dm, opts, range(10, 20), slice(rank * per, (rank + 1) * per))
    dm.refresh_parameters()
    state = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    dm.close()
    return {"state": state}


def release_case(cluster: Any, spec: Any, runtimes: int = 5) -> Any:
    """Create, train (Adam, 3 steps) and close ``runtimes`` PartitionedPS models in turn,
    as trial steps do; after each, this process's thread counts (Python's, and the OS's:
    gloo's)."""
    import os
    import threading

    rank, W = cluster.rank, cluster.workers
    counts = []
    for _ in range(runtimes):
        model = make_model(seed=0)
        opts = make_optimizers("adam", model)
        profile = analyze(model)
        strategy = validate(PartitionedPS().build(profile, spec), profile, spec)
        plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                            device=torch.device("cpu"), servers=server_devices(spec))
        if plan.role == "server":
            run_server(model, plan, opts, cluster)
        else:
            dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
            run_steps(dm, opts, range(3), slice(rank, None, W))
            dm.close()
            del dm
        counts.append((threading.active_count(), len(os.listdir("/proc/self/task"))))
    return {"counts": counts, "namespaces": len(cluster._groups)}


def accumulation_case(cluster: Any, spec: Any, use_no_sync: bool) -> Any:
    """Two half-batch backward passes per optimizer step (the first under ``no_sync`` or
    pushed too): the owners' accumulated gradient equals the full batch's."""
    rank, W = cluster.rank, cluster.workers
    model = make_model(seed=rank)
    opts = make_optimizers("adagrad", model)
    profile = analyze(model)
    strategy = validate(Parallax().build(profile, spec) if use_no_sync else
                        PartitionedPS().build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        return {"server": True, "stats": run_server(model, plan, opts, cluster)}
    dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    per = BATCH // W
    for step in range(10):
        x, y = batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        half = per // 2
        opts[0].zero_grad()
        if use_no_sync:
            with dm.no_sync():
                (loss_fn(dm(x[:half]), y[:half]) / 2).backward()
        else:
            (loss_fn(dm(x[:half]), y[:half]) / 2).backward()
        (loss_fn(dm(x[half:]), y[half:]) / 2).backward()
        opts[0].step()
    dm.refresh_parameters()
    state = {k: v.clone() for k, v in dm.state_dict().items()}
    dm.close()
    return {"state": state}


def sparse_family(cluster: Any, spec: Any, names: list[str] | None = None) -> dict:
    import ps_sparse

    return {f"sparse/{n}": guarded(lambda n=n: sparse_case(cluster, spec, n))
            for n in names or ps_sparse.CASES}


def late_pull_case(cluster: Any, spec: Any, signal_dir: str) -> Any:
    """``twice/adagrad`` where a worker's third embedding call first waits (up to 20 s)
    until every worker without a third call this step has started its backward (a
    gradient hook writes a file). Returns sparse_case's result plus ``blocked``: the
    steps where that wait timed out (a closing pull round held the other's backward)."""
    import time

    import ps_sparse

    case = ps_sparse.CASES["twice/adagrad"]
    rank, W = cluster.rank, cluster.workers
    folder = Path(signal_dir)
    folder.mkdir(parents=True, exist_ok=True)
    blocked: list[int] = []
    step = [0]

    def started_backward(_param: torch.Tensor) -> None:
        (folder / f"backward{rank}-{step[0]}").touch()

    def wait_for_others() -> None:
        x, _ = ps_sparse.global_batch(case, step[0])
        per = len(x) // W
        others = [q for q in range(W) if q != rank and not len(
            ps_sparse.third_call_rows(x[q * per:(q + 1) * per]))]
        deadline = time.monotonic() + (0 if blocked else 20)
        while not all((folder / f"backward{q}-{step[0]}").exists() for q in others):
            if time.monotonic() > deadline:
                blocked.append(step[0])
                return
            time.sleep(0.005)

    ps_sparse.BEFORE_THIRD_CALL = wait_for_others
    try:
        return sparse_case(cluster, spec, "twice/adagrad", current=step,
                           on_model=lambda m: m.fc2.weight.register_post_accumulate_grad_hook(
                               started_backward)) | {"blocked": blocked}
    finally:
        ps_sparse.BEFORE_THIRD_CALL = None


def sparse_case(cluster: Any, spec: Any, name: str, current: list[int] | None = None,
                on_model: Any = None) -> Any:
    """One ps_sparse case on this worker's slices of the global batches. Returns the
    values (also before any refresh), the embedding's optimizer state as the chief gathers
    it for a checkpoint, the rows pulled per step and, for each pull round, (step, round,
    agreed capacity, most ids asked of one owner, whether an embedding call ran it: False
    for the closing rounds after the forward). ``current``: a one-item list kept at the
    current step; ``on_model(model)`` runs before the model is wrapped."""
    import ps_sparse

    case = ps_sparse.CASES[name]
    rank, W = cluster.rank, cluster.workers
    model = ps_sparse.make_model(case, seed=rank)  # seeds differ (worker 0: 0)
    if on_model is not None:
        on_model(model)
    current = current if current is not None else [0]
    opts = make_optimizers(case.opt, model)
    profile = analyze(model)
    builder = BUILDERS[case.builder](local_proxy_variable=case.proxy)
    strategy = validate(builder.build(profile, spec), profile, spec)
    plan = compile_plan(strategy, profile, rank=rank, world_size=W,
                        device=torch.device("cpu"), servers=server_devices(spec))
    if plan.role == "server":
        return {"server": True, "stats": run_server(model, plan, opts, cluster)}
    dm = DistributedModel(model, plan, optimizer=opts, cluster=cluster)
    sx = dm._ps.sparse
    rounds: list[tuple[int, int, int, int, bool]] = []
    pull_round = sx.pull_round

    def logged(requests: Any) -> bool:  # what the engine asks, and of which capacity
        per_owner: dict[int, int] = {}
        for i, ids in (requests or {}).items():
            o = sx.pieces[i].owner
            if o != rank:
                per_owner[o] = per_owner.get(o, 0) + len(ids)
        cap = sx.caps[sx.round] if sx.round < len(sx.caps) else 0
        rounds.append((current[0], sx.round, cap, max(per_owner.values(), default=0),
                       requests is not None))
        return pull_round(requests)

    sx.pull_round = logged
    pulled = []
    for step in range(case.steps):
        current[0] = step
        ps_sparse.before_step(case, model, step)
        x, y = ps_sparse.global_batch(case, step)
        per = len(x) // W
        sl = slice(rank * per, (rank + 1) * per)
        for o in opts:
            o.zero_grad()
        before = dm.comm_stats.rows_pulled
        ps_sparse.train_step(case, dm, x[sl], y[sl])
        pulled.append(dm.comm_stats.rows_pulled - before)
        for o in opts:
            o.step()
    unrefreshed = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    dm.before_checkpoint()  # current values on this rank (point to point)
    state = {k: v.detach().clone() for k, v in dm.state_dict().items()}
    table = ps_sparse.table_state(opts, model.emb.weight) if rank == 0 else None
    stats = dm.comm_stats
    dm.close()
    return {"state": state, "unrefreshed": unrefreshed, "table_state": table,
            "pulled": pulled, "rounds": rounds, "stats": stats,
            "owners": [(p.row_start, p.rows, p.owner) for p in plan.ps.sparse]}


def message_order_case(cluster: Any, spec: Any) -> list[tuple[str, int]]:
    """PartitionedPS for a few steps, recording this rank's point-to-point posts in order:
    ``("send" | "recv", tag)`` (see test_ps.test_receives_are_posted_before_sends); the
    fetch groups' (single-rank reads, their own threads) are not part of a step."""
    from stratagem.runtime.ps.cluster import Group

    log: list[tuple[str, int]] = []
    send, recv = Group.send, Group.recv

    def logged_send(self: Group, t: torch.Tensor, dst: int, tag: int) -> Any:
        if "/fetch" not in self.name:
            log.append(("send", tag))
        return send(self, t, dst, tag)

    def logged_recv(self: Group, t: torch.Tensor, src: int, tag: int) -> Any:
        if "/fetch" not in self.name:
            log.append(("recv", tag))
        return recv(self, t, src, tag)

    Group.send, Group.recv = logged_send, logged_recv
    try:
        train(cluster, PartitionedPS(), "sgd", spec, steps=3)
    finally:
        Group.send, Group.recv = send, recv
    return log
