"""Job files: what a user submits to the cluster service, parsed into a frozen dataclass.

A job file is YAML (or the same mapping from Python)::

    name: mnist-a              # letters, digits, '-', '_' and '.'; unique in the cluster
    script: train.py           # a Stratagem training script (relative: to the job file)
    args: [--epochs, "5"]      # its arguments, a list of strings
    min_replicas: 1
    max_replicas: 4
    resources: {CPU: 1, GPU: 1}  # per replica; GPU means the cluster's accelerator resource
    strategy: auto             # a builder name or strategy file, or auto
    adaptive: true             # may the scheduler resize it (and the job pick its batch)
    checkpoint_dir: ckpt/a     # default: <cluster dir>/jobs/<name>/ckpt
    preemptible: true          # false: once running, never moved or stopped
    rescale: auto              # auto: in-process rescale where it applies; restart: never

Every problem raises :class:`StratagemError` naming the field and the fix. Nothing in a job
file reaches a shell: the script and arguments are passed to ``exec`` as a list.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.safeload import load_yaml, short

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
FIELDS = ("name", "script", "args", "min_replicas", "max_replicas", "resources", "strategy",
          "adaptive", "checkpoint_dir", "preemptible", "env", "rescale")
RESCALE_MODES = ("auto", "restart")
# strategies whose workers all-reduce (no parameter servers): in-process rescale applies
ALL_REDUCE_STRATEGIES = ("auto", "allreduce", "partitionedar", "randomaxispartitionar")
# ... and sharded ones (ZeRO 1-3: stage-3 units are gathered whole and sharded again)
IN_PROCESS_STRATEGIES = (*ALL_REDUCE_STRATEGIES, "zero")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_JOB_FILE_BYTES = 1 << 20  # what the control plane accepts in one request


@dataclass(frozen=True)
class JobSpec:
    """One submitted job (see the module doc for the fields)."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    min_replicas: int = 1
    max_replicas: int = 1
    resources: tuple[tuple[str, float], ...] = (("CPU", 1.0), ("GPU", 1.0))
    strategy: str = "auto"
    adaptive: bool = True
    checkpoint_dir: str | None = None
    preemptible: bool = True
    env: tuple[tuple[str, str], ...] = field(default=())
    rescale: str = "auto"

    @property
    def in_process_rescale(self) -> bool:
        """Whether a resize may use the in-process rescale: ``rescale: auto``, adaptive,
        and an all-reduce or ZeRO strategy (``auto`` is the script's own: the default Auto
        keeps to all-reduce and sharded strategies in an in-process elastic job;
        strategy files and parameter-server builders resize by checkpoint-restart)."""
        return (self.rescale == "auto" and self.adaptive
                and self.strategy.lower() in IN_PROCESS_STRATEGIES)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["args"] = list(self.args)
        d["resources"] = dict(self.resources)
        d["env"] = dict(self.env)
        return d


def _fail(where: str, key: str, problem: str, fix: str) -> StratagemError:
    return StratagemError(problem, where=f"{where}: field '{key}'", fix=fix)


def _int(data: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(where, key, f"must be a whole number >= 1, got {short(value)}",
                    f"write e.g. '{key}: 1'")
    return value


def _bool(data: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise _fail(where, key, f"must be true or false, got {short(value)}",
                    f"write '{key}: true' or '{key}: false'")
    return value


def parse_job(data: Any, where: str = "job", base_dir: str | Path | None = None) -> JobSpec:
    """A :class:`JobSpec` from a mapping; relative paths resolve against ``base_dir``."""
    if not isinstance(data, Mapping):
        raise StratagemError(f"a job file is a mapping of fields, got {type(data).__name__}",
                             where=where, fix="start with 'name: my-job' and 'script: x.py'")
    unknown = sorted(set(map(str, data)) - set(FIELDS))
    if unknown:
        raise _fail(where, unknown[0][:40], "unknown field",
                    f"remove it; the fields are: {', '.join(FIELDS)}")
    for key in ("name", "script"):
        if key not in data:
            raise _fail(where, key, "missing", f"add '{key}: ...' (required)")
    name = data["name"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _fail(where, "name", f"{short(name)} is not a valid job name",
                    "use 1-63 letters, digits, '-', '_' or '.', starting with a letter or "
                    "digit")
    script = data["script"]
    if not isinstance(script, str) or not script.strip():
        raise _fail(where, "script", f"must be a path to a Python script, got {short(script)}",
                    "write e.g. 'script: train.py'")
    path = Path(script)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    if not path.is_file():
        raise _fail(where, "script", f"{str(path)!r} does not exist",
                    "give the path of the training script (relative to the job file)")
    args = data.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str | int | float)
                                             and not isinstance(a, bool) for a in args):
        raise _fail(where, "args", f"must be a list of strings, got {short(args)}",
                    "write e.g. 'args: [--epochs, \"5\"]'")
    low = _int(data, "min_replicas", 1, where)
    high = _int(data, "max_replicas", low, where)
    if high < low:
        raise _fail(where, "max_replicas", f"{high} is below min_replicas {low}",
                    "make max_replicas >= min_replicas")
    res = data.get("resources", {"CPU": 1, "GPU": 1})
    if not isinstance(res, Mapping) or not res or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and v >= 0 for k, v in res.items()):
        raise _fail(where, "resources", f"must map resource names to amounts >= 0, got "
                    f"{short(res)}", "write e.g. 'resources: {CPU: 1, GPU: 1}'")
    strategy = data.get("strategy", "auto")
    if not isinstance(strategy, str) or not strategy:
        raise _fail(where, "strategy", f"must be a builder name, a file or auto, got "
                    f"{short(strategy)}", "write 'strategy: auto'")
    adaptive = _bool(data, "adaptive", True, where)
    if not adaptive and high != low:
        raise _fail(where, "max_replicas", "a non-adaptive job runs at one size",
                    "set max_replicas equal to min_replicas, or 'adaptive: true'")
    ckpt = data.get("checkpoint_dir")
    if ckpt is not None and (not isinstance(ckpt, str) or not ckpt):
        raise _fail(where, "checkpoint_dir", f"must be a directory path, got {short(ckpt)}",
                    "write e.g. 'checkpoint_dir: ckpt/my-job', or leave it out")
    if ckpt is not None and base_dir is not None and not Path(ckpt).is_absolute():
        ckpt = str(Path(base_dir) / ckpt)
    env = data.get("env", {})
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and ENV_NAME_RE.match(k) and isinstance(v, str | int | float)
            for k, v in env.items()):
        raise _fail(where, "env", f"must map variable names to values, got {short(env)}",
                    "write e.g. 'env: {OMP_NUM_THREADS: \"1\"}'")
    rescale = data.get("rescale", "auto")
    if rescale not in RESCALE_MODES:
        raise _fail(where, "rescale", f"must be one of {', '.join(RESCALE_MODES)}, got "
                    f"{short(rescale)}", "write 'rescale: auto' (in-process where it applies) or "
                    "'rescale: restart' (always checkpoint-restart)")
    return JobSpec(
        name=name, script=str(path.resolve()), args=tuple(str(a) for a in args),
        min_replicas=low, max_replicas=high,
        resources=tuple(sorted((k, float(v)) for k, v in res.items())),
        strategy=strategy, adaptive=adaptive,
        checkpoint_dir=str(Path(ckpt).resolve()) if ckpt else None,
        preemptible=_bool(data, "preemptible", True, where),
        env=tuple(sorted((k, str(v)) for k, v in env.items())), rescale=rescale)


def load_job_file(path: str | Path) -> JobSpec:
    """Read and check a YAML job file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise StratagemError(f"cannot read the job file: {exc.strerror}", where=str(p),
                             fix="give the path of an existing YAML job file") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise StratagemError(f"job file too large (over {MAX_JOB_FILE_BYTES} bytes)",
                             where=str(p), fix="a job file names a script and its settings; "
                             "put data in files the script reads")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StratagemError(f"not UTF-8 text (byte {exc.start})", where=str(p),
                             fix="save the job file as UTF-8") from None
    data = load_yaml(text, str(p), fix="check the indentation and quoting")
    return parse_job(data, where=str(p), base_dir=p.parent)


def spec_from_dict(d: Mapping[str, Any]) -> JobSpec:
    """The inverse of :meth:`JobSpec.to_dict` (stored specs; already checked)."""
    return JobSpec(name=d["name"], script=d["script"], args=tuple(d["args"]),
                   min_replicas=d["min_replicas"], max_replicas=d["max_replicas"],
                   resources=tuple(sorted(d["resources"].items())), strategy=d["strategy"],
                   adaptive=d["adaptive"], checkpoint_dir=d["checkpoint_dir"],
                   preemptible=d["preemptible"], env=tuple(sorted(d.get("env", {}).items())),
                   rescale=d.get("rescale", "auto"))
