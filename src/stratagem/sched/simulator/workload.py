"""Workload traces: ``name,time,application,num_replicas,batch_size`` per job."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from stratagem.errors import StratagemError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


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
    try:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = set(COLUMNS) - set(reader.fieldnames or ())
            if missing:
                raise StratagemError(f"missing columns {sorted(missing)}", where=str(p),
                                     fix=f"a header with {','.join(COLUMNS)}")
            rows = list(reader)
    except OSError as exc:
        raise StratagemError(f"cannot read the workload: {exc.strerror}", where=str(p)) from exc
    jobs, seen = [], set()
    for i, row in enumerate(rows, start=2):
        try:
            job = JobSpec(row["name"], float(row["time"]), row["application"],
                          int(row["num_replicas"]), int(row["batch_size"]))
        except (TypeError, ValueError) as exc:
            raise StratagemError(f"line {i}: {exc}", where=str(p),
                                 fix="time a number; num_replicas, batch_size integers") from exc
        if not math.isfinite(job.submit_time) or job.submit_time < 0 or job.num_replicas < 1 \
                or job.batch_size < 1 or not job.name:
            raise StratagemError(f"line {i}: needs a name, time >= 0, num_replicas >= 1 and "
                                 "batch_size >= 1", where=str(p))
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
