"""Periodic checkpoints written in the background: training stalls only for a snapshot.

At a step boundary every rank copies the states it writes into CPU memory (tensors cloned,
JSON and custom-file states serialized to bytes), agrees on the checkpoint's number in one
tiny all-reduce, and hands the copy to a writer thread; training goes on. The writer
serializes, checksums, writes and fsyncs this rank's files into ``ckpt-N.tmp/``, then
publishes their SHA-256 sums under a key of the save in the job's store (never the
training process group: collectives from two threads on one group are unsafe). Rank 0's
writer waits for every rank's key (at most the process-group timeout, then it names the
rank that never finished), writes ``meta.json``, renames the directory into place and
prunes old checkpoints. Until that rename the previous checkpoint stays the restore point,
so a kill during the write loses nothing that a synchronous save would have kept.

At most one save is in flight: the next save of any kind (periodic, SIGTERM, explicit),
choosing a restore point and dropping the job context first wait for it. A failed write is
reported on stderr at once (rank 0 names a rank that never finished); the next save warns
again and goes ahead, :func:`wait_for_checkpoint` raises it as a :class:`CheckpointError`.
The writer thread is not a daemon and an atexit handler joins it, so a process that ends
normally (also through ``stratagem.launch.worker``'s ``os._exit`` after atexit) finishes
the write.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import io
import json
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stratagem import checkpoint as ckpt
from stratagem import env
from stratagem.distributed.process_group import rank_world
from stratagem.elastic.context import current_job
from stratagem.errors import CheckpointError

KEY = "stratagem/background-checkpoint"
POLL_S = 0.01  # rank 0 polls (store.wait would hold the store client's lock meanwhile,
# blocking this process's other store users, e.g. the peer watchdog's heartbeats)
# tests: called by the writer with (tmp dir, rank) after its files are written, before it
# publishes them (a slow or killed writer)
before_publish: Callable[[Path, int], None] | None = None
_stale: list[str] = []
"""Rank 0: keys of earlier saves that other ranks may have set after rank 0 stopped
reading (it gave up on a late rank, another failed first, or its own write failed). The
next save deletes them once every rank has entered it, so that each of its writers has
published or failed by then: a job whose saves keep failing does not grow the store."""


def cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to CPU memory, so later optimizer
    steps cannot change what is being written (containers keep their type and attributes,
    e.g. a state dict's ``_metadata``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key in out:
            out[key] = cpu_copy(out[key])
        return out
    if isinstance(value, list):
        return [cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        items = [cpu_copy(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype,
                                           torch.device)):
        return value
    return copy.deepcopy(value)


def can_write_in_background() -> bool:
    """Whether a periodic save may go to the background here: one process, or a store that
    every rank reaches (otherwise the ranks could not tell rank 0 they finished)."""
    return rank_world()[1] == 1 or ckpt.job_store() is not None


class BackgroundSave:
    """One checkpoint being written by this rank's writer thread (see the module doc)."""

    def __init__(self, series: ckpt.CheckpointDir, seq: int, nonce: int,
                 files: dict[str, Any], meta: dict[str, Any]) -> None:
        self.series, self.seq, self.final = series, seq, series.path(seq)
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.files, self.meta = files, meta
        self.rank, self.world = rank_world()
        self.store = ckpt.job_store() if self.world > 1 else None
        self.key = f"{KEY}/{nonce:016x}"
        self.timeout_s = env.pg_timeout().total_seconds()
        self.error: CheckpointError | None = None
        self._names: list[str] = []  # the files this rank writes into the directory
        self._thread = threading.Thread(target=self._run, daemon=False,
                                        name=f"stratagem-checkpoint-{seq}")

    def start(self) -> BackgroundSave:
        self._thread.start()
        return self

    def join(self) -> None:
        """Block until the write is finished (its error, if any, was reported)."""
        self._thread.join()

    def wait(self) -> None:
        """Block until the write is finished; raise its error, if it failed."""
        self._thread.join()
        if self.error is not None:
            raise self.error

    # -- the writer thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            sums = self._write()
        except Exception as exc:  # noqa: BLE001 - reported, and raised by wait()
            problem = f"rank {self.rank} could not write its part: {type(exc).__name__}: {exc}"
            self._fail(problem[:500])
            self._remove_tmp()  # a full disk: the partial files must not keep the space
            self._publish({"error": problem[:500]})  # rank 0 stops waiting and names it
            if self.rank == 0 and self.store is not None:  # it reads no part this time
                _stale.extend(f"{self.key}/{r}" for r in range(1, self.world))
            return
        if self.rank != 0:
            self._publish({"sha256": sums})
            return
        try:
            for name, digest in self._gather().items():
                sums.setdefault(name, digest)
            ckpt.commit(self.tmp, self.final, self.meta, self.world, sums,
                        old=self.final.with_name(self.final.name + ".old"))
            self.series.prune()
        except CheckpointError as exc:
            self._fail(exc.problem)
            self._remove_tmp()
        except Exception as exc:  # noqa: BLE001 - reported, and raised by wait()
            self._fail(f"could not commit it: {type(exc).__name__}: {exc}"[:500])
            self._remove_tmp()

    def _remove_tmp(self) -> None:
        """A failed write leaves no temporary files holding disk space: rank 0 (which commits
        or drops the save) removes the directory; another rank only its own files, since on
        a shared file system the directory holds the other ranks' parts, still being
        written."""
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for name in self._names:
            (self.tmp / name).unlink(missing_ok=True)

    def _write(self) -> dict[str, str]:
        self._names = list(self.files)
        self.tmp.mkdir(parents=True, exist_ok=True)
        sums = {}
        for name, value in self.files.items():
            if isinstance(value, bytes):
                data = value
            else:
                buf = io.BytesIO()
                torch.save(value, buf)
                data = buf.getvalue()
            sums[name] = hashlib.sha256(data).hexdigest()
            ckpt.write_durably(self.tmp / name, data)
        self.files = {}  # the snapshot is on disk: free its memory
        if before_publish is not None:
            before_publish(self.tmp, self.rank)
        return sums

    def _publish(self, result: dict[str, Any]) -> None:
        if self.store is None or self.rank == 0:
            return
        try:
            self.store.set(f"{self.key}/{self.rank}", json.dumps(result))
        except Exception as exc:  # noqa: BLE001 - rank 0 will name this rank after waiting
            self._fail(f"rank {self.rank} could not report its part to rank 0 through the "
                       f"job's store: {type(exc).__name__}: {exc}"[:500])

    def _gather(self) -> dict[str, str]:
        """Rank 0: every other rank's checksums, from the store (bounded wait)."""
        if self.store is None:
            return {}
        keys = {r: f"{self.key}/{r}" for r in range(1, self.world)}
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, dict[str, Any]] = {}
        try:
            while len(results) < len(keys):
                for r, key in keys.items():
                    if r not in results and self.store.check([key]):
                        results[r] = json.loads(self.store.get(key).decode())
                if any("error" in v for v in results.values()):
                    break  # that rank failed: no need to wait for the others
                if len(results) < len(keys):
                    if time.monotonic() > deadline:
                        missing = ", ".join(str(r) for r in keys if r not in results)
                        raise CheckpointError(
                            f"rank {missing} did not finish writing its part within "
                            f"{self.timeout_s:.0f} s", where=str(self.final),
                            fix=f"see rank {missing}'s log; raise {env.PG_TIMEOUT} for very "
                                f"large checkpoints, or set {env.CHECKPOINT_ASYNC}=0")
                    time.sleep(POLL_S)
        finally:
            for r in results:  # only tidying the store
                with contextlib.suppress(Exception):
                    self.store.delete_key(keys[r])
            _stale.extend(keys[r] for r in keys if r not in results)  # set later, if ever
        sums: dict[str, str] = {}
        for r in sorted(results):
            part = results[r].get("sha256") if isinstance(results[r], dict) else None
            if not isinstance(part, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in part.items()):
                error = results[r].get("error") if isinstance(results[r], dict) else None
                raise CheckpointError(str(error or f"rank {r} reported no checksums")[:500],
                                      where=str(self.final), fix=f"see rank {r}'s log")
            sums.update(part)
        return sums

    def _fail(self, problem: str) -> None:
        self.error = CheckpointError(
            f"background checkpoint {self.final.name} failed: {problem}",
            where=str(self.final),
            fix="nothing is lost but this checkpoint: the previous one stays the restore "
                "point and the next save tries again; "
                f"{env.CHECKPOINT_ASYNC}=0 writes periodic checkpoints synchronously")
        print(f"stratagem: warning: {self.error.render()}", file=sys.stderr, flush=True)


def start(series: ckpt.CheckpointDir, files: dict[str, Any],
          meta: dict[str, Any]) -> Path:
    """Collective: number the next checkpoint of ``series`` and start writing ``files``
    (this rank's, a :func:`cpu_copy` or bytes each) in the background; returns the
    directory it will have once complete. The caller has waited for the previous save."""
    rank, _ = rank_world()
    if rank == 0:  # leftovers of a killed write (no rank is writing now: all have waited)
        series.remove_unfinished()
    nonce = secrets.randbits(62)
    seq, nonce = ckpt.reduce_ints([series.next_number(), nonce], dist.ReduceOp.MAX)
    if rank == 0:  # every rank is here: their earlier writers have published or failed
        _tidy(ckpt.job_store())
    save = BackgroundSave(series, seq, nonce, files, {"seq": seq, **meta})
    if not _at_exit:  # also when the process leaves through os._exit after atexit
        atexit.register(_finish_at_exit)  # (stratagem.launch.worker does)
        _at_exit.append(True)
    current_job().saving = save.start()
    return save.final


_at_exit: list[bool] = []


def _tidy(store: Any) -> None:
    """Delete the earlier saves' keys that rank 0 never read (see ``_stale``)."""
    keys, _stale[:] = list(_stale), []
    if store is None:
        return
    for key in keys:
        with contextlib.suppress(Exception):  # only tidying the store
            store.delete_key(key)


def _finish_at_exit() -> None:
    save = current_job().saving
    if save is not None:
        save.join()


def wait_for_checkpoint() -> None:
    """Wait until the checkpoint being written in the background (if any) is complete;
    raises a :class:`CheckpointError` if it failed (the previous checkpoint then stays the
    newest). Call it before reading the checkpoint directory yourself."""
    ctx = current_job()
    save, ctx.saving = ctx.saving, None
    if save is not None:
        save.wait()


def finish_previous() -> None:
    """Wait for the checkpoint being written in the background, if any, before another
    save or a restore; a failure becomes a warning (it was reported on stderr when it
    happened, and the save about to start supersedes it: no rank skips a collective)."""
    try:
        wait_for_checkpoint()
    except CheckpointError as exc:
        warnings.warn(exc.render(), stacklevel=3)
