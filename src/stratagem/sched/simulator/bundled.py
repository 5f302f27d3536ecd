"""The Pollux profiles and workloads shipped as package data (see ``pollux/README.md``).

``stratagem simulate`` runs out of the box with them: they are the default ``--profiles``, and
a workload given as ``pollux:NAME`` (``pollux:workload-1``) or ``pollux:`` (all eight) is read
from here. The files travel in the wheel (``[tool.setuptools.package-data]``).
"""

from __future__ import annotations

import re
from pathlib import Path

from stratagem.errors import StratagemError

POLLUX_DIR = Path(__file__).resolve().parent / "pollux"
PREFIX = "pollux:"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def pollux_profiles() -> Path:
    """The directory of the six bundled application profiles."""
    return POLLUX_DIR / "profiles"


def pollux_workloads() -> list[str]:
    """Names of the bundled workloads (``workload-1`` ... ``workload-8``)."""
    return sorted(p.stem for p in (POLLUX_DIR / "workloads-realistic").glob("*.csv"))


def resolve_workload(text: str) -> Path:
    """``text`` itself, or for ``pollux:NAME`` the bundled workload CSV (``pollux:`` alone:
    the directory of all of them). A name that is not bundled is an error listing those that
    are."""
    if not text.startswith(PREFIX):
        return Path(text)
    name = text[len(PREFIX):].removesuffix(".csv")
    if not name:
        return POLLUX_DIR / "workloads-realistic"
    known = pollux_workloads()
    if not _NAME.fullmatch(name) or name not in known:
        raise StratagemError(f"no bundled workload {name!r}", where="--workload",
                             fix=f"one of {', '.join(PREFIX + k for k in known)}, "
                                 "or a path to a workload CSV")
    return POLLUX_DIR / "workloads-realistic" / f"{name}.csv"
