"""Application profiles: how fast a job runs anywhere, and how its gradient noise evolves.

Two sources give the same :class:`AppProfile`:

* a Pollux-format directory (``placements.csv``, ``scalability.csv``, ``validation-B.csv``;
  see the data set's README): step times interpolated from the measurements
  (:mod:`.interpolate`), gradient statistics per epoch and batch size from the validation
  files, epochs ending where the validation files' scale-invariant progress says;
* the hints a Stratagem adaptive job publishes (``hints.json``, docs/reference/hints.md):
  measured configurations where there are some, the job's own fitted throughput model
  elsewhere, and its last gradient statistics for every epoch (see :func:`load_hints_profile`).

An optional ``profile.json`` beside either overrides ``epochs``, ``max_local_bsz``,
``min_local_bsz``, ``base_batch_size``, ``max_batch_size`` (and, for hints, sets
``progress_per_epoch``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from stratagem.adapt import (
    GNSEstimate,
    ProfileRecord,
    ThroughputParams,
    fit_throughput,
    predict_step_time,
    predict_sync_time,
)
from stratagem.errors import StratagemError
from stratagem.safeload import load_json
from stratagem.sched.simulator.interpolate import (
    Measurement,
    StepTimeTable,
    parse_placement,
)
from stratagem.sched.simulator.workload import read_csv

MAX_EPOCHS = 100_000  # an application's epochs (the Pollux profiles have at most 100)
MAX_PROFILE_JSON = 1 << 20  # bytes of a hints.json or profile.json

# Epoch budgets (and yolov3's memory cap) that the Pollux paper's simulator used for its six
# applications; a profile.json beside the files overrides them.
KNOWN_APPS: dict[str, dict[str, int]] = {
    "bert": {"epochs": 2},
    "cifar10": {"epochs": 100},
    "ncf": {"epochs": 10},
    "imagenet": {"epochs": 90},
    "deepspeech2": {"epochs": 80},
    "yolov3": {"epochs": 50, "max_local_bsz": 8},
}
_OVERRIDES = ("epochs", "min_local_bsz", "max_local_bsz", "base_batch_size", "max_batch_size",
              "progress_per_epoch")


@dataclass(frozen=True)
class GradTable:
    """Gradient statistics per (batch size, epoch): ``sqr`` = |G|^2, ``var`` at the base batch.

    ``var`` is in Pollux/AdaptDL units (variance of a base-batch mean), rows are epochs.
    """

    batch_sizes: np.ndarray  # sorted
    sqr: np.ndarray  # (batch sizes, epochs)
    var: np.ndarray

    def at(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """Linear in batch size between the measured ones (clamped), epoch clamped."""
        e = min(max(int(epoch), 0), self.sqr.shape[1] - 1)
        b = self.batch_sizes
        x = min(max(float(batch_size), b[0]), b[-1])
        return (float(np.interp(x, b, self.sqr[:, e])), float(np.interp(x, b, self.var[:, e])))


@dataclass
class AppProfile:
    """Everything the simulator needs to know about one application."""

    name: str
    steps: StepTimeTable
    grads: GradTable
    epoch_ends: np.ndarray  # scale-invariant progress at the end of epoch 1, 2, ...
    base_batch_size: int
    max_batch_size: int
    min_local_bsz: int
    max_local_bsz: int
    records: list[ProfileRecord] = field(default_factory=list, repr=False)
    fitted: ThroughputParams | None = None

    @property
    def epochs(self) -> int:
        return int(self.epoch_ends.size)

    @property
    def total_progress(self) -> float:
        return float(self.epoch_ends[-1])

    def epoch_of(self, progress: float) -> int:
        """Epochs completed at ``progress``."""
        return int(np.searchsorted(self.epoch_ends, progress * (1 + 1e-12), side="right"))

    def step_time(self, placement: Iterable[int], local_bsz: float,
                  accum_steps: int = 0) -> tuple[float, float]:
        """Seconds per optimizer step (all micro-batches) and the sync part of it."""
        step, sync = self.steps.lookup(placement, local_bsz)
        return step + accum_steps * max(step - sync, 0.0), sync

    def gns(self, batch_size: float, epoch: int) -> GNSEstimate:
        """The gradient noise a job measures in ``epoch`` at ``batch_size``."""
        sqr, var = self.grads.at(batch_size, epoch)
        return GNSEstimate.from_base_batch_variance(sqr, var, self.base_batch_size)

    @cached_property
    def throughput_params(self) -> ThroughputParams:
        """The throughput model fitted on every measurement (fitted once, on first use)."""
        return self.fitted if self.fitted is not None else fit_throughput(self.records)


def _read_csv(path: Path) -> list[dict[str, str]]:
    return read_csv(path, path.name)


def _read_json(path: Path, fix: str) -> object:
    """A profile's JSON file, within size and depth bounds (safeload), as plain values."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PROFILE_JSON + 1)
    except OSError as exc:
        raise StratagemError(f"cannot read {path.name}: {exc.strerror}", where=str(path),
                             fix=fix) from exc
    if len(raw) > MAX_PROFILE_JSON:
        raise StratagemError(f"{path.name} is larger than {MAX_PROFILE_JSON} bytes",
                             where=str(path), fix=fix)
    return load_json(raw, str(path), StratagemError, fix)


def _num(row: Mapping[str, str], key: str, path: Path) -> float:
    try:
        value = float(row[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise StratagemError(f"column {key!r} missing or not a number in row "
                             f"{str(dict(row))[:300]}",
                             where=str(path), fix="see the profile format in the README") from exc
    if not math.isfinite(value):
        raise StratagemError(f"{key} is not finite in row {str(dict(row))[:300]}",
                             where=str(path))
    return value


def _overrides(directory: Path) -> dict[str, float]:
    out: dict[str, float] = dict(KNOWN_APPS.get(directory.name, {}))
    path = directory / "profile.json"
    if path.is_file():
        data = _read_json(path, f"a JSON object with some of {list(_OVERRIDES)}")
        if not isinstance(data, dict):
            raise StratagemError("not a JSON object", where=str(path),
                                 fix=f"a JSON object with some of {list(_OVERRIDES)}")
        unknown = set(data) - set(_OVERRIDES)
        if unknown:
            raise StratagemError(f"unknown keys {sorted(unknown)[:10]}"[:300], where=str(path),
                                 fix=f"use only {list(_OVERRIDES)}")
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= (MAX_EPOCHS if key == "epochs" else 1e12):
                raise StratagemError(f"{key} is {str(value)[:60]}, not a positive number"
                                     + (f" up to {MAX_EPOCHS}" if key == "epochs" else ""),
                                     where=str(path), fix="positive numbers only")
        out.update(data)
    return out


def _check_measurement(m: Measurement, path: Path) -> None:
    """A measured step: positive time and batch, sync time within the step, sane sizes."""
    if not (0 < m.step_time <= 1e6 and 0 <= m.sync_time <= m.step_time
            and 1 <= m.local_bsz <= 1 << 24 and 1 <= m.num_nodes <= m.num_replicas <= 65_536):
        raise StratagemError(
            f"a measurement with step_time {m.step_time:g}, sync_time {m.sync_time:g}, "
            f"local_bsz {m.local_bsz:g} on {m.num_replicas} replicas / {m.num_nodes} nodes",
            where=str(path), fix="step_time above 0 (seconds), 0 <= sync_time <= step_time, "
                                 "local_bsz >= 1, 1 <= nodes <= replicas")


def load_pollux_profile(directory: str | Path) -> AppProfile:
    """Load a Pollux-format profile directory (see the module doc)."""
    d = Path(directory)
    measurements: list[Measurement] = []
    records: list[ProfileRecord] = []
    path = d / "placements.csv"
    for row in _read_csv(path):
        try:
            placement = parse_placement(row["placement"])
        except (KeyError, ValueError) as exc:
            raise StratagemError(f"bad placement in row {str(row)[:300]}", where=str(path),
                                 fix="a digit string, one digit per node") from exc
        m = Measurement(len(placement), sum(placement), _num(row, "local_bsz", path),
                        _num(row, "step_time", path), _num(row, "sync_time", path), placement)
        _check_measurement(m, path)
        measurements.append(m)
    scal = d / "scalability.csv"
    if scal.is_file():
        for row in _read_csv(scal):
            m = Measurement(
                int(_num(row, "num_nodes", scal)), int(_num(row, "num_replicas", scal)),
                _num(row, "local_bsz", scal), _num(row, "step_time", scal),
                _num(row, "sync_time", scal))
            _check_measurement(m, scal)
            measurements.append(m)
    for m in measurements:
        records.append(ProfileRecord(m.num_nodes, m.num_replicas, int(m.local_bsz),
                                     m.step_time, 0, max(m.step_time - m.sync_time, 1e-9)))
    validation: dict[int, list[dict[str, str]]] = {}
    for p in sorted(d.glob("validation-*.csv")):
        try:
            validation[int(p.stem.split("-", 1)[1])] = _read_csv(p)
        except ValueError as exc:
            raise StratagemError("file name must be validation-<batch size>.csv",
                                 where=str(p)) from exc
    if not validation or not measurements:
        raise StratagemError("no placements.csv rows or no validation-B.csv files",
                             where=str(d), fix="point --profiles at a directory of "
                             "application directories in the Pollux format")
    sizes = sorted(validation)
    rows = min(len(v) for v in validation.values())
    if rows == 0:
        raise StratagemError("a validation file has no rows", where=str(d))
    get = lambda key: np.array([[_num(r, key, d) for r in validation[b][:rows]]  # noqa: E731
                                for b in sizes])
    progress = get("progress")
    over = _overrides(d)
    epochs = int(over.get("epochs", rows))
    if not np.isfinite(progress).all() or (progress < 0).any():
        raise StratagemError("progress is not a finite number >= 0 everywhere", where=str(d),
                             fix="check the validation-B.csv files")
    if not 1 <= epochs <= rows:
        raise StratagemError(f"epochs {epochs} outside the {rows} measured epochs",
                             where=str(d))
    table = StepTimeTable(measurements)
    return AppProfile(
        name=d.name, steps=table,
        grads=GradTable(np.array(sizes, float), get("grad_sqr"), get("grad_var")),
        epoch_ends=progress.min(axis=0)[:epochs],
        base_batch_size=int(over.get("base_batch_size", sizes[0])),
        max_batch_size=int(over.get("max_batch_size", sizes[-1])),
        min_local_bsz=int(over.get("min_local_bsz", table.min_local_bsz)),
        max_local_bsz=int(over.get("max_local_bsz", table.max_local_bsz)),
        records=records)


def load_hints_profile(directory: str | Path) -> AppProfile:
    """A profile from the ``hints.json`` a Stratagem adaptive job wrote (schema version 1).

    Step times: the measured configurations of ``profile`` (as single-node or evenly spread
    placements) where measured, the job's ``throughput_params`` (else a fit of ``profile``)
    elsewhere, on a grid of 1-16 nodes x 1-8 GPUs per node. Gradient statistics: the last
    ``gradient`` snapshot, for every epoch and batch size. Epochs: ``profile.json``'s
    ``epochs`` (default: the hints' ``epoch`` + 1) of ``progress_per_epoch`` base-batch
    iterations (default: ``progress / epoch``, or the progress so far when in epoch 0).
    """
    d = Path(directory)
    path = d / "hints.json"
    h = _read_json(path, "copy the hints.json an adaptive job wrote")
    try:
        batch = h["batch"]
        base = int(batch["base_batch_size"])
        lo, hi = batch.get("local_bsz_bounds") or [None, None]
        records = [ProfileRecord.from_mapping(r) for r in h.get("profile") or []]
        params = h.get("throughput_params")
        params = ThroughputParams.from_dict(params) if params else fit_throughput(records)
        grad = h.get("gradient") or {"sqr_norm": 0.0, "var": 0.0}
        progress = h.get("progress") or {}
        done = float(progress.get("progress", 0.0))
        epoch = int(h.get("epoch") or 0)
        max_batch = int(batch.get("max_batch_size") or base)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise StratagemError(f"hints document incomplete: {exc!r}"[:300], where=str(path),
                             fix="hints of schema version 1 after at least one timed step "
                                 "(docs/reference/hints.md)") from exc
    over = _overrides(d)
    per_epoch = float(over.get("progress_per_epoch", done / epoch if epoch else done))
    epochs = int(over.get("epochs", epoch + 1))
    if not (0 < per_epoch <= 1e15 and 1 <= epochs <= MAX_EPOCHS):
        raise StratagemError(f"progress per epoch {per_epoch:g} and {epochs} epochs (at most "
                             f"{MAX_EPOCHS})", where=str(path),
                             fix="set progress_per_epoch and epochs in profile.json")
    if not (1 <= base <= 1 << 24 and base <= max_batch <= 1 << 24):
        raise StratagemError(f"batch sizes {base} (base) and {max_batch} (max) out of range",
                             where=str(path), fix="batch sizes from 1 to 16777216")
    try:
        lo = int(over.get("min_local_bsz", lo or 1))
        hi = int(over.get("max_local_bsz", hi or max_batch))
    except (TypeError, ValueError, OverflowError):
        lo = hi = 0
    if not 1 <= lo <= hi <= 1 << 24:
        raise StratagemError("local batch size bounds out of range", where=str(path),
                             fix="1 <= min_local_bsz <= max_local_bsz <= 16777216")
    measured = {(r.num_nodes, r.num_replicas, r.local_bsz): r for r in records
                if r.accum_steps == 0}
    grid = np.unique(np.concatenate([np.geomspace(lo, hi, 12).round(),
                                     [k[2] for k in measured]]).astype(int))
    rows: list[Measurement] = []
    for nodes in range(1, 17):
        for per_node in range(1, 9):
            replicas = nodes * per_node
            for b in grid:
                r = measured.get((nodes, replicas, int(b)))
                step = r.step_time if r else float(predict_step_time(params, nodes, replicas, b))
                sync = (step - r.compute_time if r and r.compute_time
                        else float(predict_sync_time(params, nodes, replicas)))
                rows.append(Measurement(nodes, replicas, float(b), step, min(sync, step),
                                        (per_node,) * nodes))
    # GNSEstimate.var is per sample; the grad table keeps Pollux units (var at the base).
    sqr, var = float(grad["sqr_norm"]), float(grad["var"]) / base
    return AppProfile(
        name=d.name, steps=StepTimeTable(rows),
        grads=GradTable(np.array([float(base)]), np.array([[sqr]]), np.array([[var]])),
        epoch_ends=per_epoch * np.arange(1, epochs + 1, dtype=float),
        base_batch_size=int(over.get("base_batch_size", base)),
        max_batch_size=int(over.get("max_batch_size", max_batch)),
        min_local_bsz=lo, max_local_bsz=hi, records=records, fitted=params)


def load_profile(directory: str | Path) -> AppProfile:
    """A Pollux-format directory, or one holding a Stratagem ``hints.json``."""
    d = Path(directory)
    if (d / "placements.csv").is_file():
        return load_pollux_profile(d)
    if (d / "hints.json").is_file():
        return load_hints_profile(d)
    raise StratagemError("neither placements.csv nor hints.json found", where=str(d),
                         fix="one directory per application, named as in the workload")


def load_profiles(root: str | Path, names: Iterable[str] | None = None) -> dict[str, AppProfile]:
    """Every application directory under ``root`` (or only ``names``)."""
    r = Path(root)
    if not r.is_dir():
        raise StratagemError("profile directory not found", where=str(r),
                             fix="--profiles DIR with one subdirectory per application")
    wanted = sorted(set(names)) if names is not None else sorted(
        p.name for p in r.iterdir() if p.is_dir())
    missing = [n for n in wanted if not (r / n).is_dir()]
    if missing:
        raise StratagemError(f"no profile for application(s) {missing}", where=str(r),
                             fix="add a directory per application the workload names")
    return {n: load_profile(r / n) for n in wanted}

