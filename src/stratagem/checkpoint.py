"""Checkpoints a single process can load: one directory, plain state dicts, checksums.

Layout of ``path/``: ``model.pt`` and ``optimizer.pt`` (rank 0's replicated state),
or, for a sharded model (ZeRO), ``model-shard{r}.pt`` and ``optimizer-shard{r}.pt``
written by every rank in parallel (pieces that :func:`assemble_pieces` joins into the
whole state for any world size or a plain process; :func:`consolidate` writes them as
``model.pt``/``optimizer.pt``), ``sync-rank{r}.pt`` (per-rank synchronizer state such as
PowerSGD error feedback),
``meta.json`` (world size, strategy id, user metadata, SHA-256 of every file). The directory
is written under a temporary name, every file and the directory are fsynced, and only then
is it renamed, so a crash never leaves a half-written checkpoint under the real name.
Everything loads with ``weights_only=True``.

:class:`CheckpointDir` keeps a rotating series of such directories (``ckpt-00000007/``) for
checkpoint-restart: it keeps the newest ones and, when the newest is corrupt, falls back to
the previous one with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem import env
from stratagem.distributed.process_group import comm_device
from stratagem.distributed.process_group import rank_world as _rank_world
from stratagem.errors import CheckpointError
from stratagem.safeload import load_json

META = "meta.json"
STRATEGY = "strategy.json"  # the strategy the checkpoint was trained with
PREFIX = "ckpt-"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _reduce_int(value: int, op: dist.ReduceOp.RedOpType) -> int:
    """``value`` reduced over all ranks (itself without a process group)."""
    return reduce_ints([value], op)[0]


def reduce_ints(values: list[int], op: dist.ReduceOp.RedOpType) -> list[int]:
    """``values`` reduced elementwise over all ranks in one all-reduce (themselves without a
    process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=op)
    return [int(v) for v in t.tolist()]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory entry: :func:`fsync_dir`)."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _save_json(obj: Any, path: Path) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def write_collectively(final: Path, write: Callable[[Path], None], meta: dict[str, Any],
                       *, replace: bool = False) -> Path:
    """Write checkpoint directory ``final`` atomically; every rank must call it.

    Rank 0 creates ``final.tmp``; each rank's ``write(tmp)`` adds its files; rank 0 then
    records their SHA-256 and ``meta`` in ``meta.json``, fsyncs and renames the directory.
    With ``replace``, an existing ``final`` is swapped out (kept as ``.old`` until the new one
    is in place). The temporary directory must be visible to all ranks (shared filesystem).
    """
    rank, world = _rank_world()
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        write(tmp)
        _barrier()
        if rank == 0:
            if final.exists() and not replace:
                raise CheckpointError("checkpoint already exists", where=str(final),
                                      fix="remove it or write to a new path")
            commit(tmp, final, meta, world, _sums(tmp),
                   old=final.with_name(final.name + ".old"))
    except BaseException:  # a full disk: the partial files must not keep the space
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return final


def _sums(tmp: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.name != META}


def commit(tmp: Path, final: Path, meta: dict[str, Any], world: int, sums: dict[str, str],
           *, old: Path) -> None:
    """Make the written directory ``tmp`` the checkpoint ``final``: record ``meta`` and the
    files' SHA-256 ``sums`` in ``meta.json``, fsync, rename into place (an existing
    ``final`` is moved to ``old`` first and deleted after). Until the rename, ``final`` is
    untouched: a crash at any point leaves the previous state. A ``save_started`` entry
    (this process's ``time.monotonic()`` when the save began) is recorded as
    ``save_seconds``, which sizes the grace of a stop (:mod:`stratagem.launch.grace`)."""
    meta = dict(meta)
    started = meta.pop("save_started", None)
    if isinstance(started, float):
        meta["save_seconds"] = round(time.monotonic() - started, 3)
    _save_json({"format": 1, "world_size": world, "time": time.time(), **meta,
                "sha256": sums}, tmp / META)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def save(path: str | os.PathLike[str], model: nn.Module, optimizer: Any = None, *,
         strategy_id: str | None = None, metadata: dict[str, Any] | None = None,
         scaler: Any = None, strategy: dict[str, Any] | None = None,
         full: bool = False) -> Path:
    """Save ``model`` (plain or distributed) and ``optimizer`` to ``path``, from any single
    rank or from every rank.

    One rank suffices (``if rank == 0: save(...)``, also while the other ranks have left
    the training loop): the model's and the optimizer's state dicts are complete on their
    own (parameter-server values and optimizer state are fetched from their owners). When
    several ranks call it for the same path at once, one writes and the others wait for
    that write (agreed through the job's store, never by waiting for a rank that does not
    call). Only synchronizers that keep per-rank state (PowerSGD's error feedback) make it
    collective: then every rank must call it, as each writes its ``sync-rank{r}.pt``.

    ``metadata`` must be JSON-serializable. ``scaler`` (a ``torch.amp.GradScaler``; default:
    the one attached to ``model``) goes to ``scaler.pt``. ``strategy`` (a strategy's
    ``to_dict()``) goes to ``strategy.json``, so ``--strategy CKPT/strategy.json`` reruns
    the job with the strategy it was trained with (Auto's choice included).

    A sharded model (``model.is_sharded``: ZeRO stages on several workers) makes it
    collective: every rank writes its own pieces of the model and optimizer state
    (``model-shard{r}.pt``, ``optimizer-shard{r}.pt``), in parallel; :func:`load` reads
    them into any world size or a plain process. ``full=True`` instead gathers the whole
    state (collective) and writes plain ``model.pt``/``optimizer.pt`` from rank 0.
    """
    final = Path(path)
    rank, _ = _rank_world()
    if scaler is None:
        scaler = getattr(model, "scaler", None)
    meta = {"strategy_id": strategy_id, "metadata": metadata or {}}
    if getattr(model, "is_sharded", False):
        if full:
            return _save_full(final, model, optimizer, meta, scaler, strategy)
        return _save_sharded(final, model, optimizer, meta, scaler, strategy)
    sync_state = getattr(model, "synchronizer_state_dict", None)
    per_rank = sync_state() if sync_state is not None else {}

    def write(tmp: Path, writer: bool) -> None:
        if per_rank:
            _save_file(per_rank, tmp / f"sync-rank{rank}.pt")
        if not writer:
            return
        prepare = getattr(model, "before_checkpoint", None)
        if prepare is not None:  # e.g. fetch stale parameter-server rows (this rank alone)
            prepare()
        _save_file(_inner(model).state_dict(), tmp / "model.pt")
        if optimizer is not None:  # (its pre-hook fetches the owners' PS state)
            _save_file(optimizer.state_dict(), tmp / "optimizer.pt")
        if scaler is not None:
            _save_file(scaler.state_dict(), tmp / "scaler.pt")
        if strategy is not None:
            _save_json(strategy, tmp / STRATEGY)

    if per_rank:
        return write_collectively(final, lambda tmp: write(tmp, rank == 0), meta,
                                  replace=True)
    _write_once(final, lambda: write_alone(final, lambda tmp: write(tmp, True), meta))
    return final


def _save_sharded(final: Path, model: Any, optimizer: Any, meta: dict[str, Any],
                  scaler: Any, strategy: dict[str, Any] | None) -> Path:
    """Every rank writes its pieces (collective; see :func:`save`)."""
    rank, world = _rank_world()
    model_part = model.sharded_model_state()
    optim_part = model.sharded_optimizer_state(optimizer) if optimizer is not None else None
    per_rank = model.synchronizer_state_dict()

    def write(tmp: Path) -> None:
        _save_file(model_part, tmp / f"model-shard{rank}.pt")
        if optim_part is not None:
            _save_file(optim_part, tmp / f"optimizer-shard{rank}.pt")
        if per_rank:
            _save_file(per_rank, tmp / f"sync-rank{rank}.pt")
        if rank == 0 and scaler is not None:
            _save_file(scaler.state_dict(), tmp / "scaler.pt")
        if rank == 0 and strategy is not None:
            _save_json(strategy, tmp / STRATEGY)

    return write_collectively(final, write, {**meta, "shards": world}, replace=True)


def _save_full(final: Path, model: Any, optimizer: Any, meta: dict[str, Any], scaler: Any,
               strategy: dict[str, Any] | None) -> Path:
    """The whole state gathered (collective), written by rank 0 as a plain checkpoint."""
    rank, _ = _rank_world()
    state = model.full_state_dict()
    optim = model.full_optimizer_state_dict(optimizer) if optimizer is not None else None

    def write(tmp: Path) -> None:
        if rank != 0:
            return
        _save_file(state, tmp / "model.pt")
        if optim is not None:
            _save_file(optim, tmp / "optimizer.pt")
        if scaler is not None:
            _save_file(scaler.state_dict(), tmp / "scaler.pt")
        if strategy is not None:
            _save_json(strategy, tmp / STRATEGY)

    return write_collectively(final, write, meta, replace=True)


def assemble_pieces(files: list[Any], where: str) -> tuple[dict[str, torch.Tensor],
                                                            dict[str, Any], Any]:
    """Join piece files (one per rank of a sharded save, see
    :mod:`stratagem.runtime.shard_state`) into whole tensors: returns ``(tensors,
    non-tensor values, skeleton)``. Every tensor's dim-0 rows must be covered exactly
    once, else a CheckpointError names it."""
    fix = "the checkpoint is incomplete or damaged; use an earlier one"
    tensors: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    values: dict[str, Any] = {}
    skeleton = None
    for f in files:
        if not (isinstance(f, dict) and isinstance(f.get("pieces"), dict)):
            raise CheckpointError("a shard file holds no pieces", where=where, fix=fix)
        values.update(f.get("values") or {})
        if f.get("skeleton") is not None:
            skeleton = f["skeleton"]
        for key, piece in f["pieces"].items():
            data, offset, shape = piece.get("data"), piece.get("offset"), piece.get("shape")
            if not (torch.is_tensor(data) and isinstance(offset, int)
                    and isinstance(shape, list)):
                raise CheckpointError(f"bad piece {key!r}", where=where, fix=fix)
            if key not in tensors:
                tensors[key] = torch.empty(shape, dtype=data.dtype, device=data.device)
                covered[key] = 0
            whole = tensors[key]
            if list(whole.shape) != shape or (whole.dim() == 0 and offset != 0):
                raise CheckpointError(f"pieces of {key!r} disagree on its shape",
                                      where=where, fix=fix)
            if whole.dim() == 0:
                whole.copy_(data)
                covered[key] += 1
                continue
            rows = data.shape[0] if data.dim() else 0
            if offset < 0 or offset + rows > whole.shape[0] or \
                    list(data.shape[1:]) != shape[1:]:
                raise CheckpointError(f"a piece of {key!r} lies outside it", where=where,
                                      fix=fix)
            whole[offset:offset + rows].copy_(data)
            covered[key] += rows
    for key, whole in tensors.items():
        want = 1 if whole.dim() == 0 else whole.shape[0]
        if covered[key] != want:
            raise CheckpointError(f"the pieces of {key!r} cover {covered[key]} of its "
                                  f"{want} rows", where=where, fix=fix)
    return tensors, values, skeleton


def optimizer_state_from_pieces(tensors: dict[str, torch.Tensor], values: dict[str, Any],
                                skeleton: Any, where: str) -> dict[str, Any]:
    """A whole (single-process) ``optimizer.state_dict()`` from assembled optimizer
    pieces (keys ``"<index>/<name>"``, param groups in the skeleton)."""
    if not (isinstance(skeleton, dict) and isinstance(skeleton.get("param_groups"), list)):
        raise CheckpointError("the optimizer's shard files hold no param groups",
                              where=where, fix="use an earlier checkpoint")
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *values.items()]:
        index, _, name = key.partition("/")
        if not index.isdigit() or not name:
            raise CheckpointError(f"bad optimizer piece {key!r}", where=where,
                                  fix="use an earlier checkpoint")
        state.setdefault(int(index), {})[name] = value
    return {"state": dict(sorted(state.items())), "param_groups": skeleton["param_groups"]}


def read_pieces(p: Path, stem: str, shards: int, map_location: Any = "cpu") -> list[Any]:
    """Every rank's ``{stem}-shard{r}.pt`` piece file of checkpoint ``p`` (checksummed)."""
    return [load_file(p, f"{stem}-shard{r}.pt", map_location) for r in range(shards)]


def read_model_state(path: str | os.PathLike[str], map_location: Any = "cpu"
                     ) -> dict[str, torch.Tensor]:
    """The whole model state dict of checkpoint ``path``, sharded or not (checksummed,
    ``weights_only``): what a plain single-process model loads."""
    p = Path(path)
    return _model_state(p, verify(p), map_location)


def _model_state(p: Path, meta: dict[str, Any], map_location: Any) -> dict[str, torch.Tensor]:
    """:func:`read_model_state` of a checkpoint whose ``meta`` :func:`verify` returned."""
    shards = meta.get("shards")
    if isinstance(shards, int) and shards > 0:
        tensors, _, _ = assemble_pieces(read_pieces(p, "model", shards, map_location), str(p))
        return tensors
    return load_file(p, "model.pt", map_location)


def read_optimizer_state(path: str | os.PathLike[str], map_location: Any = "cpu"
                         ) -> dict[str, Any] | None:
    """The whole ``optimizer.state_dict()`` of checkpoint ``path`` (None: none saved)."""
    p = Path(path)
    return _optimizer_state(p, verify(p), map_location)


def _optimizer_state(p: Path, meta: dict[str, Any], map_location: Any
                     ) -> dict[str, Any] | None:
    """:func:`read_optimizer_state` of a checkpoint whose ``meta`` :func:`verify` returned."""
    shards = meta.get("shards")
    if isinstance(shards, int) and shards > 0:
        if not (p / "optimizer-shard0.pt").is_file():
            return None
        tensors, values, skeleton = assemble_pieces(
            read_pieces(p, "optimizer", shards, map_location), str(p))
        return optimizer_state_from_pieces(tensors, values, skeleton, str(p))
    if not (p / "optimizer.pt").is_file():
        return None
    return load_file(p, "optimizer.pt", map_location)


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write sharded checkpoint ``path`` as a plain one at ``out`` (one process): whole
    ``model.pt`` and ``optimizer.pt`` that ``torch.load(weights_only=True)`` and plain
    torch's ``load_state_dict`` take."""
    p, final = Path(path), Path(out)
    meta = verify(p)
    model_state = _model_state(p, meta, "cpu")
    optim = _optimizer_state(p, meta, "cpu")

    def write(tmp: Path) -> None:
        _save_file(model_state, tmp / "model.pt")
        if optim is not None:
            _save_file(optim, tmp / "optimizer.pt")
        for name in ("scaler.pt", STRATEGY):
            if (p / name).is_file():
                (tmp / name).write_bytes(read_verified(p, name).getvalue())

    keep = {k: meta[k] for k in ("strategy_id", "metadata") if k in meta}
    return write_alone(final, write, keep)


def write_alone(final: Path, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Write checkpoint directory ``final`` atomically from this rank only (a temporary
    directory of its own, fsynced, renamed over any older ``final``)."""
    _, world = _rank_world()
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        commit(tmp, final, meta, world, _sums(tmp),
               old=final.with_name(f"{final.name}.old-{os.getpid()}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def job_store() -> Any:
    """The default process group's store, or None (one process, or no group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nobody to agree with
        return None


def _write_once(final: Path, write: Callable[[], Any]) -> None:
    """Run ``write()`` on this rank, unless another rank is writing ``final`` right now:
    then wait for its write instead (several ranks calling ``save`` together write once).

    A lease in the job's store names the writer; a rank that finds no lease writes, so a
    rank saving alone never waits for anyone. Without a reachable store (a peer that hosted
    it has exited) this rank writes."""
    store = job_store()
    if store is None:
        write()
        return
    key = "stratagem/checkpoint-writer/" + hashlib.sha256(
        str(final.resolve()).encode()).hexdigest()[:32]
    rank, _ = _rank_world()
    me = f"{rank}:{os.getpid()}:{time.time_ns()}"
    try:
        holder = store.compare_set(key, "", me).decode()
    except Exception:  # noqa: BLE001 - the store is gone: write alone
        write()
        return
    if holder == me:
        status = "ok"
        try:
            write()
        except BaseException as exc:
            status = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            with contextlib.suppress(Exception):
                store.set(f"{key}/result/{me}", status)
                store.delete_key(key)
        return
    _wait_for_writer(store, key, holder, final)


def _wait_for_writer(store: Any, key: str, holder: str, final: Path) -> None:
    who = f"rank {holder.split(':')[0]}"
    deadline = time.monotonic() + env.pg_timeout().total_seconds()
    try:
        while store.check([key]) and store.get(key).decode() == holder:
            if time.monotonic() > deadline:
                raise CheckpointError(f"{who} has been writing this checkpoint for longer "
                                      "than the process-group timeout", where=str(final),
                                      fix=f"see {who}'s log; raise {env.PG_TIMEOUT} for "
                                          "very large checkpoints")
            time.sleep(0.05)
        status = store.get(f"{key}/result/{holder}").decode()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store went away mid-write
        raise CheckpointError(f"lost contact with {who} while it wrote this checkpoint "
                              f"({type(exc).__name__})", where=str(final),
                              fix=f"see {who}'s log, then save again") from None
    if status != "ok":
        raise CheckpointError(f"{who} failed to write this checkpoint: {status}",
                              where=str(final), fix=f"see {who}'s log, then save again")


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _plain_file_name(name: str) -> bool:
    """A name inside the checkpoint directory (job-state names may hold any character but
    '/'), never a path out of it."""
    return (0 < len(name.encode("utf-8", "surrogatepass")) <= 255 and "/" not in name
            and "\0" not in name and name not in (".", "..", META))


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json``, checked for shape: a mapping with a ``sha256`` table
    of plain file names to hex digests and a positive ``world_size``."""
    p = Path(path)
    if not (p / META).is_file():
        raise CheckpointError("not a checkpoint (no meta.json)", where=str(p),
                              fix="pass a directory written by stratagem checkpoint save")
    fix = "the checkpoint is damaged; use an earlier one or restore it from a backup"
    try:
        raw = (p / META).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read meta.json: {exc}", where=str(p), fix=fix) from None
    meta = load_json(raw, f"{p / META}", CheckpointError, fix)
    sums = meta.get("sha256") if isinstance(meta, dict) else None
    if not isinstance(sums, dict):
        raise CheckpointError("meta.json is corrupt: no checksums", where=str(p), fix=fix)
    for name, digest in sums.items():
        if (not _plain_file_name(name) or not isinstance(digest, str)
                or not _HEX64.fullmatch(digest)):
            raise CheckpointError(f"meta.json is corrupt: bad checksum entry {name!r}"[:300],
                                  where=str(p), fix=fix)
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 0 < world < 1 << 31:
        raise CheckpointError(f"meta.json is corrupt: world_size {world!r}"[:300],
                              where=str(p), fix=fix)
    for key, kind in (("states", dict), ("metadata", dict)):
        if key in meta and not isinstance(meta[key], kind):
            raise CheckpointError(f"meta.json is corrupt: {key} is not a {kind.__name__}",
                                  where=str(p), fix=fix)
    return meta


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that checkpoint ``path`` holds exactly the files its ``meta.json`` lists, each
    matching its checksum; returns the metadata.

    A file that meta.json does not list fails too: a damaged meta.json that lost an entry
    must not let a damaged file through unchecked.
    """
    p = Path(path)
    meta = read_meta(p)
    present = sorted(f.name for f in p.iterdir() if f.name != META)
    unlisted = [name for name in present if name not in meta["sha256"]]
    if unlisted:
        raise CheckpointError(f"{unlisted[0]} is not listed in meta.json", where=str(p),
                              fix="meta.json or the directory is damaged; use an earlier "
                                  "checkpoint")
    for name in meta["sha256"]:
        _check_file(p, meta, name)
    return meta


def _check_file(p: Path, meta: dict[str, Any], name: str) -> Path:
    f = p / name
    if not f.is_file():
        raise CheckpointError(f"missing {name}", where=str(p),
                              fix="the checkpoint is incomplete; use an earlier one")
    digest = meta["sha256"].get(name)
    if digest is None:
        raise CheckpointError(f"{name} is not listed in meta.json", where=str(p),
                              fix="meta.json is damaged; use an earlier checkpoint")
    if _sha256(f) != digest:
        raise CheckpointError(f"checksum mismatch in {name}", where=str(p),
                              fix="the file is corrupt; use an earlier checkpoint")
    return f


def read_verified(path: str | os.PathLike[str], name: str) -> io.BytesIO:
    """The bytes of file ``name`` of checkpoint ``path``, after checking them against
    meta.json (read once, so the file cannot change between the check and the use)."""
    p = Path(path)
    meta = read_meta(p)
    f = _check_file(p, meta, name)
    data = f.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"][name]:
        raise CheckpointError(f"checksum mismatch in {name}", where=str(p),
                              fix="the file is corrupt; use an earlier checkpoint")
    return io.BytesIO(data)


def load_file(path: str | os.PathLike[str], name: str, map_location: Any = "cpu",
              verify: bool = True) -> Any:
    """Load one file of a checkpoint with ``weights_only=True``, checking its checksum."""
    p = Path(path)
    if verify:
        source: Any = read_verified(p, name)
    else:
        source = p / name
        if not source.is_file():
            raise CheckpointError(f"missing {name}", where=str(p),
                                  fix="the checkpoint is incomplete; use an earlier one")
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one clear error
        raise CheckpointError(f"cannot read {name}: {type(exc).__name__}: {exc}"[:500],
                              where=str(p), fix="use an earlier checkpoint") from None


def check_model_state(state: Any, model: nn.Module, where: str) -> None:
    """Raise a CheckpointError naming the parameters and buffers in which the checkpoint's
    ``state`` and ``model`` differ (missing, unexpected, or of another shape)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"model.pt holds a {type(state).__name__}, not a state dict",
                              where=where, fix="use a checkpoint written by checkpoint.save")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    reshaped = [f"{k} {list(state[k].shape)} vs {list(own[k].shape)}" for k in own
                if k in state and isinstance(state[k], torch.Tensor)
                and state[k].shape != own[k].shape]
    parts = [f"{label}: {', '.join(map(str, names[:8]))}{' ...' * (len(names) > 8)}"
             for label, names in (("not in the checkpoint", missing),
                                  ("only in the checkpoint", unexpected),
                                  ("shape differs (checkpoint vs model)", reshaped)) if names]
    if parts:
        raise CheckpointError("the checkpoint is from a different model; "
                              + "; ".join(parts), where=where,
                              fix="build the same model architecture before loading")


def load(path: str | os.PathLike[str], model: nn.Module | None = None, optimizer: Any = None,
         *, map_location: Any = "cpu", scaler: Any = None) -> dict[str, Any]:
    """Restore ``model``/``optimizer`` (and ``scaler``, default the one attached to
    ``model``, when the checkpoint has one) from ``path``; returns the metadata.

    Works in a single process and in any world size, from plain and sharded checkpoints
    alike (a sharded model loads the whole state into its shards). Per-rank synchronizer
    state is restored only when the world size matches; otherwise it restarts fresh
    (warned).
    """
    p = Path(path)
    meta = verify(p)
    if model is not None:
        state = _model_state(p, meta, map_location)
        check_model_state(state, _inner(model), str(p))
        load_full = getattr(model, "load_full_state_dict", None)
        try:
            if load_full is not None:  # a sharded model takes its shards of it
                load_full(state)
            else:
                _inner(model).load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(f"model does not match: {exc}", where=str(p),
                                  fix="build the same model architecture before loading"
                                  ) from None
        restore = getattr(model, "load_synchronizer_state_dict", None)
        rank, world = _rank_world()
        name = f"sync-rank{rank}.pt"
        if restore is not None and (p / name).is_file():
            if meta["world_size"] == world:
                restore(load_file(p, name, map_location))
            else:
                warnings.warn(f"checkpoint was written by {meta['world_size']} replicas, now "
                              f"{world}: synchronizer state (e.g. PowerSGD) restarts fresh",
                              stacklevel=2)
    state = _optimizer_state(p, meta, map_location) if optimizer is not None else None
    if state is not None:
        load_opt = getattr(model, "load_full_optimizer_state_dict", None)
        try:  # torch says ValueError (group sizes) or KeyError (missing fields)
            if load_opt is not None:  # a sharded model's optimizer takes its share
                load_opt(optimizer, state)
            else:
                optimizer.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"optimizer does not match: {exc!r}"[:500], where=str(p),
                                  fix="build the optimizer over the same parameters (and "
                                      "parameter groups) as the one that was saved") from None
    if scaler is None:
        scaler = getattr(model, "scaler", None)
    if scaler is not None and (p / "scaler.pt").is_file():
        scaler.load_state_dict(load_file(p, "scaler.pt", map_location))
    finish = getattr(model, "after_restore", None)
    if finish is not None:  # collective: e.g. hand parameter-server shards to their owners
        finish()
    return meta.get("metadata", {})


class CheckpointDir:
    """A series of numbered checkpoints ``root/ckpt-NNNNNNNN/``; the newest ``keep`` stay.

    Writing never touches an existing checkpoint: a new one gets the next number and older
    ones are pruned only after it is complete. :meth:`latest_good` verifies checksums from
    the newest down, warns about a corrupt one, renames it ``*.corrupt`` (deleted by the
    next save) and falls back to the one before.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def _numbered(self) -> list[tuple[int, Path]]:
        """Every ``ckpt-N*`` entry (complete, temporary or quarantined), by number."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = re.match(rf"^{PREFIX}(\d+)", p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (not verified)."""
        return [p for _, p in self._numbered() if _NAME.match(p.name) and (p / META).is_file()]

    def save(self, write: Callable[[Path], None], meta: dict[str, Any] | None = None) -> Path:
        """Collectively write the next checkpoint with ``write(tmp_dir)``; prune old ones."""
        rank, _ = _rank_world()
        seq = _reduce_int(self.next_number(), dist.ReduceOp.MAX)
        final = self.path(seq)
        write_collectively(final, write, {"seq": seq, **(meta or {})})
        if rank == 0:
            self.prune()
        _barrier()
        return final

    def next_number(self) -> int:
        """This rank's guess at the next checkpoint's number (one past every entry but
        leftovers of unfinished writes); the ranks agree on the largest guess."""
        return max((n for n, p in self._numbered() if not p.name.endswith(".tmp")),
                   default=0) + 1

    def remove_unfinished(self) -> None:
        """Delete the temporary directories of writes that never finished (call it only
        while no rank is writing into this series)."""
        for _, p in self._numbered():
            if p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)

    def path(self, seq: int) -> Path:
        """Checkpoint number ``seq``'s directory (its temporary one: ``+ ".tmp"``)."""
        return self.root / f"{PREFIX}{seq:08d}"

    def prune(self) -> None:
        """Delete everything but the newest ``keep`` complete checkpoints (older ones,
        leftovers of crashed saves, quarantined ``*.corrupt`` ones)."""
        kept = {p.name for p in self.checkpoints()[-self.keep:]}
        for _, p in self._numbered():
            if p.name not in kept:
                shutil.rmtree(p, ignore_errors=True)

    def latest_good(self) -> Path | None:
        """The newest checkpoint whose files all match their checksums (collective).

        Corrupt newer ones are reported with a warning and renamed ``*.corrupt`` by rank 0.
        Ranks must see the same files (a shared filesystem); otherwise it raises.
        """
        rank, _ = _rank_world()
        chosen, bad = None, []
        for p in reversed(self.checkpoints()):
            try:
                verify(p)
            except CheckpointError as exc:
                bad.append(p)
                warnings.warn(f"checkpoint {p} is unusable ({exc.problem}); falling back to "
                              "the previous one", stacklevel=2)
                continue
            chosen = p
            break
        seq = int(_NAME.match(chosen.name).group(1)) if chosen is not None else 0
        low, high = _reduce_int(seq, dist.ReduceOp.MIN), _reduce_int(seq, dist.ReduceOp.MAX)
        if low != high:
            raise CheckpointError(
                f"workers disagree on the latest good checkpoint ({low} vs {high})",
                where=str(self.root),
                fix="put the checkpoint directory on a filesystem that all workers share")
        if rank == 0:
            for p in bad:
                p.rename(p.with_name(p.name + ".corrupt"))
        _barrier()
        return chosen
