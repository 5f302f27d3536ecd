"""Stratagem's own messages through the stdlib ``logging`` module (logger ``stratagem``),
at the level of ``STRATAGEM_LOG_LEVEL`` (``stratagem run -q``/``-v``), and the per-rank log
files of ``stratagem run --log-dir``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import IO, Any

from stratagem import env

LOGGER = "stratagem"


class _ConsoleHandler(logging.Handler):
    """``stratagem: message`` on the *current* ``sys.stdout`` (warnings and errors on
    ``sys.stderr``), so redirected or captured streams receive it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(f"stratagem: {self.format(record)}\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)


def logger() -> logging.Logger:
    """The ``stratagem`` logger, given its console handler on first use; its level is
    re-read from the environment on every call (a launcher or test may change it)."""
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        log.addHandler(_ConsoleHandler())
        log.propagate = False
    log.setLevel(env.log_level())
    return log


class Tee:
    """A text stream writing to a console stream and a file (rank 0 under ``--log-dir``)."""

    def __init__(self, console: IO[str], file: IO[str]) -> None:
        self.console, self.file = console, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.console.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.console.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.console, name)


def redirect_to_log_dir(rank: int, directory: Path) -> tuple[Path, Path]:
    """Send this process's stdout and stderr to ``directory/rank<R>.{stdout,stderr}.log``.

    Rank 0 keeps writing to the console too (Python-level writes); every other rank writes
    only to its files, at the file-descriptor level, so native output lands there as well.
    Returns the two paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = (directory / f"rank{rank}.stdout.log", directory / f"rank{rank}.stderr.log")
    files = [open(p, "a", encoding="utf-8", buffering=1) for p in paths]  # noqa: SIM115
    if rank == 0:
        sys.stdout = Tee(sys.stdout, files[0])  # type: ignore[assignment]
        sys.stderr = Tee(sys.stderr, files[1])  # type: ignore[assignment]
    else:
        for stream, file, fd in ((sys.stdout, files[0], 1), (sys.stderr, files[1], 2)):
            stream.flush()
            os.dup2(file.fileno(), fd)
    return paths
