"""Shared by the parameter-server tests: an embedding model, specs, references, spawning.

Workers and servers run in spawned processes that join a PS cluster the way AutoDist does
(``join_cluster``: no default group beforehand; servers get none). The parent compares
their results with plain-torch single-process references.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _spawn
import torch
import torch.multiprocessing as mp
from torch import nn

from stratagem.resource import ResourceSpec

STEPS = 20
BATCH = 8
VOCAB = 24
DIM = 4
BAG = 3


class EmbNet(nn.Module):
    """A sparse embedding (bags of ids) plus a dense tower; 24 rows split evenly 2/3/4 ways."""

    def __init__(self, sparse: bool = True, bag: bool = True) -> None:
        super().__init__()
        self.bag = bag
        self.emb = (nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=sparse) if bag
                    else nn.Embedding(VOCAB, DIM, sparse=sparse))
        self.fc1 = nn.Linear(DIM, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) if self.bag else self.emb(ids).sum(dim=1)
        return self.fc2(torch.tanh(self.fc1(h)))


def make_model(seed: int, sparse: bool = True, bag: bool = True) -> EmbNet:
    torch.manual_seed(seed)
    return EmbNet(sparse, bag).double()


def batch(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed ids (low ids are hot), labels in 0..2."""
    g = torch.Generator().manual_seed(500 + step)
    u = torch.rand(n, BAG, generator=g, dtype=torch.float64)
    ids = (VOCAB * u ** 2).long().clamp_max(VOCAB - 1)
    y = torch.randint(0, 3, (n,), generator=g)
    return ids, y


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def make_optimizers(name: str, model: EmbNet) -> list[torch.optim.Optimizer]:
    """What a user writes; the Adam variant is torch's own lazy-Adam recipe."""
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.2)]
    if name == "adam":
        dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        return [torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                torch.optim.Adam(dense, lr=0.05)]
    if name == "adam1":  # one Adam over everything: lazy Adam for the embedding rows
        return [torch.optim.Adam(model.parameters(), lr=0.05)]
    raise ValueError(name)


def reference(opt: str, steps: int = STEPS, sparse: bool = True, bag: bool = True,
              lr_decay: bool = False) -> dict[str, torch.Tensor]:
    """Plain torch, one process, the global batch."""
    m, _ = reference_run(opt, steps, sparse, bag, lr_decay)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def reference_run(opt: str, steps: int = STEPS, sparse: bool = True, bag: bool = True,
                  lr_decay: bool = False) -> tuple[EmbNet, list[torch.optim.Optimizer]]:
    """:func:`reference`'s model and optimizers after ``steps`` steps."""
    m = make_model(0, sparse, bag)
    # One Adam over everything is lazy Adam for the rows: SparseAdam + Adam.
    opts = make_optimizers("adam" if opt == "adam1" else opt, m)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 5, 0.5) for o in opts] if lr_decay else []
    for step in range(steps):
        x, y = batch(step)
        for o in opts:
            o.zero_grad()
        loss_fn(m(x), y).backward()
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
    return m, opts


def train_slices(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                 world: int, fail_at: int | None = None) -> None:
    """A user's loop (ps_script.py, ps_idiom.py): STEPS steps on this worker's slice of
    each global batch; ``fail_at``: raise after that step's forward (a bug in user code)."""
    per = BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        out = model(x[sl])
        if step == fail_at:
            raise RuntimeError(f"user code failed at step {step}")
        loss_fn(out, y[sl]).backward()
        optimizer.step()


def spec_for(workers: int, servers: int) -> ResourceSpec:
    """One worker node (``workers`` CPU workers) plus ``servers`` server-only nodes."""
    nodes = [{"address": "10.0.0.1", "chief": True, "workers": workers, "cpus": [0]}]
    nodes += [{"address": f"10.0.1.{i + 1}", "workers": 0, "cpus": [0]} for i in range(servers)]
    return ResourceSpec.from_dict({"nodes": nodes})


# -- spawning ---------------------------------------------------------------------------
def _setup(workers: int, servers: int) -> _spawn.Setup:
    """``fn(rank, workers, servers)``; ranks from ``workers`` on are servers. No default group:
    ``fn`` joins the cluster the way AutoDist does (join_cluster)."""
    return _spawn.Setup(args=(workers, servers), local_rank=True,
                        roles=("worker",) * workers + ("server",) * servers)


def spawn_ps(fn: Callable, workers: int, servers: int, out: Path, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, workers, servers, **kw)`` in workers + servers processes."""
    return _spawn.run(fn, workers + servers, out, kwargs, _setup(workers, servers))


TIMEOUT = timedelta(seconds=60)


def _script_entry(index: int, world: int, port: int, roles: list[str], script: str,
                  env: dict, out: str) -> None:
    import runpy

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index),
                      WORLD_SIZE=str(world), LOCAL_RANK="0", STRATAGEM_ROLE=roles[index],
                      PS_OUT=out)
    torch.set_num_threads(1)
    sys.argv = [script]
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        code = traceback.format_exc()
    (Path(out) / f"exit{index}.txt").write_text(repr(code))
    _spawn.leave(hard=False)  # as the script's process would end: its atexit handlers run


def run_script(script: Path, roles: list[str], out: Path, env: dict[str, str],
               failing: bool = False) -> list[str]:
    """Run ``script`` as a torchrun-like job (one process per role, launcher rank = index);
    returns each process's exit code (repr) or traceback. ``failing``: the script is
    expected to fail, so a process that dies after recording its result (gloo's teardown
    aborts a process with work in flight now and then) neither fails the run nor gets its
    peers terminated."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_script_entry, args=(len(roles), _spawn.free_port(), roles,
                                                  str(script), env, str(out)),
                             nprocs=len(roles), start_method="spawn", join=not failing)
    if failing:
        for proc in ctx.processes:
            proc.join(300)
    return [(out / f"exit{i}.txt").read_text() for i in range(len(roles))]


def spawn_and_kill(fn: Callable, workers: int, servers: int, out: Path, victim: int,
                   ready: str = "ready", **kwargs: Any) -> tuple[list[Any], float]:
    """Like :func:`spawn_ps`, but SIGKILL rank ``victim`` once every worker has written
    ``out/<ready><rank>``; returns the survivors' results and the kill time."""
    import signal
    import time

    world = workers + servers
    ctx = _spawn.start(fn, world, out, kwargs, _setup(workers, servers), join=False)
    deadline = time.monotonic() + 120
    while not all((out / f"{ready}{r}").exists() for r in range(workers)):
        if time.monotonic() > deadline:
            raise AssertionError("workers never got ready")
        time.sleep(0.05)
    os.kill(ctx.processes[victim].pid, signal.SIGKILL)
    killed = time.time()
    for p in ctx.processes:
        p.join(timeout=120)
    return _spawn.load(out, world, missing_ok=True), killed


_TEACHER: list[EmbNet] = []


def task_batch(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: the labels of a fixed random teacher network (8 batches cycle)."""
    if not _TEACHER:
        _TEACHER.append(make_model(999))
    ids, _ = batch(step % 8, n)
    with torch.no_grad():
        y = _TEACHER[0](ids).argmax(dim=1)
    return ids, y


def task_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return sum(loss_fn(model(x), y).item() for x, y in map(task_batch, range(8))) / 8
