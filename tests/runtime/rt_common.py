"""Shared by the runtime tests: models, data, plain-torch references, process spawning.

Workers run in spawned processes (gloo on 127.0.0.1) and write their results to files;
the parent process compares them with single-process references computed with plain
torch, independently of the engine.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _spawn
import torch
from torch import nn

STEPS = 20
BATCH = 8


# -- models and data ------------------------------------------------------------------
class MLP(nn.Module):
    """Composite widths so partitioned builders really split (12 -> 2 parts, 9 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 9)
        self.fc3 = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Tied(nn.Module):
    """Embedding whose weight is also the output projection (tied once in the profile)."""

    def __init__(self, vocab: int = 10, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(x))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 5, sparse=True)
        self.fc = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x))


class Gated(nn.Module):
    """``extra`` is used only on even steps: its gradient is sometimes missing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.extra = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.fc(x)
        return y + self.extra(x) if use_extra else y


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "tied": Tied, "bn": BNNet,
                                               "sparse": SparseNet, "gated": Gated}


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().double()


def batch(model: str, step: int, n: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Global batch ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    if model in ("tied", "sparse"):
        vocab = 10 if model == "tied" else 20
        x = torch.randint(0, vocab, (n,), generator=g)
        y = torch.randint(0, 10 if model == "tied" else 4, (n,), generator=g)
        return x, y
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, y


def loss_fn(model: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model in ("tied", "sparse"):
        return nn.functional.cross_entropy(out, y)
    return nn.functional.mse_loss(out, y)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "plain_sgd":
        return torch.optim.SGD(params, lr=0.2)
    raise ValueError(name)


def sparse_adam(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SparseNet's optimizers: SparseAdam over the sparse embedding (it refuses a dense
    gradient), Adam over the rest."""
    dense = [p for n, p in model.named_parameters() if not n.endswith("emb.weight")]
    emb = [p for n, p in model.named_parameters() if n.endswith("emb.weight")]
    return [torch.optim.SparseAdam(emb, lr=0.05), torch.optim.Adam(dense, lr=0.05)]


def reference_sparse_adam(steps: int, n: int = BATCH) -> dict[str, torch.Tensor]:
    """Single-process SparseNet under :func:`sparse_adam` with the global batch."""
    m = make_model("sparse", 0)
    opts = sparse_adam(m)
    for step in range(steps):
        x, y = batch("sparse", step, n)
        for o in opts:
            o.zero_grad()
        loss_fn("sparse", m(x), y).backward()
        for o in opts:
            o.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def reference(model: str, opt: str, steps: int = STEPS, n: int = BATCH, seed: int = 0
              ) -> dict[str, torch.Tensor]:
    """Single-process plain-torch training with the global batch."""
    m = make_model(model, seed)
    o = make_optimizer(opt, m.parameters())
    for step in range(steps):
        x, y = batch(model, step, n)
        o.zero_grad()
        out = m(x, step % 2 == 0) if model == "gated" else m(x)
        loss_fn(model, out, y).backward()
        o.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# -- spawning -------------------------------------------------------------------------
def spawn(fn: Callable, world: int, out: Path, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world, **kwargs)`` in ``world`` processes, each already in the default
    gloo group; their return values."""
    return _spawn.run(fn, world, out, kwargs, _spawn.Setup(args=(world,), init_group=True))


def guarded(fn: Callable[[], Any]) -> Any:
    """Run one case, turning an exception into a recorded traceback."""
    try:
        return fn()
    except Exception:
        return {"__error__": traceback.format_exc()}


def check(result: Any) -> Any:
    if isinstance(result, dict) and "__error__" in result:
        raise AssertionError(result["__error__"])
    return result
