"""The step boundary: where an in-process rescale and a SIGTERM save happen.

Exit points come after each step of an AutoDist data loader and between the epochs of
``remaining_epochs_until``. At each one the members first apply pending joins and leaves
(:func:`stratagem.elastic.rescale.rescale_point`); then, with a checkpoint directory
configured, they agree whether any rank got SIGTERM (in an in-process elastic job: whether
every member agreed to leave, since there a SIGTERM means "leave") and if so save every
registered state and exit with :data:`~stratagem.elastic.signals.EXIT_CODE`; and whether a periodic
checkpoint is due (every ``STRATAGEM_CHECKPOINT_STEPS`` steps or
``STRATAGEM_CHECKPOINT_SECONDS`` seconds), which bounds what a SIGKILLed worker costs: the
job restarts from that checkpoint (``stratagem run --max-restarts``). Periodic checkpoints
are written in the background (:mod:`stratagem.elastic.background_save`) unless
``STRATAGEM_CHECKPOINT_ASYNC=0``; the SIGTERM save is synchronous.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from stratagem import env
from stratagem.distributed.process_group import rank_world
from stratagem.elastic.context import JobContext, current_job
from stratagem.elastic.rescale import rescale_point
from stratagem.elastic.signals import EXIT_CODE, install_signal_handler
from stratagem.elastic.state import checkpoint_root, save_all_states

clock = time.monotonic  # the periodic-checkpoint clock (a module attribute: tests set it)


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


def any_rank_flags(*flags: bool) -> tuple[bool, ...]:
    """Collective: each flag OR-ed over the ranks, in one all-reduce."""
    if rank_world()[1] == 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=current_job().control_group())
    return tuple(bool(v) for v in t.tolist())


def checkpoint_due(ctx: JobContext, now: float) -> bool:
    """Whether this rank thinks a periodic checkpoint is due. The step count is the same on
    every rank; the time rule is decided by rank 0's clock alone (the others say no), so
    the ranks never disagree about a save."""
    steps, seconds = env.checkpoint_steps(), env.checkpoint_seconds()
    if steps is not None and ctx.steps_since_save >= steps:
        return True
    if seconds is None or rank_world()[0] != 0:
        return False
    if ctx.last_save is None:
        ctx.last_save = now  # the clock starts at the first boundary after a save
        return False
    return now - ctx.last_save >= seconds


def exit_point(step: bool = False) -> None:
    """Collective: if any rank got SIGTERM, save all states and exit with ``EXIT_CODE``;
    else save them if a periodic checkpoint is due. ``step``: this boundary ends a
    training step (counted for ``STRATAGEM_CHECKPOINT_STEPS``).

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
    ctx.steps_since_save += int(step)
    # In an in-process elastic job a SIGTERM asks this worker to leave, and the rescale
    # agreement above alone decides whether the whole job stops (every member leaving). The
    # signal flag itself is not read again here: a SIGTERM that landed after the agreement
    # would otherwise stop every member (the shrink of issue 47 that ended in exit 143).
    requested = ctx.stop_agreed if ctx.group is not None else ctx.exit_requested
    stop, due = any_rank_flags(requested, checkpoint_due(ctx, clock()))
    if not stop:
        if due:  # restarts the counters
            save_all_states(background=env.checkpoint_async())
        return
    path = save_all_states()  # synchronous (after the one in flight): complete before exit
    if rank_world()[0] == 0:
        print(f"stratagem: stop requested (SIGTERM): job state saved to {path}; exiting",
              file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)
