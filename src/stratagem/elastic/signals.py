"""SIGTERM handling: note the signal, act on it at the next step boundary.

torch elastic (``torchrun``), Kubernetes and most schedulers stop a worker with SIGTERM and
kill it a grace period later (``torchrun --shutdown-timeout``, default 30 s). While a
checkpoint directory is configured, Stratagem's handler only notes the signal in the job
context; the next step boundary (:func:`stratagem.elastic.boundary.exit_point`) agrees
across ranks whether any rank was signalled and, if so, saves the job state and exits with
:data:`EXIT_CODE`. The signal never interrupts a step, so none of its state is lost.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from stratagem.elastic.context import current_job

EXIT_CODE = 143  # 128 + SIGTERM, what a process killed by SIGTERM reports


def _on_signal(signum: int, frame: FrameType | None) -> None:
    current_job().exit_requested = True


def install_signal_handler() -> bool:
    """Catch SIGTERM (idempotent). Returns False off the main thread, where Python cannot."""
    ctx = current_job()
    if ctx.signal_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    ctx.previous_signal_handler = signal.signal(signal.SIGTERM, _on_signal)
    ctx.signal_installed = True
    return True


def uninstall_signal_handler() -> None:
    """Restore the previous SIGTERM handler; re-deliver a SIGTERM that is still pending."""
    ctx = current_job()
    if not ctx.signal_installed:
        return
    previous = ctx.previous_signal_handler
    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    ctx.signal_installed = False
    if ctx.exit_requested:
        os.kill(os.getpid(), signal.SIGTERM)


def exit_requested() -> bool:
    """Whether this process received SIGTERM (local; see ``exit_point``)."""
    return current_job().exit_requested


def request_exit() -> None:
    """Act as if SIGTERM arrived: stop at the next exit point."""
    current_job().exit_requested = True
