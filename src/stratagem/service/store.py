"""Durable state of the cluster service: one SQLite file in the cluster's working directory.

Tables: ``jobs`` (the spec as JSON, state, counters, timestamps), ``allocations`` (each
applied allocation of a job: replicas, the Ray placement group and worker actor names, so a
restarted scheduler re-attaches instead of restarting) and ``events`` (state changes, for
``stratagem logs`` and post-mortems). Every write is its own transaction; readers in other
processes (the CLI) see committed state only (WAL mode).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.service.jobfile import JobSpec, spec_from_dict
from stratagem.service.private_file import create_private, private_dir

# Job states. ``pending``: waiting for replicas; ``starting``: its replicas are being started
# (placement groups, actors, processes: in the background of the scheduler's loop);
# ``running``; ``backoff``: crashed (or its start failed), retried at ``retry_at``;
# ``stopping``: deletion requested; final: succeeded, failed, deleted.
PENDING, STARTING, RUNNING = "pending", "starting", "running"
BACKOFF, STOPPING = "backoff", "stopping"
SUCCEEDED, FAILED, DELETED = "succeeded", "failed", "deleted"
FINAL = (SUCCEEDED, FAILED, DELETED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  name TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL,
  submitted REAL NOT NULL, started REAL, finished REAL,
  restarts INTEGER NOT NULL DEFAULT 0, failures INTEGER NOT NULL DEFAULT 0,
  retry_at REAL NOT NULL DEFAULT 0, service REAL NOT NULL DEFAULT 0,
  message TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS allocations (
  id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, time REAL NOT NULL,
  replicas TEXT NOT NULL, group_name TEXT, actors TEXT NOT NULL DEFAULT '[]',
  active INTEGER NOT NULL DEFAULT 1);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, time REAL NOT NULL,
  text TEXT NOT NULL);
"""


@dataclass(frozen=True)
class JobRow:
    """One job as stored."""

    spec: JobSpec
    state: str
    submitted: float
    started: float | None
    finished: float | None
    restarts: int
    failures: int
    retry_at: float
    service: float  # replica-seconds received
    message: str

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class AllocationRow:
    """The live allocation of a running job (``active``)."""

    name: str
    time: float
    replicas: tuple[int, ...]
    group_name: str | None
    actors: tuple[str, ...]


class Store:
    """The service's SQLite database (``<dir>/state.db``)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.exists():
            private_dir(self.directory)
        self.path = self.directory / "state.db"
        create_private(self.path)  # it holds the jobs' environments: 0600 (SQLite gives
        # new -wal and -shm files the database file's mode; older ones are narrowed here)
        for side in ("-wal", "-shm"):
            extra = self.path.with_name(self.path.name + side)
            if extra.is_file() and not extra.is_symlink() and extra.stat().st_mode & 0o077:
                extra.chmod(0o600)
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._lock = threading.RLock()  # one connection, shared by the service's threads
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # -- jobs ------------------------------------------------------------------------------
    def add_job(self, spec: JobSpec, now: float | None = None, replace: bool = False
                ) -> str | None:
        """Queue a job; the state of the finished run of the same name it replaced, if any.

        A name whose job is still active is refused. So is the name of a finished run unless
        ``replace``: its events and allocation history would otherwise mix with the new run's
        (``stratagem logs``). Replacing removes them, so the name names one run again."""
        now = time.time() if now is None else now
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE name=?", (spec.name,)).fetchone()
            if row is not None and row[0] not in FINAL:
                raise StratagemError(f"a job named {spec.name!r} is already {row[0]}",
                                     where="submit", fix="pick another name, or "
                                     f"'stratagem delete {spec.name}' first")
            if row is not None and not replace:
                raise StratagemError(
                    f"a job named {spec.name!r} already ran ({row[0]}); its events and logs "
                    "are kept under that name", where="submit",
                    fix="pick another name, or 'stratagem submit --replace FILE' to remove "
                        "that run's events, logs and service-kept checkpoints and start anew")
            db.execute("DELETE FROM jobs WHERE name=?", (spec.name,))
            db.execute("DELETE FROM events WHERE name=?", (spec.name,))
            db.execute("DELETE FROM allocations WHERE name=?", (spec.name,))
            db.execute("INSERT INTO jobs (name, spec, state, submitted) VALUES (?,?,?,?)",
                       (spec.name, json.dumps(spec.to_dict()), PENDING, now))
            db.execute("INSERT INTO events (name, time, text) VALUES (?,?,?)",
                       (spec.name, now, "submitted"))
        return None if row is None else str(row[0])

    def jobs(self, include_final: bool = True) -> list[JobRow]:
        rows = self._query("SELECT spec, state, submitted, started, finished, restarts, "
                           "failures, retry_at, service, message FROM jobs "
                           "ORDER BY submitted, name")
        out = [JobRow(spec_from_dict(json.loads(r[0])), *r[1:]) for r in rows]
        return out if include_final else [j for j in out if j.state not in FINAL]

    def job(self, name: str) -> JobRow:
        for j in self.jobs():
            if j.name == name:
                return j
        raise StratagemError(f"no job named {name!r}", where=str(self.path),
                             fix="'stratagem ls' lists the jobs")

    def update(self, name: str, event: str | None = None, **fields: Any) -> None:
        """Set columns of a job (and log ``event``) in one transaction."""
        now = time.time()
        with self._tx() as db:
            if fields:
                cols = ", ".join(f"{k}=?" for k in fields)
                db.execute(f"UPDATE jobs SET {cols} WHERE name=?", (*fields.values(), name))
            if event:
                db.execute("INSERT INTO events (name, time, text) VALUES (?,?,?)",
                           (name, now, event))

    def request_delete(self, name: str) -> str:
        """Mark a job for deletion; its state before."""
        state = self.job(name).state
        if state in FINAL:
            return state
        self.update(name, "delete requested", state=STOPPING)
        return state

    def events(self, name: str, after: int = 0) -> list[tuple[int, float, str]]:
        return self._query("SELECT id, time, text FROM events WHERE name=? AND id>? "
                           "ORDER BY id", (name, after))

    # -- allocations -----------------------------------------------------------------------
    def set_allocation(self, name: str, replicas: tuple[int, ...], group_name: str | None,
                       actors: tuple[str, ...], now: float | None = None) -> None:
        """Make this the job's live allocation (none when ``replicas`` is empty), given at
        ``now`` (default: the current time)."""
        now = time.time() if now is None else now
        with self._tx() as db:
            db.execute("UPDATE allocations SET active=0 WHERE name=?", (name,))
            if replicas:
                db.execute("INSERT INTO allocations (name, time, replicas, group_name, actors)"
                           " VALUES (?,?,?,?,?)", (name, now, json.dumps(replicas),
                                                   group_name, json.dumps(actors)))

    def allocations(self) -> dict[str, AllocationRow]:
        rows = self._query("SELECT name, time, replicas, group_name, actors "
                           "FROM allocations WHERE active=1")
        return {r[0]: AllocationRow(r[0], r[1], tuple(json.loads(r[2])), r[3],
                                    tuple(json.loads(r[4]))) for r in rows}

    def allocation_history(self, name: str) -> list[tuple[float, int]]:
        """(time, replica count) of every allocation a job received, oldest first."""
        rows = self._query("SELECT time, replicas FROM allocations WHERE name=? "
                           "ORDER BY id", (name,))
        return [(t, len(json.loads(r))) for t, r in rows]
