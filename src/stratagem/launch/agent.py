"""Node agent: ``python -m stratagem.launch.agent [--watch-stdin] -- TORCHRUN_ARGS...``.

Runs on every node (started by the launcher, directly or through the remote shell) and is
torchrun itself, run in-process, plus:

1. agent-side environment set-up (:func:`stratagem.launch.env.apply_node_env`);
2. ``TORCHELASTIC_ERROR_FILE`` and ``--log-dir`` in a private temporary directory, so torch
   elastic leaves the workers' error files there;
3. with ``--watch-stdin``, SIGTERM to itself when stdin reaches end-of-file (the launcher, or
   the ssh connection, went away); torchrun then stops its workers;
   a stop signals each training process alone (torch elastic signals the worker's whole
   process group, which also killed its DataLoader's worker processes before the training
   process could save), and waits the stop grace (:mod:`stratagem.launch.grace`) for the
   save in flight and the stop save before SIGKILL;
4. as a child subreaper, kills whatever torchrun leaves behind (torch elastic starts each
   worker in its own session, so a worker that outlives its shutdown would be orphaned);
5. torch elastic's own log lines go to Stratagem's logger at DEBUG (shown with
   ``stratagem run -v``), so a failure reads as the launcher's one summary;
6. on failure, prints each worker error file as one ``FAILURE_MARKER`` line on stderr for
   the launcher's summary (the launcher may not share a file system with this node). With
   ``--failure-key-stdin`` the first line of stdin is a secret key from the launcher, read
   before any worker starts and put on every record line: workers never see it (it is in
   no environment, argv or file), so nothing a training script prints can pass for a
   failure record. Without a key, no records are printed.

Which workers were the cause: a worker killed by a signal that torchrun did not send (the
OOM killer's or a user's SIGKILL, a SIGSEGV) is recorded as ``kind: signal``; workers that
torchrun itself stopped after the first failure (it logs each pid it signals) as
``kind: stopped``, so the launcher never blames them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Collection
from typing import Any

from stratagem import env
from stratagem.launch import grace
from stratagem.launch.env import ENV_JOB_ID, apply_node_env

FAILURE_MARKER = "@@stratagem-failure@@ "
KEY_MAX_BYTES = 256
TORCH_PCONTEXT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
# torch elastic's loggers (each module's, below these) and torchrun's own
TORCH_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run",
                         "torch.distributed.launcher")
SHUTDOWN_TIMEOUT_S = "3"  # torch elastic, after a failure: SIGTERM -> SIGKILL for the rest
PR_SET_CHILD_SUBREAPER = 36


class _Stopped(BaseException):
    """A stop signal arrived before torchrun installed its own handlers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def children(ppid: int) -> list[int]:
    """Pids of the direct children of ``ppid`` (from /proc; empty where there is no /proc)."""
    kids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fp:
                stat = fp.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == ppid:
            kids.append(int(entry))
    return kids


def kill_leftovers(timeout: float = 3.0) -> int:
    """SIGKILL every remaining child (and its process group) and reap it; returns the count."""
    killed = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = children(os.getpid())
        if not kids:
            break
        for pid in kids:
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                killed += 1
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        time.sleep(0.02)
    return killed


def read_failures(workdir: str) -> list[dict[str, Any]]:
    """Failure records from the worker error files (and torchrun's own) under ``workdir``."""
    paths = sorted(glob.glob(os.path.join(workdir, "logs", "**", "error.json"), recursive=True))
    paths.append(os.path.join(workdir, "agent-error.json"))
    out: list[dict[str, Any]] = []
    seen = set()
    for path in paths:
        try:
            with open(path) as fp:
                data = json.load(fp)
            msg = data["message"]
            extra = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
            ours = extra.get("stratagem", {})
            record = {
                "kind": "exception",
                "message": msg.get("message", "") if isinstance(msg, dict) else str(msg),
                "traceback": extra.get("py_callstack", ""),
                "time": float(ours.get("time") or extra.get("timestamp") or 0),
                "rank": ours.get("rank"),
                "local_rank": ours.get("local_rank"),
                "node": ours.get("node") or env.node_address(),
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        key = (record["message"], record["traceback"])
        if key not in seen:  # torchrun's file repeats its root-cause worker's
            seen.add(key)
            out.append(record)
    return out


class StoppedPids(logging.Handler):
    """Collects the pids torch elastic signals while closing its workers (it logs "Sending
    process PID closing signal SIG" and, on escalation, "Unable to shutdown process PID
    ..."): their deaths are consequences of the first failure, never its cause."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.pids: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith(("Sending process", "Unable to shutdown process")) and record.args:
            with contextlib.suppress(TypeError, ValueError, IndexError, KeyError):
                self.pids.add(int(record.args[0]))  # type: ignore[index]

    def install(self) -> StoppedPids:
        logger = logging.getLogger(TORCH_PCONTEXT_LOGGER)
        if logger.getEffectiveLevel() > logging.WARNING:
            logger.setLevel(logging.WARNING)  # the messages above are warnings
        logger.addHandler(self)
        return self


class ToStratagemDebug(logging.Handler):
    """Re-emits torch elastic's log records on Stratagem's logger at DEBUG.

    torch elastic logs every step of a failure in its own format (each signal it sends,
    the escalation to SIGKILL, each failed worker's exit code); the launcher prints one
    summary per failure instead, so these lines are kept for ``stratagem run -v``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from stratagem.observe import logger

            log = logger()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("torch elastic: %s", record.getMessage())
        except Exception:  # noqa: BLE001 - logging must never break the agent
            self.handleError(record)


def route_torch_elastic_logs() -> None:
    """Send torch elastic's and torchrun's loggers to :class:`ToStratagemDebug` instead of
    torch's console handler (records still reach handlers on the loggers themselves, such
    as :class:`StoppedPids`). Idempotent."""
    for name in TORCH_ELASTIC_LOGGERS:
        log = logging.getLogger(name)
        log.propagate = False
        if not any(isinstance(h, ToStratagemDebug) for h in log.handlers):
            log.addHandler(ToStratagemDebug())


def untraced_failures(exc: Any, stopped: Collection[int] = ()) -> list[dict[str, Any]]:
    """Records for the workers of a ChildFailedError that left no error file: killed by a
    signal (segfault, OOM killer, ``kill -9``), stopped by torchrun itself (pid in
    ``stopped``), or exited without a Python exception."""
    out = []
    for rank, failure in exc.failures.items():
        if failure.error_file and os.path.isfile(failure.error_file):
            continue
        sig = failure.signal_name() if failure.exitcode < 0 else None
        kind = "stopped" if failure.pid in stopped else "signal" if sig else "exit"
        out.append({
            "kind": kind,
            "signal": sig,
            "message": (f"stopped by torchrun ({sig or failure.exitcode})" if kind == "stopped"
                        else f"killed by {sig}" if sig
                        else f"exited with code {failure.exitcode}"),
            "traceback": "",
            "time": float(failure.timestamp),
            "rank": str(rank),
            "local_rank": str(failure.local_rank),
            "node": env.node_address(),
        })
    return out


def _set_subreaper() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _watch_stdin() -> None:
    """On end-of-file: SIGTERM ourselves; if torchrun has not finished within the stop
    grace (plus its teardown), kill the workers and exit."""
    with contextlib.suppress(OSError):  # raw fd: no buffered-reader lock at shutdown
        while os.read(0, 4096):
            pass
    wait = grace.stop_grace_s(env.checkpoint_dir()) + grace.AGENT_MARGIN_S / 2
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(wait)
    kill_leftovers()
    os._exit(128 + signal.SIGTERM)


def read_key(fd: int = 0) -> str:
    """The launcher's record key: stdin's first line, read byte by byte so nothing after it
    is consumed ("" at end-of-file or when the line is not a short printable token)."""
    data = b""
    with contextlib.suppress(OSError):
        while len(data) <= KEY_MAX_BYTES:
            byte = os.read(fd, 1)
            if byte in (b"", b"\n"):
                break
            data += byte
    key = data.decode("ascii", "replace").strip()
    return key if key.isalnum() and len(key) <= KEY_MAX_BYTES else ""


def bound_failure_shutdown(seconds: int) -> None:
    """Make torch elastic stop the rest of a failed worker group within ``seconds``
    (SIGTERM, then SIGKILL), as it does on a stop signal.

    torch 2.13's process context, on seeing a worker fail, closes the others with
    ``close()``'s 30 s default, not the agent's ``--shutdown-timeout``: a survivor that does
    not end on SIGTERM (frozen, or blocked in a collective with the dead peer) held the job
    for 30 s after every failure. Callers that pass a timeout keep it. Idempotent."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.close
    original = getattr(original, "_stratagem_original", original)

    def close(self: Any, death_sig: Any = None, timeout: float | None = None) -> None:
        original(self, death_sig, seconds if timeout is None else timeout)

    close._stratagem_original = original  # type: ignore[attr-defined]
    PContext.close = close  # type: ignore[method-assign]


def give_stops_the_grace() -> None:
    """Make torch elastic's agent wait the stop grace (:func:`stratagem.launch.grace.stop_grace_s`,
    decided when the stop arrives) between SIGTERM and SIGKILL when it stops its workers:
    they finish the save in flight and write the stop save. torch passes its fixed
    ``--shutdown-timeout`` instead, which cut saves short. Idempotent."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._shutdown
    original = getattr(original, "_stratagem_original", original)

    def shutdown(self: Any, death_sig: Any = signal.SIGTERM, timeout: Any = 30) -> None:
        original(self, death_sig, grace.stop_grace_s(env.checkpoint_dir()))

    shutdown._stratagem_original = original  # type: ignore[attr-defined]
    LocalElasticAgent._shutdown = shutdown  # type: ignore[method-assign]


def signal_training_process_only() -> None:
    """Make torch elastic send a stop signal (SIGTERM, SIGINT, ...) to each training process
    alone; SIGKILL still goes to its whole process group.

    torch elastic starts each worker in a session of its own and signals the session's
    process group, so a stop also reached the worker's DataLoader worker processes, which
    died at once; the training process then failed ("DataLoader worker ... is killed by
    signal") before it reached the step boundary where it saves. Signalled alone, it saves
    and exits, and its loader's workers end with it (or with the agent's sweep of
    leftovers). Idempotent."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handlers,
    )

    cls = handlers.SubprocessHandler
    original = cls.close
    original = getattr(original, "_stratagem_original", original)

    def close(self: Any, death_sig: Any = None) -> None:
        if death_sig is None or death_sig == signal.SIGKILL or os.name != "posix":
            original(self, death_sig)
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(death_sig)
        for stream in (self._stdout, self._stderr):
            if stream:
                stream.close()

    close._stratagem_original = original  # type: ignore[attr-defined]
    cls.close = close  # type: ignore[method-assign]


def tolerate_torn_error_files() -> None:
    """Make torch elastic take a worker error file it cannot parse as no file at all.

    After a failure torch stops the other workers and reads their error files again; a
    worker stopped while writing its file (ours, or torch's own ``@record``) leaves it empty
    or cut short, and torch 2.13 re-raises the JSON error, ending the agent with a traceback
    instead of the failure records. Such a worker is reported like one killed by a signal
    (:func:`untraced_failures`). Idempotent."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    original = ProcessFailure.__post_init__
    original = getattr(original, "_stratagem_original", original)

    def post_init(self: Any) -> None:
        if self.error_file and os.path.isfile(self.error_file):
            try:
                with open(self.error_file) as fp:
                    json.load(fp)
            except (OSError, ValueError):  # read before torch, which would log and raise
                self.error_file = ""  # then torch's own message for a signal or exit code
        original(self)

    post_init._stratagem_original = original  # type: ignore[attr-defined]
    ProcessFailure.__post_init__ = post_init  # type: ignore[method-assign]


def _shutdown_timeout() -> int:
    """torch elastic's SIGTERM-to-SIGKILL grace for this agent's workers: a user's
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` when it is a whole number of seconds, else ours (a
    bad value is replaced, with a warning: torch would stop on it with a bare ValueError)."""
    name = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    value = os.environ.get(name, SHUTDOWN_TIMEOUT_S)
    if value.strip().isdigit():
        return int(value)
    print(f"stratagem: warning: {name}={value!r} is not a whole number of seconds; using "
          f"{SHUTDOWN_TIMEOUT_S}", file=sys.stderr, flush=True)
    os.environ[name] = SHUTDOWN_TIMEOUT_S
    return int(SHUTDOWN_TIMEOUT_S)


def _run_torchrun(args: list[str], untraced: list[dict[str, Any]], summary: bool = True
                  ) -> int:
    """torch.distributed.run's main in this process; its exit status. Failed workers without
    an error file are appended to ``untraced``. ``summary``: print torch elastic's
    root-cause table (not when the launcher prints its own summary from our records)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    route_torch_elastic_logs()
    stopped = StoppedPids().install()
    bound_failure_shutdown(_shutdown_timeout())
    give_stops_the_grace()
    signal_training_process_only()
    tolerate_torn_error_files()
    try:
        torchrun_main(args)
        return 0
    except ChildFailedError as exc:  # torchrun has logged it
        if summary:  # its root-cause table; the launcher otherwise shows the traceback once
            print(exc.format_msg(), file=sys.stderr, flush=True)
        untraced += untraced_failures(exc, stopped.pids)
        return 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except _Stopped as exc:
        return 128 + exc.signum
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:  # noqa: BLE001 - rendezvous errors and the like: show, then fail
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stratagem.launch.agent", allow_abbrev=False)
    parser.add_argument("--watch-stdin", action="store_true",
                        help="stop the job when stdin reaches end-of-file")
    parser.add_argument("--failure-key-stdin", action="store_true",
                        help="read the launcher's failure-record key from stdin's first line")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="-- torchrun arguments")
    args = parser.parse_args(argv)
    torchrun = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    workdir = tempfile.mkdtemp(prefix=f"stratagem-{os.environ.get(ENV_JOB_ID, 'job')}-")
    code = 1
    untraced: list[dict[str, Any]] = []
    # Before any worker exists; not from a terminal (a --dry-run line run by hand).
    key = read_key() if args.failure_key_stdin and not os.isatty(0) else ""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stop)  # until torchrun installs its own
        apply_node_env()
        os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(workdir, "agent-error.json")
        _set_subreaper()
        if args.watch_stdin:
            threading.Thread(target=_watch_stdin, daemon=True).start()
        code = _run_torchrun(["--log-dir", os.path.join(workdir, "logs"), *torchrun], untraced,
                             summary=not key)
    except _Stopped as exc:
        code = 128 + exc.signum
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # finish the clean-up below
        kill_leftovers()
        if code != 0 and key:
            for record in read_failures(workdir) + untraced:
                print(f"{FAILURE_MARKER}{key} {json.dumps(record)}", file=sys.stderr,
                      flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def exit_now(code: int) -> None:
    """Flush and end the process without the interpreter's teardown: with torch loaded that
    takes about a second, and :func:`main` has already stopped the workers, printed the
    records and removed its directory (the launcher waits for this exit)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
