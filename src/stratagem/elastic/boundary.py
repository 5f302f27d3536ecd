"""The step boundary: where an in-process rescale and a SIGTERM save happen.

Exit points come after each step of an AutoDist data loader and between the epochs of
``remaining_epochs_until``. At each one the members first apply pending joins and leaves
(:func:`stratagem.elastic.rescale.rescale_point`); then, with a checkpoint directory
configured, they agree whether any rank got SIGTERM and if so save every registered state
and exit with :data:`~stratagem.elastic.signals.EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from stratagem.elastic.context import current_job
from stratagem.elastic.rescale import rescale_point
from stratagem.elastic.signals import EXIT_CODE, install_signal_handler
from stratagem.elastic.state import checkpoint_root, save_all_states
from stratagem.process_group import rank_world


@contextlib.contextmanager
def hold_exit() -> Iterator[None]:
    """Exit points inside the block do nothing (e.g. between gradient-accumulation
    micro-steps, whose partial gradients a checkpoint would not keep). All ranks must hold
    at the same points."""
    ctx = current_job()
    ctx.exit_holds += 1
    try:
        yield
    finally:
        ctx.exit_holds -= 1


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is set on any rank (on the job's gloo control group)."""
    if rank_world()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=current_job().control_group())
    return bool(t.item())


def exit_point() -> None:
    """Collective: if any rank got SIGTERM, save all states and exit with ``EXIT_CODE``.

    Does nothing without a checkpoint directory (SIGTERM then keeps its default effect).
    The first call installs the SIGTERM handler. Every rank must call it at the same points.
    """
    ctx = current_job()
    if ctx.exit_holds:
        return
    rescale_point()  # in-process elastic jobs: workers join and leave here
    if checkpoint_root() is None:
        return
    install_signal_handler()
    if not any_rank(ctx.exit_requested):
        return
    path = save_all_states()
    if rank_world()[0] == 0:
        print(f"stratagem: stop requested (SIGTERM): job state saved to {path}; exiting",
              file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)
