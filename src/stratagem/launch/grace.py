"""How long a stop waits for the workers' saves, and what it left in the checkpoint directory.

A stop (SIGTERM or Ctrl-C to ``stratagem run``, or SIGTERM to a node agent) asks every worker
to save the job state at its next step boundary and exit. A worker that is writing a
periodic checkpoint when the stop arrives first finishes that write, then writes the stop
save. The grace is how long the launcher and the agents let that take before they kill the
workers: ``--stop-grace`` / ``STRATAGEM_STOP_GRACE_S`` when set, else torch elastic's own
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` when the user set it, else twice the job's last measured
save (``save_seconds`` in the newest checkpoint's ``meta.json``) plus :data:`MARGIN_S`, and
at least :data:`DEFAULT_S` (torch elastic's default). A worker that exits sooner ends the
wait sooner: the grace only bounds a stop that would otherwise hang.

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from stratagem import env

DEFAULT_S = 30.0  # the least grace (torch elastic's default shutdown timeout)
MARGIN_S = 10.0  # on top of the saves: the step in progress, start-up of the save
AGENT_MARGIN_S = 5.0  # the launcher waits this much longer than the agents (their teardown)
META_MAX_BYTES = 1 << 20
TORCH_SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_CKPT = re.compile(r"ckpt-(\d+)")
_UNFINISHED = re.compile(r"ckpt-\d+\.tmp(-\d+)?")


def newest_checkpoint(root: str | os.PathLike[str] | None) -> Path | None:
    """The newest complete ``ckpt-N`` directory under ``root`` (None if none, or unreadable)."""
    if not root:
        return None
    try:
        found = [(int(m.group(1)), p) for p in Path(root).iterdir()
                 if (m := _CKPT.fullmatch(p.name)) and p.is_dir()]
    except OSError:
        return None
    return max(found)[1] if found else None


def last_save_seconds(root: str | os.PathLike[str] | None) -> float | None:
    """How long the newest checkpoint under ``root`` took to write (its ``meta.json``
    ``save_seconds``); None when unknown."""
    newest = newest_checkpoint(root)
    if newest is None:
        return None
    try:
        with open(newest / "meta.json", "rb") as fp:
            meta = json.loads(fp.read(META_MAX_BYTES))
        value = float(meta["save_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if 0 <= value < env.MAX_STOP_GRACE_S else None


def stop_grace_s(root: str | os.PathLike[str] | None,
                 explicit: float | None = None) -> float:
    """The grace of a stop now (see the module doc); ``explicit``: ``--stop-grace``."""
    if explicit is None:
        explicit = env.stop_grace()
    if explicit is not None:
        return explicit
    with contextlib.suppress(ValueError):
        torch_value = float(os.environ.get(TORCH_SHUTDOWN, ""))
        if 0 < torch_value <= env.MAX_STOP_GRACE_S:
            return torch_value
    last = last_save_seconds(root)
    return max(DEFAULT_S, 2 * last + MARGIN_S) if last is not None else DEFAULT_S


def remove_unfinished(root: str | os.PathLike[str] | None) -> list[str]:
    """Delete the temporary directories of checkpoint writes that were killed (call it only
    when no process of the job is left); returns their names."""
    if not root:
        return []
    try:
        entries = [p for p in Path(root).iterdir() if _UNFINISHED.fullmatch(p.name)]
    except OSError:
        return []
    for p in entries:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in entries]
