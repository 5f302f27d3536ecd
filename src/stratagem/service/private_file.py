"""Files only the cluster's owner may read: tokens, the service address, the job database.

A secret is written to a new temporary file in the same directory, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (so an existing file, or a symbolic link
planted at its name, is never written through, and no other user can open it in between),
then renamed over the target: the target is replaced, never followed, and never keeps an
older, wider mode.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from stratagem.errors import StratagemError

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def write_private(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (mode 0600), through a temporary file and a rename."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def create_private(path: str | Path) -> None:
    """Make sure ``path`` exists as a regular file of mode 0600 (created empty with
    ``O_EXCL | O_NOFOLLOW`` when missing; an existing one is narrowed to 0600). A symbolic
    link or anything else than a regular file there is refused."""
    path = Path(path)
    try:
        os.close(os.open(path, _FLAGS, 0o600))
        return
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise StratagemError("not a regular file (a symbolic link?)", where=str(path),
                             fix="remove it: the cluster service creates this file itself")
    if info.st_mode & 0o077:
        os.chmod(path, 0o600)


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and parents) if needed and make it mode 0700: the cluster directory
    holds the job database, logs and the control plane's token."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.stat(path)
    if info.st_mode & 0o077 and info.st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path
