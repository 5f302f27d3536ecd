"""The must-hold memory case: a small transformer whose fp32 parameters, gradients and
Adam state need about 3x a worker's memory limit, trained by Auto on 4 CPU workers."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, BLOCKS, SEQ = 512, 192, 36, 8
PER_WORKER = 1  # sequences per worker and step
STEPS = 2
LR = 1e-3
EPS = 1e-4
"""Adam's epsilon: above fp32's rounding of the gradients, so that an element whose
gradient is ~0 (its sign decided by summation order) is not normalized to a full step;
the single-process reference uses it too. (At 1e-5, 2 of the 36-block model's 16 M
elements moved by 2e-6, 0.2% of a step, with the summation order.)"""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Matrices only (no biases, no norm scales): few large tensors. No key bias in
        # particular: softmax ignores it, so its gradient is rounding noise that Adam would
        # scale up to full steps.
        self.ln1 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.ln2 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.fc1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.fc2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def reset_parameters(self) -> None:
        """Its own parameter (built on the meta device, the model gets values by this)."""
        nn.init.zeros_(self.pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def make(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def full_state_bytes() -> int:
    """fp32 parameters + gradients + Adam's two moments."""
    return 4 * sum(p.numel() * 4 for p in make().parameters())


def reference(world: int) -> dict[str, torch.Tensor]:
    m = make()
    opt = torch.optim.Adam(m.parameters(), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = data(step, PER_WORKER * world)
        opt.zero_grad()
        loss_of(m(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def exact_malloc() -> None:
    """glibc returns freed large blocks to the system at once (a fixed mmap threshold), so
    resident memory follows the live tensors rather than the allocator's cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, no dynamic growth
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    libc.mallopt(-8, 1)  # M_ARENA_MAX: the collectives' threads share the main arena


def warm_up(rank: int, world: int, spec: object) -> None:
    """One Auto choice and two steps of ZeRO-3 on a narrow two-block copy of the model
    (same layers, optimizer, planner, sharding engine and collectives): the libraries'
    one-time allocations (modules imported on first use, thread pools, kernels' scratch
    space, FSDP2's and DTensor's caches) land in the process baseline, not in the growth."""
    import gc

    from stratagem.analysis import analyze
    from stratagem.planner import choose
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import DistributedModel, MetaInit, compile_plan
    from stratagem.strategy import Auto
    from stratagem.strategy.builders import ZeRO

    global DIM, BLOCKS
    saved = DIM, BLOCKS
    DIM, BLOCKS = 16, 2
    try:
        with torch.device("meta"):
            m = TinyGPT()
        opt = torch.optim.Adam(m.parameters(), lr=LR, eps=EPS)
        x, y = data(0, PER_WORKER)
        assert isinstance(spec, ResourceSpec)
        choose(m, spec, sample_input=(x,), options=Auto(probe=False, trials=0), optimizer=opt)
        profile = analyze(m)
        plan = compile_plan(ZeRO(stage=3).build(profile, spec), profile, rank=rank,
                            world_size=world, device=torch.device("cpu"))
        dm = DistributedModel(m, plan, optimizer=opt, materialize=MetaInit(seed=1))
        for _ in range(2):
            opt.zero_grad()
            loss_of(dm(x), y).backward()
            opt.step()
        dm.full_state_dict()
        del dm, m, opt
        gc.collect()
    finally:
        DIM, BLOCKS = saved


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def train(rank: int, world: int, limit: int | None) -> dict:
    """Auto (the planner: ``choose``) under ``limit`` bytes per worker, the runtime's
    DistributedModel; the model built on the meta device and given the values of
    :func:`make` (seed 0) unit by unit as it is wrapped; peak RSS growth from before the
    model is built."""
    exact_malloc()
    from stratagem.analysis import analyze
    from stratagem.planner import choose
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import DistributedModel, MetaInit, compile_plan
    from stratagem.strategy import Auto

    node: dict = {"address": "127.0.0.1", "workers": world}
    if limit is not None:
        node["memory"] = limit
    spec = ResourceSpec.from_dict({"nodes": [node]})
    sl = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)
    warm_up(rank, world, spec)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    baseline = status_kib("VmRSS") * 1024
    with torch.device("meta"):  # shapes only: the values come unit by unit, when wrapped
        model = TinyGPT()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    x0, _ = data(0, PER_WORKER * world)
    marks = {"model": status_kib("VmHWM") * 1024 - baseline}
    choice = choose(model, spec, sample_input=(x0[sl],), options=Auto(probe=False, trials=0),
                    optimizer=opt)
    marks["plan"] = status_kib("VmHWM") * 1024 - baseline
    marks["plan_rss"] = status_kib("VmRSS") * 1024 - baseline
    profile = analyze(model)
    plan = compile_plan(choice.strategy, profile, rank=rank, world_size=world,
                        device=torch.device("cpu"))
    dm = DistributedModel(model, plan, optimizer=opt, materialize=MetaInit(seed=0))
    marks["wrap"] = status_kib("VmHWM") * 1024 - baseline
    marks["wrap_rss"] = status_kib("VmRSS") * 1024 - baseline
    for step in range(STEPS):
        x, y = data(step, PER_WORKER * world)
        opt.zero_grad()
        loss_of(dm(x[sl]), y[sl]).backward()
        opt.step()
        marks[f"step{step}"] = status_kib("VmHWM") * 1024 - baseline
    peak = status_kib("VmHWM") * 1024 - baseline  # (before the whole state is gathered)
    est = choice.memory
    return {"peak": peak, "marks": marks, "estimate": est.peak if est is not None else None,
            "items": dict(est.items) if est is not None else None,
            "builder": choice.best.name, "notes": list(choice.notes),
            "state": dm.full_state_dict()}
