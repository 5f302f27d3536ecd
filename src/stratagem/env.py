"""Every ``STRATAGEM_*`` and ``ADAPTDL_*`` environment variable, one accessor each.

The rest of the package reads the environment only through these functions (a test checks
that no other module names such a variable), so this file is the whole contract: what a
variable means, its default, and which older name still works. The launcher *writes* some
of them for its workers (:mod:`stratagem.launch.env`), using the names defined here.

Accessors read the environment at call time (nothing is cached), so a variable set by a
launcher, a test or an in-process rescale is seen at once.
"""

from __future__ import annotations

import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

from stratagem.errors import StratagemError

# -- names ------------------------------------------------------------------------------------
RESOURCE_SPEC = "STRATAGEM_RESOURCE_SPEC"
STRATEGY = "STRATAGEM_STRATEGY"
NODE_ADDRESS = "STRATAGEM_NODE_ADDRESS"
JOB_ID = "STRATAGEM_JOB_ID"
ROLE = "STRATAGEM_ROLE"
NPROC = "STRATAGEM_NPROC"
NODES = "STRATAGEM_NODES"
REMOTE_SHELL = "STRATAGEM_REMOTE_SHELL"
VERBOSE = "STRATAGEM_VERBOSE"
CHECKPOINT_DIR = "STRATAGEM_CHECKPOINT_DIR"
CHECKPOINT_STEPS = "STRATAGEM_CHECKPOINT_STEPS"
CHECKPOINT_SECONDS = "STRATAGEM_CHECKPOINT_SECONDS"
CHECKPOINT_ASYNC = "STRATAGEM_CHECKPOINT_ASYNC"
STOP_GRACE = "STRATAGEM_STOP_GRACE_S"
RESTART_COUNT = "STRATAGEM_RESTART_COUNT"
PG_TIMEOUT = "STRATAGEM_PG_TIMEOUT_S"
PEER_TIMEOUT = "STRATAGEM_PEER_TIMEOUT_S"
PS_TIMEOUT_DEPRECATED = "STRATAGEM_PS_TIMEOUT"  # the parameter server's older name
PS_PACE_BYTES = "STRATAGEM_PS_PACE_BYTES"
GLOO_YIELD = "STRATAGEM_GLOO_YIELD"
HINTS_FILE = "STRATAGEM_HINTS_FILE"
HINTS_PORT = "STRATAGEM_HINTS_PORT"
HINTS_ADDR = "STRATAGEM_HINTS_ADDR"
RESCALE_STORE = "STRATAGEM_RESCALE_STORE"
RESCALE_HOST = "STRATAGEM_RESCALE_HOST"
RESCALE_NPROC = "STRATAGEM_RESCALE_NPROC"
RESCALE_ID = "STRATAGEM_RESCALE_ID"
RESCALE_TIMEOUT = "STRATAGEM_RESCALE_TIMEOUT_S"
RESCALE_TOKEN = "STRATAGEM_RESCALE_TOKEN"
RUN_DIR = "STRATAGEM_RUN_DIR"
LOG_DIR = "STRATAGEM_LOG_DIR"
TENSORBOARD_DIR = "STRATAGEM_TENSORBOARD_DIR"
LOG_LEVEL = "STRATAGEM_LOG_LEVEL"
PROGRESS = "STRATAGEM_PROGRESS"
CLUSTER_DIR = "STRATAGEM_CLUSTER_DIR"

ADAPTDL_CHECKPOINT_PATH = "ADAPTDL_CHECKPOINT_PATH"
ADAPTDL_SHARE_PATH = "ADAPTDL_SHARE_PATH"
ADAPTDL_JOB_ID = "ADAPTDL_JOB_ID"
ADAPTDL_MASTER_ADDR = "ADAPTDL_MASTER_ADDR"
ADAPTDL_MASTER_PORT = "ADAPTDL_MASTER_PORT"
ADAPTDL_REPLICA_RANK = "ADAPTDL_REPLICA_RANK"
ADAPTDL_NUM_REPLICAS = "ADAPTDL_NUM_REPLICAS"
ADAPTDL_NUM_NODES = "ADAPTDL_NUM_NODES"
ADAPTDL_NUM_RESTARTS = "ADAPTDL_NUM_RESTARTS"
ADAPTDL_SUPERVISOR_URL = "ADAPTDL_SUPERVISOR_URL"
ADAPTDL_SCHED_VERSION = "ADAPTDL_SCHED_VERSION"

DEFAULT_PG_TIMEOUT_S = 300.0  # a collective that takes longer than this is a hang
DEFAULT_RESCALE_TIMEOUT_S = 300.0
DEFAULT_PEER_TIMEOUT_S = 10.0
DEFAULT_PS_PACE_BYTES = 2**20
MAX_TIMEOUT_S = 7 * 86400.0  # a week: longer is a typo (and near timedelta's/torch's limits)


# -- helpers ----------------------------------------------------------------------------------
def _first(*names: str) -> str | None:
    """The first of ``names`` that is set to a non-empty value."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _number(names: tuple[str, ...], default: float, kind: type = float) -> float:
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                number = kind(value)
            except ValueError:
                raise StratagemError(f"{name}={value!r} is not a number", where="environment",
                                     fix=f"set {name} to a {kind.__name__}, or unset it") from None
            if not math.isfinite(number):  # nan, inf and 1e309 parse as floats
                raise StratagemError(f"{name}={value!r} is not a finite number",
                                     where="environment",
                                     fix=f"set {name} to a finite {kind.__name__}, or unset it")
            return number
    return default


def _seconds(names: tuple[str, ...], default: float, *, zero: str | None = None) -> float:
    """A duration in seconds from the first of ``names`` that is set: finite, at most
    :data:`MAX_TIMEOUT_S`, and positive (or 0 when ``zero`` says what 0 means)."""
    value = _number(names, default)
    low = 0.0 if zero else math.nextafter(0.0, 1.0)
    if low <= value <= MAX_TIMEOUT_S:
        return value
    name = next((n for n in names if os.environ.get(n)), names[0])
    valid = (f"0 ({zero}) to {MAX_TIMEOUT_S:.0f}" if zero
             else f"more than 0 and at most {MAX_TIMEOUT_S:.0f}")
    raise StratagemError(f"{name}={os.environ.get(name)!r} is out of range",
                         where="environment",
                         fix=f"set {name} to seconds from {valid}, or unset it (default "
                             f"{default:g})")


def validate() -> None:
    """Read every numeric or path setting once, so that a bad value (``nan``, ``-1``,
    a blank directory) is a StratagemError naming it before any worker starts."""
    pg_timeout()
    peer_timeout()
    rescale_timeout()
    checkpoint_steps()
    checkpoint_seconds()
    checkpoint_dir()
    ps_pace_bytes()
    hints_port()


# -- launch contract --------------------------------------------------------------------------
def resource_spec_path() -> str | None:
    """``STRATAGEM_RESOURCE_SPEC``: the resource spec file (unset: this machine alone)."""
    return _first(RESOURCE_SPEC)


def strategy_override() -> str | None:
    """``STRATAGEM_STRATEGY``: builder name or strategy file from ``stratagem run
    --strategy``; it overrides the script's strategy."""
    return _first(STRATEGY)


def node_address() -> str | None:
    """``STRATAGEM_NODE_ADDRESS``: this node's address in the resource spec."""
    return _first(NODE_ADDRESS)


def job_nodes(world_size: int) -> int:
    """How many nodes a job of ``world_size`` workers started without a resource spec spans:
    ``WORLD_SIZE / LOCAL_WORLD_SIZE`` under torch elastic (``torchrun --nnodes 2``),
    ``ADAPTDL_NUM_NODES`` in an AdaptDL job, else 1 (this machine alone)."""
    per_node = int(_number(("LOCAL_WORLD_SIZE",), 0, int))
    if per_node > 0:
        return max(1, -(-world_size // per_node))
    if os.environ.get(ADAPTDL_NUM_REPLICAS) and os.environ.get(ADAPTDL_NUM_NODES):
        return max(1, min(world_size, int(_number((ADAPTDL_NUM_NODES,), 1, int))))
    return 1


def local_workers() -> int:
    """``LOCAL_WORLD_SIZE``: the workers torch elastic started on this machine (1 when
    unset): what shares this host's memory and cores with this one."""
    return max(1, int(_number(("LOCAL_WORLD_SIZE",), 1, int)))


def job_node_rank(rank: int, world_size: int, nodes: int) -> int:
    """This worker's node (0-based) in such a job: torch elastic's ``GROUP_RANK``, else the
    ranks split over the nodes in order (AdaptDL's replicas)."""
    group = int(_number(("GROUP_RANK",), -1, int))
    if 0 <= group < nodes and os.environ.get("LOCAL_WORLD_SIZE"):
        return group
    return min(nodes - 1, rank // -(-world_size // nodes))


def job_id() -> str | None:
    """``STRATAGEM_JOB_ID``: the job id (also torch elastic's rendezvous id)."""
    return _first(JOB_ID)


def role() -> str:
    """``STRATAGEM_ROLE``: ``server`` for a dedicated parameter server, else ``worker``."""
    return _first(ROLE) or "worker"


def nproc() -> str | None:
    """``STRATAGEM_NPROC``: the worker count ``stratagem run --nproc`` gave a single-node
    spec, as written (``launch.env.nproc_override`` checks it), so every worker applies the
    launcher's override to the spec it loads."""
    return _first(NPROC)


def remote_shell() -> str | None:
    """``STRATAGEM_REMOTE_SHELL``: the command prefix that runs a command on a node."""
    return _first(REMOTE_SHELL)


def verbose() -> bool:
    """``STRATAGEM_VERBOSE``: ``0`` silences Stratagem's progress messages (default on)."""
    return os.environ.get(VERBOSE, "1") != "0"


# -- process groups ---------------------------------------------------------------------------
def pg_timeout() -> timedelta:
    """``STRATAGEM_PG_TIMEOUT_S``: seconds a collective or a process-group rendezvous may
    take before it counts as a hang (default 300). ``STRATAGEM_PS_TIMEOUT`` is the older,
    deprecated name of the same setting."""
    if not os.environ.get(PG_TIMEOUT) and os.environ.get(PS_TIMEOUT_DEPRECATED):
        warnings.warn(f"{PS_TIMEOUT_DEPRECATED} is deprecated: use {PG_TIMEOUT}",
                      DeprecationWarning, stacklevel=2)
    return timedelta(seconds=_seconds((PG_TIMEOUT, PS_TIMEOUT_DEPRECATED),
                                      DEFAULT_PG_TIMEOUT_S))


def peer_timeout() -> float:
    """``STRATAGEM_PEER_TIMEOUT_S``: seconds without a heartbeat after which a rank of a job
    launched by torch elastic counts as lost and its peers leave their collective (default
    10; 0 disables, leaving only the process-group timeout)."""
    return _seconds((PEER_TIMEOUT,), DEFAULT_PEER_TIMEOUT_S, zero="disabled")


def ps_pace_bytes() -> int:
    """``STRATAGEM_PS_PACE_BYTES``: a dense parameter-server push of at least this many
    bytes per worker is received by its owner one worker at a time, so that pushes sent
    together do not overflow the owner's switch queue (default 1 MiB; 0 never paces)."""
    value = int(_number((PS_PACE_BYTES,), DEFAULT_PS_PACE_BYTES, int))
    if value < 0:
        raise StratagemError(f"{PS_PACE_BYTES}={value} is negative", where="environment",
                             fix=f"set {PS_PACE_BYTES} to bytes, e.g. 1048576, or 0 to never "
                                 "pace pushes")
    return value


# -- job state and hints ----------------------------------------------------------------------
def checkpoint_dir() -> Path | None:
    """``STRATAGEM_CHECKPOINT_DIR`` (else AdaptDL's ``ADAPTDL_CHECKPOINT_PATH``): the job's
    checkpoint directory; None disables checkpoint-restart."""
    for name in (CHECKPOINT_DIR, ADAPTDL_CHECKPOINT_PATH):
        value = os.environ.get(name)
        if value and not value.strip():  # '   ' would be a directory named by blanks
            raise StratagemError(f"{name}={value!r} is blank", where="environment",
                                 fix=f"set {name} to a directory, or unset it")
        if value:
            return Path(value)
    return None


def _positive_or_none(name: str, kind: type) -> float | None:
    value = _number((name,), 0, kind)  # finite (nan and inf are refused there)
    if value < 0:
        raise StratagemError(f"{name}={value} is negative", where="environment",
                             fix=f"set {name} to a positive finite number, or 0 / unset to "
                                 "disable")
    return value or None


def checkpoint_steps() -> int | None:
    """``STRATAGEM_CHECKPOINT_STEPS`` (``stratagem run --checkpoint-steps``): save the job
    state every this many training steps (with a checkpoint directory); None/0: only on
    SIGTERM and explicit saves. Bounds the steps a killed worker costs."""
    value = _positive_or_none(CHECKPOINT_STEPS, int)
    return int(value) if value else None


def checkpoint_seconds() -> float | None:
    """``STRATAGEM_CHECKPOINT_SECONDS`` (``stratagem run --checkpoint-seconds``): save the
    job state at the first step boundary after this many seconds since the last save
    (rank 0's clock decides); None/0: no time-based saves."""
    return _positive_or_none(CHECKPOINT_SECONDS, float)


def checkpoint_async() -> bool:
    """``STRATAGEM_CHECKPOINT_ASYNC`` (``stratagem run --checkpoint-sync`` sets ``0``):
    periodic checkpoints stall training only for an in-memory snapshot and are written in
    the background (default ``1``); ``0``: written synchronously, like every other save."""
    value = (_first(CHECKPOINT_ASYNC) or "1").lower()
    if value not in ("0", "1", "true", "false"):
        raise StratagemError(f"{CHECKPOINT_ASYNC}={value!r} is not 0 or 1",
                             where=CHECKPOINT_ASYNC, fix=f"set {CHECKPOINT_ASYNC} to 1 "
                                                         "(background writes) or 0")
    return value in ("1", "true")


MAX_STOP_GRACE_S = 86400.0


def stop_grace() -> float | None:
    """``STRATAGEM_STOP_GRACE_S`` (``stratagem run --stop-grace``): how long a stop (SIGTERM,
    Ctrl-C) waits for the workers to finish the save in flight and their stop save before
    they are killed; None (unset): derived from the job's last measured save
    (:func:`stratagem.launch.grace.stop_grace_s`)."""
    value = _first(STOP_GRACE)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_STOP_GRACE_S:  # also NaN
        raise StratagemError(f"{STOP_GRACE}={value!r} is not a number of seconds above 0 and "
                             f"at most {MAX_STOP_GRACE_S:g}", where=STOP_GRACE,
                             fix=f"set {STOP_GRACE} to e.g. 60, or unset it for the default "
                                 "(twice the last save plus a margin, at least 30 s)")
    return seconds


def nodes() -> str | None:
    """``STRATAGEM_NODES``: the comma-separated addresses of the spec's nodes that this
    attempt of a ``stratagem run --nnodes MIN:MAX`` job runs on, as written (unset: all of
    them); every worker applies it to the spec it loads (``ResourceSpec.subset``)."""
    return _first(NODES)


def restart_count() -> int:
    """``STRATAGEM_RESTART_COUNT``: how many times ``stratagem run --max-restarts`` has
    restarted this job before this attempt (0 on the first)."""
    return int(_number((RESTART_COUNT,), 0, int))


def run_dir() -> Path | None:
    """``STRATAGEM_RUN_DIR``, else the checkpoint directory: where rank 0 writes the run's
    ``metrics.jsonl`` (read by ``stratagem report``); None: no metrics file."""
    value = _first(RUN_DIR)
    return Path(value) if value else checkpoint_dir()


def log_dir() -> Path | None:
    """``STRATAGEM_LOG_DIR`` (``stratagem run --log-dir``): each worker writes its stdout and
    stderr to ``rank<R>.stdout.log``/``rank<R>.stderr.log`` there; only rank 0 also writes
    to the console."""
    value = _first(LOG_DIR)
    return Path(value) if value else None


def tensorboard_dir() -> Path | None:
    """``STRATAGEM_TENSORBOARD_DIR`` (``stratagem run --tensorboard``): rank 0 also writes
    every step's metrics as TensorBoard scalars there (skipped, with a warning, when the
    ``tensorboard`` package is not installed)."""
    value = _first(TENSORBOARD_DIR)
    return Path(value) if value else None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> str:
    """``STRATAGEM_LOG_LEVEL``: the ``stratagem`` logger's level, one of DEBUG, INFO
    (default), WARNING, ERROR (``stratagem run -v``/``-q`` set DEBUG/WARNING);
    ``STRATAGEM_VERBOSE=0`` without it means WARNING."""
    value = (_first(LOG_LEVEL) or ("INFO" if verbose() else "WARNING")).upper()
    if value not in LOG_LEVELS:
        raise StratagemError(f"{LOG_LEVEL}={value!r} is not a log level", where=LOG_LEVEL,
                             fix=f"use one of {', '.join(LOG_LEVELS)}")
    return value


GLOO_YIELD_MODES = ("off", "auto", "on")


def gloo_yield() -> str:
    """``STRATAGEM_GLOO_YIELD``: whether gloo's I/O threads yield the CPU while the main
    thread waits on them (:mod:`stratagem.distributed.gloo_threads`): ``off`` (default), ``auto``
    (when the process may run on one CPU only) or ``on``."""
    value = (_first(GLOO_YIELD) or "off").lower()
    if value not in GLOO_YIELD_MODES:
        raise StratagemError(f"{GLOO_YIELD}={value!r} is not a mode", where=GLOO_YIELD,
                             fix=f"use one of {', '.join(GLOO_YIELD_MODES)}")
    return value


PROGRESS_MODES = ("auto", "live", "plain", "off")


def progress() -> str:
    """``STRATAGEM_PROGRESS``: rank 0's progress display: ``auto`` (default: a live line on
    a terminal, plain periodic lines otherwise), ``live``, ``plain`` or ``off``."""
    value = (_first(PROGRESS) or "auto").lower()
    if value not in PROGRESS_MODES:
        raise StratagemError(f"{PROGRESS}={value!r} is not a progress mode", where=PROGRESS,
                             fix=f"use one of {', '.join(PROGRESS_MODES)}")
    return value


def hints_file() -> str | None:
    """``STRATAGEM_HINTS_FILE``: where the scheduling hints are written (see
    docs/reference/hints.md; unset: ``hints.json`` in the checkpoint directory)."""
    return _first(HINTS_FILE)


def hints_port() -> int | None:
    """``STRATAGEM_HINTS_PORT``: serve the hints over HTTP on this port (0: any free one;
    unset: no server); anything but a port number is a StratagemError."""
    value = os.environ.get(HINTS_PORT, "")
    if value == "":
        return None
    text = value.strip()
    if not text.isdigit() or int(text) > 65535:
        raise StratagemError(f"{HINTS_PORT}={value!r} is not a TCP port", where=HINTS_PORT,
                             fix="set it to a port number from 1 to 65535, 0 for any free "
                                 "port, or unset it to serve no hints over HTTP")
    return int(text)


def hints_addr() -> str:
    """``STRATAGEM_HINTS_ADDR``: the address the hints server binds (default loopback)."""
    return _first(HINTS_ADDR) or "127.0.0.1"


# -- in-process rescale -----------------------------------------------------------------------
def rescale_store() -> str | None:
    """``STRATAGEM_RESCALE_STORE``: ``host:port`` of the job's rescale store; set, it
    enables in-process rescale."""
    return _first(RESCALE_STORE)


def rescale_host() -> bool:
    """``STRATAGEM_RESCALE_HOST=1``: this worker hosts the rescale store itself."""
    return os.environ.get(RESCALE_HOST) == "1"


def rescale_nproc() -> int:
    """``STRATAGEM_RESCALE_NPROC``: workers of the first generation (default
    ``WORLD_SIZE``, else 1)."""
    return int(_number((RESCALE_NPROC, "WORLD_SIZE"), 1, int))


def rescale_id() -> str | None:
    """``STRATAGEM_RESCALE_ID``: this worker's member name (unset: ``hostname-pid``)."""
    return _first(RESCALE_ID)


def rescale_timeout() -> timedelta:
    """``STRATAGEM_RESCALE_TIMEOUT_S``: how long group formation and admission may wait
    (default 300)."""
    return timedelta(seconds=_seconds((RESCALE_TIMEOUT,), DEFAULT_RESCALE_TIMEOUT_S))


def rescale_token() -> str | None:
    """``STRATAGEM_RESCALE_TOKEN``: the shared secret a rescale store that listens beyond
    loopback requires (see ``python -m stratagem.elastic serve``)."""
    return _first(RESCALE_TOKEN)


# -- cluster service --------------------------------------------------------------------------
def cluster_dir() -> str | None:
    """``STRATAGEM_CLUSTER_DIR``: the cluster service's working directory (jobs, logs,
    ``state.db``; unset: ``~/.stratagem/cluster``)."""
    return _first(CLUSTER_DIR)


# -- AdaptDL's variables (AdaptDL's ``adaptdl.env``, with Stratagem's and torch's fallbacks) --
def adaptdl_checkpoint_path() -> str | None:
    """``ADAPTDL_CHECKPOINT_PATH``, else ``STRATAGEM_CHECKPOINT_DIR``."""
    return _first(ADAPTDL_CHECKPOINT_PATH, CHECKPOINT_DIR)


def adaptdl_share_path() -> str | None:
    """``ADAPTDL_SHARE_PATH``: a directory shared by all replicas, or None."""
    return _first(ADAPTDL_SHARE_PATH)


def adaptdl_job_id() -> str | None:
    """``ADAPTDL_JOB_ID``, else ``STRATAGEM_JOB_ID``, else ``TORCHELASTIC_RUN_ID``."""
    return _first(ADAPTDL_JOB_ID, JOB_ID, "TORCHELASTIC_RUN_ID")


def adaptdl_master_addr() -> str:
    """``ADAPTDL_MASTER_ADDR``, else ``MASTER_ADDR``, else ``0.0.0.0`` (as AdaptDL)."""
    return _first(ADAPTDL_MASTER_ADDR, "MASTER_ADDR") or "0.0.0.0"


def adaptdl_master_port() -> int:
    """``ADAPTDL_MASTER_PORT``, else ``MASTER_PORT``, else 0."""
    return int(_number((ADAPTDL_MASTER_PORT, "MASTER_PORT"), 0, int))


def adaptdl_rendezvous() -> bool:
    """Whether AdaptDL's own rendezvous is configured (``ADAPTDL_MASTER_ADDR`` or
    ``ADAPTDL_MASTER_PORT`` set)."""
    return _first(ADAPTDL_MASTER_ADDR, ADAPTDL_MASTER_PORT) is not None


def adaptdl_replica_rank() -> int:
    """``ADAPTDL_REPLICA_RANK``, else ``RANK``, else 0."""
    return int(_number((ADAPTDL_REPLICA_RANK, "RANK"), 0, int))


def adaptdl_num_replicas() -> int:
    """``ADAPTDL_NUM_REPLICAS``, else ``WORLD_SIZE``, else 1."""
    return int(_number((ADAPTDL_NUM_REPLICAS, "WORLD_SIZE"), 1, int))


def adaptdl_num_nodes() -> int:
    """``ADAPTDL_NUM_NODES``; under torch elastic, replicas divided by ``LOCAL_WORLD_SIZE``;
    else the number of replicas (AdaptDL's default)."""
    if os.environ.get(ADAPTDL_NUM_NODES):
        return int(_number((ADAPTDL_NUM_NODES,), 1, int))
    replicas = adaptdl_num_replicas()
    if not os.environ.get(ADAPTDL_NUM_REPLICAS) and os.environ.get("LOCAL_WORLD_SIZE"):
        per_node = max(1, int(_number(("LOCAL_WORLD_SIZE",), 1, int)))
        return max(1, -(-replicas // per_node))
    return replicas


def adaptdl_num_restarts() -> int:
    """``ADAPTDL_NUM_RESTARTS``, else ``TORCHELASTIC_RESTART_COUNT``, else 0."""
    return int(_number((ADAPTDL_NUM_RESTARTS, "TORCHELASTIC_RESTART_COUNT"), 0, int))


def adaptdl_supervisor_url() -> str | None:
    """``ADAPTDL_SUPERVISOR_URL`` (Stratagem runs without AdaptDL's supervisor)."""
    return _first(ADAPTDL_SUPERVISOR_URL)


def adaptdl_sched_version() -> str | None:
    """``ADAPTDL_SCHED_VERSION``."""
    return _first(ADAPTDL_SCHED_VERSION)
