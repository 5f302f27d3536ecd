"""Graceful stop on SIGTERM: finish the step, save the job state, exit with 143.

torch elastic (``torchrun``), Kubernetes and most schedulers stop a worker with SIGTERM and
kill it a grace period later (``torchrun --shutdown-timeout``, default 30 s). While a
checkpoint directory is configured, Stratagem's handler only notes the signal; the next
*exit point* -- after each step of an AutoDist data loader, and between epochs of
``remaining_epochs_until`` -- agrees across ranks whether any rank was signalled, and if so
saves every registered state and exits with :data:`EXIT_CODE`. The signal never interrupts
a step, so none of its state is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by SIGTERM reports

_requested = False
_installed = False
_previous: Any = None
_holds = 0
_group: Any = None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


def install_signal_handler() -> bool:
    """Catch SIGTERM (idempotent). Returns False off the main thread, where Python cannot."""
    global _installed, _previous
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous = signal.signal(signal.SIGTERM, _on_signal)
    _installed = True
    return True


def uninstall_signal_handler() -> None:
    """Restore the previous SIGTERM handler; re-deliver a SIGTERM that is still pending."""
    global _installed
    if not _installed:
        return
    signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _installed = False
    if _requested:
        os.kill(os.getpid(), signal.SIGTERM)


def reset() -> None:
    """Uninstall the handler and forget a pending request (tests, in-process restarts)."""
    global _requested, _holds, _group
    _requested = False
    _holds = 0
    _group = None
    uninstall_signal_handler()


def exit_requested() -> bool:
    """Whether this process received SIGTERM (local; see :func:`exit_point`)."""
    return _requested


def request_exit() -> None:
    """Act as if SIGTERM arrived: stop at the next exit point."""
    global _requested
    _requested = True


@contextlib.contextmanager
def hold_exit() -> Iterator[None]:
    """Exit points inside the block do nothing (e.g. between gradient-accumulation
    micro-steps, whose partial gradients a checkpoint would not keep). All ranks must hold
    at the same points."""
    global _holds
    _holds += 1
    try:
        yield
    finally:
        _holds -= 1


def _control_group() -> Any:
    """A gloo group for the per-step flag: no GPU synchronization in NCCL jobs."""
    global _group
    if _group is None:
        _group = (dist.group.WORLD if dist.get_backend() == "gloo"
                  else dist.new_group(backend="gloo"))
    return _group


def _any_rank(flag: bool) -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group())
    return bool(t.item())


def exit_point() -> None:
    """Collective: if any rank got SIGTERM, save all states and exit with ``EXIT_CODE``.

    Does nothing without a checkpoint directory (SIGTERM then keeps its default effect).
    The first call installs the SIGTERM handler. Every rank must call it at the same points.
    """
    from stratagem.adapt.rescale import rescale_point
    from stratagem.adapt.state import checkpoint_root, save_all_states

    if _holds:
        return
    rescale_point()  # in-process elastic jobs: workers join and leave here
    if checkpoint_root() is None:
        return
    install_signal_handler()
    if not _any_rank(_requested):
        return
    path = save_all_states()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        print(f"stratagem: stop requested (SIGTERM): job state saved to {path}; exiting",
              file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)
