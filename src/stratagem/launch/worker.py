"""Worker entry point: ``python -m stratagem.launch.worker SCRIPT ARGS...`` (run by torchrun).

Runs the training script as ``__main__`` (like ``python SCRIPT``). If it raises, writes a torch
elastic error file (``TORCHELASTIC_ERROR_FILE``, same format as ``@record``, plus the rank and a
precise timestamp so the launcher can tell the first failure from its echoes), prints the
traceback without this wrapper's frames and exits 1 (130 on KeyboardInterrupt). The traceback
goes to the console only when no error file could be written: otherwise the launcher's failure
summary shows it, once. stdout and stderr are line-buffered; under ``--log-dir``
(``STRATAGEM_LOG_DIR``) they also go to per-rank files (:func:`redirect_to_log_dir`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from types import TracebackType

from stratagem import env
from stratagem.errors import install_excepthook
from stratagem.observe import redirect_to_log_dir


def error_record(exc: BaseException, tb: TracebackType | None) -> dict:
    """The error-file payload torch elastic reads, with Stratagem's extras."""
    now = time.time()
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(now)),
                "stratagem": {
                    "time": now,
                    "rank": os.environ.get("RANK"),
                    "local_rank": os.environ.get("LOCAL_RANK"),
                    "node": env.node_address(),
                },
            },
        }
    }


def _write_error_file(exc: BaseException, tb: TracebackType | None) -> bool:
    """Whether the error file was written (then the agent or launcher shows the traceback,
    once, and this worker need not print it too)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    partial = f"{path}.{os.getpid()}.partial"
    try:  # whole or absent: torch elastic reads it as soon as it exists
        with open(partial, "w") as fp:
            json.dump(error_record(exc, tb), fp)
        os.replace(partial, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(partial)
        print(f"stratagem: could not write error file {path}: {err}", file=sys.stderr)
        return False
    return True


def _user_frames(tb: TracebackType | None, script: str) -> TracebackType | None:
    """Drop the leading frames of this wrapper and runpy: start at the script's frame."""
    start = tb
    while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != script:
        start = start.tb_next
    return start or tb


def _line_buffered() -> None:
    """One write per line (not per ``print`` piece), so the workers sharing the agent's pipe
    do not interleave within lines."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m stratagem.launch.worker SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    _line_buffered()
    directory = env.log_dir()
    logs = (redirect_to_log_dir(int(os.environ.get("RANK", "0")), directory)
            if directory is not None else None)
    install_excepthook()
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_error_file(exc, _user_frames(exc.__traceback__, script))
            raise
        _exit_cleanly(0)
    except BaseException as exc:  # noqa: BLE001 - reported, then exit 1 like python does
        tb = _user_frames(exc.__traceback__, script)
        if "torch.distributed" in sys.modules:  # a finished peer is not a crashed one
            from stratagem.distributed.process_group import explain_collective_failure

            exc = explain_collective_failure(exc)
        if logs is not None:  # the rank's own log file always gets its traceback
            with open(logs[1], "a", encoding="utf-8") as fh:
                fh.write("".join(traceback.format_exception(type(exc), exc, tb)))
        if not _write_error_file(exc, tb) or isinstance(exc, KeyboardInterrupt):
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 1)
    _exit_cleanly(0)


def _exit_cleanly(code: int) -> None:
    """Run atexit handlers, flush, and leave without C++ static destructors.

    torch's gloo backend (seen with 2.13, plain DDP under plain torchrun too) aborts about one
    successful exit in fifteen while tearing down ("terminate called without an active
    exception"), which would fail a finished job. Everything Python-level has run by then.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
