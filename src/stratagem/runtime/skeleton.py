"""A model's skeleton: its modules without values, to rebuild it plain after FSDP2 sharded it.

``fully_shard`` changes a module in place (its class, hooks, parameters) and torch offers no
way to undo that or to move it onto another process group. An in-process rescale of a
stage-3 job therefore does not reuse the sharded modules: before the first
``fully_shard``, :func:`skeleton` keeps a copy of the model whose parameters and buffers
are on the meta device (the structure, classes and attributes; no memory for values); at
the rescale, :func:`assemble` turns that copy into a plain model holding the whole values
gathered in the old group, which the new group's FSDP2 then shards afresh. Only public
APIs: ``copy.deepcopy`` (its memo maps each tensor to a meta one), attribute assignment
of parameters and buffers.

The rebuilt model is a new object: references to the old module (and its submodules)
go stale; :class:`~stratagem.runtime.DistributedModel` holds the new one as ``.module``.
Attributes a program changed on the model after distributing it (other than train/eval
mode) are not carried over.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from stratagem.errors import StratagemError


def skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every parameter and buffer on the meta device (tied
    ones stay tied). Raises StratagemError when the module cannot be copied."""
    memo: dict[int, object] = {}
    for p in module.parameters():  # (deduplicated: a tied parameter once)
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception as exc:  # an attribute that cannot be copied (a lock, a file...)
        raise StratagemError(
            f"the model cannot be copied for an in-process rescale of its stage-3 units: "
            f"{type(exc).__name__}: {exc}"[:400], where="stage-3 in-process rescale",
            fix="keep objects that copy.deepcopy refuses off the model's modules, use ZeRO "
                "stage 1 or 2, or checkpoint-restart (SIGTERM and relaunch)") from None


def assemble(skel: nn.Module, live: nn.Module, whole: dict[str, torch.Tensor]) -> nn.Module:
    """``skel`` (from :func:`skeleton`, consumed) given values: parameter ``name`` becomes
    a new parameter holding ``whole[name]`` when given, else ``live``'s parameter of that
    name (the same object); buffers are ``live``'s; each module takes its train/eval mode
    from ``live``. Returns ``skel``, now a plain model."""
    live_params = dict(live.named_parameters())
    live_buffers = dict(live.named_buffers())
    value: dict[int, torch.Tensor] = {}
    for name, p in skel.named_parameters():
        if name in whole:
            flag = live_params[name].requires_grad if name in live_params else p.requires_grad
            value[id(p)] = nn.Parameter(whole[name], requires_grad=flag)
        elif name in live_params:
            value[id(p)] = live_params[name]
        else:
            raise StratagemError(f"parameter {name!r} has no value to rebuild the model with",
                                 where="stage-3 in-process rescale",
                                 fix="report this: the model's parameters changed after it "
                                     "was distributed")
    for name, b in skel.named_buffers():
        if name not in live_buffers:
            raise StratagemError(f"buffer {name!r} has no value to rebuild the model with",
                                 where="stage-3 in-process rescale",
                                 fix="report this: the model's buffers changed after it was "
                                     "distributed")
        value[id(b)] = live_buffers[name]
    modes = {name: m.training for name, m in live.named_modules()}
    for name, m in skel.named_modules():
        for pname, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(m, pname, value[id(p)])
        for bname, b in list(m.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(m, bname, value[id(b)])
        if name in modes:
            m.training = modes[name]
    return skel
