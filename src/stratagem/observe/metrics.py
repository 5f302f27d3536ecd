"""The run's metrics file: JSON lines, one object per optimizer step (schema in
docs/reference/metrics.md), appended by rank 0 and read by ``stratagem report``."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import IO, Any

from stratagem.errors import StratagemError
from stratagem.observe.side_output import SideOutput

METRICS_FILE = "metrics.jsonl"
MAX_LINE = 1 << 16  # a longer line is not ours: refuse rather than hold it in memory
MAX_RECORDS = 2_000_000  # steps read for a report (about 600 MB of file); more: refused


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, numpy/torch scalars plain numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


class MetricsFile:
    """Appends records to ``directory/metrics.jsonl`` (created on the first write), one
    flushed line each, so a crashed run keeps every step it finished. A full or read-only
    disk stops the file with one warning; training goes on (:mod:`.side_output`)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / METRICS_FILE
        self._fh: IO[str] | None = None
        self.output = SideOutput(f"the metrics file {self.path}")

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(_clean(record), separators=(",", ":")) + "\n"
        if self.output.attempt(lambda: self._append(line)) is None:
            self.close()

    def _append(self, line: str) -> bool:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self._fh.write(line)
        self._fh.flush()
        return True

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # the buffered rest cannot be written either
                fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file (or of ``path/metrics.jsonl`` for a run directory).

    A torn last line (a run killed mid-write) is skipped; any other bad line is an error."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise StratagemError(f"no metrics file at {path}", where=str(path),
                             fix="give the run directory (STRATAGEM_RUN_DIR or the checkpoint "
                                 "directory) of a run that took at least one step")
    records: list[dict[str, Any]] = []
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below; bytes: a bad line is one error
    except OSError as exc:
        raise StratagemError(f"cannot read the metrics file: {exc.strerror}", where=str(path),
                             fix="check its permissions") from None
    with fh:
        number, pending = 0, None  # a bad line is an error unless it is the last (torn) one
        while True:
            raw = fh.readline(MAX_LINE + 1)  # bounded: a line without end is not read whole
            if not raw:
                break
            number += 1
            if pending is not None:
                raise pending
            if not raw.strip():
                continue
            try:
                if len(raw) > MAX_LINE:
                    raise ValueError(f"line longer than {MAX_LINE} bytes")
                record = json.loads(raw.decode("utf-8"))
                if not isinstance(record, dict):
                    raise ValueError("not an object")
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                pending = StratagemError(f"line {number} is not a metrics record "
                                         f"({str(exc)[:120]})", where=str(path),
                                         fix="is this a Stratagem metrics file?")
                continue
            if len(records) >= MAX_RECORDS:
                raise StratagemError(f"more than {MAX_RECORDS} records", where=str(path),
                                     fix="report a part of it: e.g. tail -n 1000000 "
                                         "metrics.jsonl > part/metrics.jsonl")
            records.append(record)
    return records
