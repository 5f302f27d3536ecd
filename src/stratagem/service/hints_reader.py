"""What the scheduler reads from a running job: its hints document (``hints.json``).

Adaptive jobs publish it in their checkpoint directory (``docs/reference/hints.md``). The
file is untrusted input (whoever runs the job writes it): it is read within bounds (at most
:data:`MAX_HINTS_BYTES`, a regular file only, through :mod:`stratagem.safeload`) and checked
against the schema of the fields the scheduler uses. A missing file means "nothing known
yet"; an unusable one gives empty hints with :attr:`JobHints.problem` saying why, so that
the scheduler can mark that job and go on with the others.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.adapt import GoodputFunction, ThroughputParams
from stratagem.adapt.noise_scale import GNSEstimate
from stratagem.errors import StratagemError
from stratagem.safeload import load_json

MAX_HINTS_BYTES = 1 << 20  # a document is a few KiB; its profile list grows slowly
HINTS_FILE = "hints.json"
_THROUGHPUT_KEYS = ("alpha_c", "beta_c", "alpha_r", "beta_r", "alpha_n", "beta_n", "gamma")


class HintsError(StratagemError):
    """A job's hints document is unreadable or does not follow the schema."""


@dataclass(frozen=True)
class JobHints:
    """The parts of a hints document the scheduler and ``stratagem ls`` use; ``problem``:
    why the document was not usable (None when it was, or when there is none yet)."""

    goodput: GoodputFunction | None = None
    max_batch_size: int | None = None
    local_bsz_bounds: tuple[int | None, int | None] = (None, None)
    gradient_accumulation: bool = True
    global_bsz: int | None = None
    goodput_now: float | None = None
    progress: float | None = None
    epoch: int | None = None
    problem: str | None = None


def _bad(field: str, want: str, value: Any) -> HintsError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return HintsError(f"field '{field}' must be {want}, got {shown}", where=HINTS_FILE,
                      fix="the job's Stratagem writes this file; is another program "
                      "writing it? (schema: docs/reference/hints.md)")


def _section(doc: Mapping[str, Any], key: str, prefix: str = "") -> Mapping[str, Any]:
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(prefix + key, "an object or null", value)
    return value


def _number(doc: Mapping[str, Any], key: str, prefix: str = "", required: bool = False,
            low: float | None = None) -> float | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or (low is not None and value < low):
        want = "a finite number" + (f" >= {low:g}" if low is not None else "")
        raise _bad(prefix + key, want + ("" if required else " or null"), value)
    return float(value)


def _count(doc: Mapping[str, Any], key: str, prefix: str = "",
           required: bool = False) -> int | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(prefix + key, "a whole number >= 0" + ("" if required else " or null"),
                   value)
    return value


def parse_hints(doc: Any) -> JobHints:
    """:class:`JobHints` from a hints document (schema version 1); :class:`HintsError` when
    a field the scheduler uses has the wrong shape."""
    if not isinstance(doc, Mapping):
        raise _bad("(document)", "a JSON object", doc)
    if doc.get("version") != 1:
        raise _bad("version", "1", doc.get("version"))
    batch = _section(doc, "batch")
    bounds = batch.get("local_bsz_bounds")
    if bounds is None:
        bounds = (None, None)
    elif not (isinstance(bounds, list) and len(bounds) == 2 and all(
            b is None or (isinstance(b, int) and not isinstance(b, bool) and b > 0)
            for b in bounds)):
        raise _bad("batch.local_bsz_bounds", "two whole numbers > 0 (or nulls)", bounds)
    accumulation = batch.get("gradient_accumulation", True)
    if not isinstance(accumulation, bool):
        raise _bad("batch.gradient_accumulation", "true or false", accumulation)
    current = _section(batch, "current", "batch.")
    good = _section(doc, "goodput")
    progress = _section(doc, "progress")
    params, gradient = _section(doc, "throughput_params"), _section(doc, "gradient")
    fn = None
    if params and gradient:
        base = _count(batch, "base_batch_size", "batch.", required=True)
        if not base:
            raise _bad("batch.base_batch_size", "a whole number > 0", base)
        tp = ThroughputParams(**{k: _number(params, k, "throughput_params.", True, 0.0)
                                 for k in _THROUGHPUT_KEYS})
        gns = GNSEstimate(_number(gradient, "sqr_norm", "gradient.", True, 0.0),
                          _number(gradient, "var", "gradient.", True, 0.0))
        fn = GoodputFunction(tp, gns, base)
    max_bsz = _count(batch, "max_batch_size", "batch.")
    return JobHints(
        goodput=fn, max_batch_size=max_bsz or None, local_bsz_bounds=(bounds[0], bounds[1]),
        gradient_accumulation=accumulation, global_bsz=_count(current, "global_bsz",
                                                              "batch.current."),
        goodput_now=_number(good, "goodput", "goodput.", low=0.0),
        progress=_number(progress, "progress", "progress.", low=0.0),
        epoch=_count(doc, "epoch"))


def _read_bounded(path: Path) -> bytes | None:
    """The file's bytes (None when there is none); a FIFO, device or huge file is refused
    before anything is read from it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HintsError(f"cannot open: {exc.strerror}", where=str(path),
                         fix="it must be a regular file the scheduler can read") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise HintsError("not a regular file", where=str(path),
                             fix="remove it; the job writes a regular file there")
        if info.st_size > MAX_HINTS_BYTES:
            raise HintsError(f"too large ({info.st_size} bytes, at most {MAX_HINTS_BYTES})",
                             where=str(path), fix="remove it; the job writes a small one")
        return f.read(MAX_HINTS_BYTES + 1)


def read_hints(checkpoint_dir: str | Path) -> JobHints:
    """The job's latest hints; empty ones when there are none yet; empty ones with
    ``problem`` set when the file is unusable (never an exception)."""
    path = Path(checkpoint_dir) / HINTS_FILE
    try:
        data = _read_bounded(path)
        if data is None:
            return JobHints()
        if len(data) > MAX_HINTS_BYTES:
            raise HintsError(f"too large (over {MAX_HINTS_BYTES} bytes)", where=str(path),
                             fix="remove it; the job writes a small one")
        return parse_hints(load_json(data, str(path), HintsError,
                                     fix="the job rewrites it at its next decision"))
    except HintsError as exc:
        return JobHints(problem=f"unusable hints.json: {exc.problem}")
    except OSError as exc:  # e.g. a read error
        return JobHints(problem=f"unusable hints.json: {exc.strerror or exc}")
