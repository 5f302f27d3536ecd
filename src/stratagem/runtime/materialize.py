"""Materializing a model built on the meta device, one module at a time.

A model built under ``torch.device("meta")`` has its shapes but no values and takes no
memory. :class:`~stratagem.runtime.DistributedModel` given ``materialize=MetaInit(...)``
gives it values module by module, in registration order (a module's own parameters and
buffers, then its children's: ``named_modules()``), each by the module's
``reset_parameters()`` (or :attr:`MetaInit.init`), after seeding torch's generator once.
A stage-3 unit is handed to FSDP2 as soon as its last module has values, so a worker
never holds more than one whole unit plus its shards: the whole model never exists there.

The values equal eager construction under the same seed when the constructor draws random
numbers in that order -- each module initializing its own parameters (torch's layers do,
in ``reset_parameters``), children constructed in the order they are assigned. See
docs/how-to/meta-device.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from stratagem.errors import StratagemError


@dataclass(frozen=True)
class MetaInit:
    """How a meta-device model gets its values.

    ``seed``: ``torch.manual_seed(seed)`` before the first module (None: the generator as
    it is -- then every worker must have seeded it alike). ``init(name, module)``: gives
    the module's own parameters and buffers their values (they are allocated, contents
    undefined); default: ``module.reset_parameters()``."""

    seed: int | None = 0
    init: Callable[[str, nn.Module], None] | None = None


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, options: MetaInit, device: torch.device, *,
                units: frozenset[str] = frozenset(),
                unit_done: Callable[[str], None] | None = None) -> None:
    """Give every meta tensor of ``module`` values on ``device`` (the module docstring).
    ``unit_done(name)`` is called as soon as every module under the unit ``name`` (one of
    ``units``, not nested) has its values, before the next module gets any."""
    if options.seed is not None:
        torch.manual_seed(options.seed)
    made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
    open_unit: str | None = None
    for name, m in list(module.named_modules()):
        if open_unit is not None and not name.startswith(open_unit + "."):
            if unit_done is not None:
                unit_done(open_unit)
            open_unit = None
        if name in units:
            open_unit = name
        if _allocate(m, device, made):
            _initialize(name, m, options)
    if open_unit is not None and unit_done is not None:
        unit_done(open_unit)
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise StratagemError(f"{left[0]!r} is still on the meta device after materializing",
                             where="DistributedModel(materialize=...)",
                             fix="give its module a reset_parameters() (or MetaInit.init) that "
                                 "sets every parameter and buffer it owns")


def _allocate(m: nn.Module, device: torch.device,
              made: weakref.WeakValueDictionary[int, torch.Tensor]) -> bool:
    """Replace ``m``'s own meta parameters and buffers by uninitialized ones on ``device``
    (a tied parameter once: its other modules get the same tensor). Whether any of them
    is new, i.e. needs initializing."""
    new = False
    for pname, p in list(m.named_parameters(recurse=False)):
        if not p.is_meta:
            continue
        q = made.get(id(p))
        if q is None:
            q = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            made[id(p)] = q
            new = True
        setattr(m, pname, q)
    for bname, b in list(m.named_buffers(recurse=False)):
        if b is not None and b.is_meta:
            setattr(m, bname, torch.empty_like(b, device=device))
            new = True
    return new


def _initialize(name: str, m: nn.Module, options: MetaInit) -> None:
    with torch.no_grad():
        if options.init is not None:
            options.init(name, m)
            return
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise StratagemError(
                f"module {name or '(root)'!r} ({type(m).__name__}) owns parameters or buffers "
                "but has no reset_parameters() to give them values",
                where="DistributedModel(materialize=...)",
                fix=f"define {type(m).__name__}.reset_parameters() to initialize its own "
                    "parameters and buffers, or pass MetaInit(init=...)")
        reset()


def rebind(optimizers: list[torch.optim.Optimizer], old: dict[str, nn.Parameter],
           new: dict[str, nn.Parameter]) -> None:
    """Point the optimizers' parameter groups from the parameters ``old`` (meta ones, or
    those FSDP2 replaced) to their ``new`` ones (by name)."""
    swap = {id(p): new[n] for n, p in old.items() if n in new}
    for opt in optimizers:
        for g in opt.param_groups:
            g["params"] = [swap.get(id(p), p) for p in g["params"]]
