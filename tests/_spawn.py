"""Multiprocess test runs, shared by rt_common, ps_common and integration_workers.

:func:`run` starts ``world`` processes (torch.multiprocessing, start method ``spawn``; gloo
rendezvous on 127.0.0.1 at a free port). Each calls ``fn(rank, *setup.args, **kwargs)`` and
saves its return value, or the traceback of what it raised, with ``torch.save`` to
``out/rank<r>.pt``; the parent loads them and fails on a recorded traceback. The helpers'
``spawn`` functions differ only in their :class:`Setup`.

Importable as ``_spawn`` where tests/ is on ``sys.path``: under pytest (tests/conftest.py) and
in the processes spawned from there; a script run on its own puts tests/ there itself.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Setup:
    """How each spawned process is prepared before ``fn`` runs (picklable: it travels)."""

    args: tuple[Any, ...] = ()
    """Positional arguments after the rank: ``(world,)``, or ``(workers, servers)``."""
    roles: tuple[str, ...] = ()
    """``STRATAGEM_ROLE`` by rank; empty: not set."""
    local_rank: bool = False
    """Set ``LOCAL_RANK`` to the rank (all processes on one node)."""
    unset: tuple[str, ...] = ()
    """Variables removed from the inherited environment (a surrounding launcher's)."""
    init_group: bool = False
    """Join the default gloo group (60 s timeout) before ``fn``; else ``fn`` joins its own
    way (AutoDist, join_cluster) or not at all."""
    catch: type[BaseException] = Exception
    """What ``fn`` raising is recorded as the rank's result; anything else ends the process
    without one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave(hard: bool = True) -> None:
    """End a spawned process whose results are already saved.

    ``hard`` (the default): flush stdout/stderr and ``os._exit(0)``, without atexit handlers
    or C++ static destructors: torch 2.13's gloo teardown aborts about one successful exit in
    fifteen (see stratagem.launch.worker). ``hard=False``: ``sys.exit(0)``, an ordinary
    interpreter exit, atexit handlers included, as a user's script run by a launcher ends
    (ps_common.run_script: dedicated servers leave ``distribute`` through ``sys.exit``).
    """
    if not hard:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The processes fork from one server process per test session that imported torch (and
# torch._dynamo, which torch imports at the first optimizer a process builds) once: a
# spawned process imported both again, seconds of CPU each. Each one takes on what a
# spawned one inherits from the test at its start (_Inherit): environment, working
# directory, stdout and stderr (so pytest shows its output under the test that ran it).
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch._dynamo"]


class _Inherit:
    """Pickled for each process as it starts: the test's environment, working directory
    and its fd 1 and 2 of the moment (passed along with the fork request)."""

    def __init__(self) -> None:
        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.fds: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return _Inherit._rebuild, (self.environ, self.cwd,
                                   (reduction.DupFd(1), reduction.DupFd(2)))

    @staticmethod
    def _rebuild(environ: dict[str, str], cwd: str, fds: tuple[Any, ...]) -> _Inherit:
        inherit = _Inherit.__new__(_Inherit)
        inherit.environ, inherit.cwd, inherit.fds = environ, cwd, fds
        return inherit

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for dup, fd in zip(self.fds, (1, 2), strict=True):
            got = dup.detach()
            os.dup2(got, fd)
            os.close(got)


def start_method() -> str:
    """How the tests start processes (the forkserver preloads torch)."""
    mp.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    return START_METHOD


def _entry(rank: int, world: int, port: int, fn: Callable, kwargs: dict, out: str,
           setup: Setup, inherit: _Inherit | None = None) -> None:
    if inherit is not None:
        inherit.apply()
    for var in setup.unset:
        os.environ.pop(var, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    if setup.local_rank:
        os.environ["LOCAL_RANK"] = str(rank)
    if setup.roles:
        os.environ["STRATAGEM_ROLE"] = setup.roles[rank]
    torch.set_num_threads(1)
    if setup.init_group:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    try:
        result = fn(rank, *setup.args, **kwargs)
    except setup.catch:
        result = {"__error__": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    leave()


def start(fn: Callable, world: int, out: Path, kwargs: dict[str, Any], setup: Setup,
          join: bool = True) -> mp.ProcessContext | None:
    """Start the ``world`` processes; with ``join``, wait for them (an exit other than 0
    raises), else return their context."""
    out.mkdir(parents=True, exist_ok=True)
    method = start_method()
    inherit = _Inherit() if method == "forkserver" else None
    return mp.start_processes(_entry, args=(world, free_port(), fn, kwargs, str(out), setup,
                                            inherit),
                              nprocs=world, start_method=method, join=join)


def load(out: Path, world: int, missing_ok: bool = False) -> list[Any]:
    """The ranks' saved results; with ``missing_ok``, ``None`` for a rank that saved none."""
    return [torch.load(out / f"rank{r}.pt", weights_only=False)
            if not missing_ok or (out / f"rank{r}.pt").exists() else None
            for r in range(world)]


def run(fn: Callable, world: int, out: Path, kwargs: dict[str, Any], setup: Setup
        ) -> list[Any]:
    """Run ``fn`` in ``world`` processes; their return values (a raised one fails here)."""
    start(fn, world, out, kwargs, setup)
    results = load(out, world)
    for r, res in enumerate(results):
        if isinstance(res, dict) and "__error__" in res:
            raise AssertionError(f"rank {r} failed:\n{res['__error__']}")
    return results
