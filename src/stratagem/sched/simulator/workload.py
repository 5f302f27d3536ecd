"""Workload traces: ``name,time,application,num_replicas,batch_size`` per job.

Traces come from other people's tools: they are read within bounds (:data:`MAX_CSV_BYTES`
per file, :data:`MAX_JOBS` jobs, fields of at most :data:`MAX_FIELD` characters, UTF-8) and
every value is checked, so a damaged or hostile file is one readable error.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from stratagem.errors import StratagemError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")
MAX_CSV_BYTES = 16 << 20  # a workload or profile CSV (the Pollux traces are < 100 kB)
MAX_JOBS = 100_000  # jobs in one workload
MAX_FIELD = 4096  # characters in one CSV field
MAX_REPLICAS = 65_536  # replicas (GPUs) one job may ask for
MAX_BATCH = 1 << 24  # samples in one job's batch
MAX_SUBMIT_S = 10 * 365 * 86400.0  # a submission time beyond ten years is a damaged file


def read_csv(path: Path, what: str = "file") -> list[dict[str, str]]:
    """The rows of the CSV at ``path`` as dicts, within :data:`MAX_CSV_BYTES`, UTF-8 and
    :data:`MAX_FIELD`; any other file is a StratagemError naming it."""
    try:
        size = path.stat().st_size
        if size > MAX_CSV_BYTES:
            raise StratagemError(f"{what} too large ({size} bytes, at most {MAX_CSV_BYTES})",
                                 where=str(path), fix="split it, or check that it is a CSV")
        with path.open("rb") as f:
            raw = f.read(MAX_CSV_BYTES + 1)
    except OSError as exc:
        raise StratagemError(f"cannot read the {what}: {exc.strerror}", where=str(path),
                             fix="check the path and its permissions") from exc
    if len(raw) > MAX_CSV_BYTES:  # grew while read (a pipe, a file being written)
        raise StratagemError(f"{what} too large (at most {MAX_CSV_BYTES} bytes)",
                             where=str(path), fix="split it, or check that it is a CSV")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise StratagemError(f"{what} is not UTF-8 text (byte {exc.start})", where=str(path),
                             fix="save it as UTF-8 CSV") from None
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(reader)
    except csv.Error as exc:
        raise StratagemError(f"{what} is not a valid CSV: {exc}", where=str(path),
                             fix="save it as comma-separated values") from None
    for i, row in enumerate(rows, start=2):
        if None in row or any(v is None or len(v) > MAX_FIELD for v in row.values()):
            raise StratagemError(f"line {i}: a field longer than {MAX_FIELD} characters, or "
                                 "not as many fields as the header", where=str(path),
                                 fix="one value per header column on every line")
    return rows


@dataclass(frozen=True)
class JobSpec:
    """One submitted job: when, which application, and what the submitter asked for."""

    name: str
    submit_time: float
    application: str
    num_replicas: int
    batch_size: int


def load_workload(path: str | Path) -> list[JobSpec]:
    """Jobs of a workload CSV, in submission order (ties by name)."""
    p = Path(path)
    rows = read_csv(p, "workload")
    missing = set(COLUMNS) - set(rows[0]) if rows else set()
    if missing:
        raise StratagemError(f"missing columns {sorted(missing)}", where=str(p),
                             fix=f"a header with {','.join(COLUMNS)}")
    if len(rows) > MAX_JOBS:
        raise StratagemError(f"{len(rows)} jobs, at most {MAX_JOBS}", where=str(p),
                             fix="split the workload into several files")
    jobs, seen = [], set()
    for i, row in enumerate(rows, start=2):
        try:
            job = JobSpec(row["name"], float(row["time"]), row["application"],
                          int(row["num_replicas"]), int(row["batch_size"]))
        except (TypeError, ValueError) as exc:
            raise StratagemError(f"line {i}: {str(exc)[:200]}", where=str(p),
                                 fix="time a number; num_replicas, batch_size integers") from exc
        if not (math.isfinite(job.submit_time) and 0 <= job.submit_time <= MAX_SUBMIT_S
                and 1 <= job.num_replicas <= MAX_REPLICAS and 1 <= job.batch_size <= MAX_BATCH
                and job.name):
            raise StratagemError(f"line {i}: needs a name, time from 0 to {MAX_SUBMIT_S:.0f} "
                                 f"s, num_replicas from 1 to {MAX_REPLICAS} and batch_size from "
                                 f"1 to {MAX_BATCH}", where=str(p))
        if job.name in seen:
            raise StratagemError(f"line {i}: job name {job.name!r} repeats", where=str(p))
        seen.add(job.name)
        jobs.append(job)
    if not jobs:
        raise StratagemError("the workload has no jobs", where=str(p))
    return sorted(jobs, key=lambda j: (j.submit_time, j.name))


def workload_files(path: str | Path) -> list[Path]:
    """A CSV file, or every ``*.csv`` in a directory (sorted)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.csv"))
        if not files:
            raise StratagemError("no *.csv workloads in the directory", where=str(p))
        return files
    if not p.is_file():
        raise StratagemError("workload not found", where=str(p),
                             fix="a workload CSV or a directory of them")
    return [p]
