"""The Strategy: an explicit, serializable, per-parameter distribution plan.

A strategy lists, for every trainable parameter, how its gradient is synchronized: by
all-reduce (with a group and a compressor), through a parameter server (with a reduction
destination and a consistency mode) or sharded across the workers (ZeRO stage 1-3),
optionally after partitioning the parameter along one axis into parts that each carry
their own synchronizer. It is plain data: builders produce it, people can write it by
hand, and the runtime compiles it per rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from stratagem.errors import StrategyError
from stratagem.safeload import MAX_BYTES, load_yaml

SCHEMA_VERSION = 1
ALL_REDUCE_SPECS = ("auto", "nccl", "gloo")
ENGINES = ("stratagem", "ddp")
"""Who executes an all-reduce synchronizer: Stratagem's own reducer (the default, what every
strategy without an ``engine`` field ran with) or torch's DistributedDataParallel reducer."""
# Upper bounds of the integer fields: far beyond any use, well inside int64.
MAX_STALENESS = 1_000_000
MAX_GROUP = 1_000_000
MAX_POWERSGD_RANK = 4096
MAX_PARTS = 1 << 20


@dataclass(frozen=True)
class AllReduceSynchronizer:
    """Average the gradient with a collective all-reduce.

    ``group``: parameters with the same group id are fused into one collective.
    ``spec``: the collective backend ("auto" picks nccl on GPU, gloo on CPU).
    ``compressor``: none, fp16, bf16 or powersgd (rank ``powersgd_rank``, error feedback).
    ``gather_rows``: for a sparse gradient (``nn.Embedding(sparse=True)``), all-gather each
    worker's rows (indices + values) and sum them on every worker, as DDP does, instead of
    summing the whole table densely; the optimizer then gets a sparse gradient, as in
    single-process training. One such parameter per group, uncompressed, unpartitioned.
    ``engine``: ``stratagem`` (this runtime's reducer) or ``ddp`` (torch's
    ``DistributedDataParallel`` reducer, its buckets cut at the groups' boundaries and its
    compression torch's own communication hooks; whole dense parameters only, and every
    all-reduce synchronizer of the model on one engine with one compressor).
    """

    kind: ClassVar[str] = "AllReduce"
    spec: str = "auto"
    compressor: str = "none"
    group: int = 0
    powersgd_rank: int = 1
    gather_rows: bool = False
    engine: str = "stratagem"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind, "spec": self.spec,
                             "compressor": self.compressor, "group": self.group}
        # Written whenever it differs from the default too, so to_dict -> from_dict is lossless.
        if self.compressor == "powersgd" or self.powersgd_rank != 1:
            d["powersgd_rank"] = self.powersgd_rank
        if self.gather_rows:  # written only when set: older readers keep parsing the rest
            d["gather_rows"] = True
        if self.engine != "stratagem":  # likewise: old files load as what they ran with
            d["engine"] = self.engine
        return d


@dataclass(frozen=True)
class PSSynchronizer:
    """Send the gradient to an owner that applies the update and serves the new value.

    ``reduction_destination``: a device string, either a worker replica (colocated, e.g.
    ``10.0.0.1:CPU:0``) or a dedicated server (``10.0.0.3:PS:0``).
    ``staleness``: how many steps a worker may run ahead (0 with ``sync`` = bulk-synchronous).
    ``row_sparse``: send the gradient as its non-zero rows (row indices + rows) even though
    the parameter is declared dense -- for a parameter whose gradient is row-sparse in
    practice (a sampled-softmax output layer, a table read with ``F.embedding``). Rows
    cannot be pulled on demand without an embedding module, so unless the parameter is an
    untied ``nn.Embedding`` weight this needs ``local_replication`` (the owner sends the
    updated rows to every worker).
    """

    kind: ClassVar[str] = "PS"
    reduction_destination: str = ""
    local_replication: bool = False
    sync: bool = True
    staleness: int = 0
    row_sparse: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind,
                             "reduction_destination": self.reduction_destination,
                             "local_replication": self.local_replication, "sync": self.sync,
                             "staleness": self.staleness}
        if self.row_sparse:  # written only when set: older readers keep parsing the rest
            d["row_sparse"] = True
        return d


MAX_PREFETCH = 16
SHARD_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ShardedSynchronizer:
    """Sharded data parallel (ZeRO): every worker holds a 1/world share of some state.

    ``stage`` 1: the optimizer state is sharded -- gradients are all-reduced, each worker
    updates the parameters it owns and sends their new values to the others. ``stage`` 2:
    the gradients too -- each is reduced to its owner alone and freed on the others during
    backward. ``stage`` 3: the parameters too -- torch's FSDP2 (``fully_shard``) keeps a
    1/world slice of each and gathers the ``unit`` module's parameters just in time for its
    forward and backward. ``unit``: the module sharded as one piece at stage 3 (e.g. one
    transformer block, ``blocks.0``); empty: the module the parameter belongs to; every
    trainable parameter under a unit must be sharded with the same options.
    ``reshard_after_forward`` (stage 3): free the gathered parameters after forward and
    gather them again for backward (less memory, one more all-gather). ``prefetch``
    (stage 3): how many following units to gather ahead during forward (0: none).
    See docs/concepts/sharding.md.
    """

    kind: ClassVar[str] = "Sharded"
    stage: int = 1
    unit: str = ""
    reshard_after_forward: bool = True
    prefetch: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "stage": self.stage, "unit": self.unit,
                "reshard_after_forward": self.reshard_after_forward, "prefetch": self.prefetch}


Synchronizer = AllReduceSynchronizer | PSSynchronizer | ShardedSynchronizer
_SYNC_TYPES: dict[str, type] = {"AllReduce": AllReduceSynchronizer, "PS": PSSynchronizer,
                                "Sharded": ShardedSynchronizer}


@dataclass(frozen=True)
class Partitioner:
    """Number of splits per axis, AutoDist style: ``"1,4"`` splits axis 1 into 4 parts.

    At most one axis may be split. ``sizes`` optionally gives uneven part lengths along it.
    """

    splits: tuple[int, ...]
    sizes: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, text: str, sizes: list[int] | None = None, where: str = "partitioner"
              ) -> Partitioner:
        try:
            if len(str(text)) > 200:
                raise ValueError("too long")
            splits = tuple(int(s) for s in str(text).split(","))
        except ValueError:
            raise StrategyError(f"cannot parse {text!r}", where=where,
                                fix='write splits per axis, e.g. "4,1" (4 parts along axis 0)'
                                ) from None
        if any(s < 1 for s in splits):
            raise StrategyError(f"split counts must be >= 1, got {text!r}", where=where,
                                fix='use 1 for unsplit axes, e.g. "4,1"')
        if sum(s > 1 for s in splits) > 1:
            raise StrategyError(f"more than one axis is split in {text!r}", where=where,
                                fix="split at most one axis")
        if max(splits) > MAX_PARTS:
            raise StrategyError(f"{max(splits)} parts in {text!r}", where=where,
                                fix=f"split into at most {MAX_PARTS} parts")
        return cls(splits=splits, sizes=tuple(sizes) if sizes else None)

    @property
    def axis(self) -> int:
        return next((i for i, s in enumerate(self.splits) if s > 1), 0)

    @property
    def num_parts(self) -> int:
        return max(self.splits) if self.splits else 1

    def part_sizes(self, shape: tuple[int, ...]) -> list[int]:
        """Lengths of the parts along :attr:`axis` (even split unless ``sizes`` given)."""
        if self.sizes:
            return list(self.sizes)
        n, k = shape[self.axis], self.num_parts
        return [n // k + (1 if i < n % k else 0) for i in range(k)]

    def __str__(self) -> str:
        return ",".join(str(s) for s in self.splits)


@dataclass(frozen=True)
class NodeConfig:
    """The plan for one parameter (or, inside ``part_config``, for one of its parts)."""

    var_name: str
    synchronizer: Synchronizer | None = None
    partitioner: Partitioner | None = None
    part_config: tuple[NodeConfig, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"var_name": self.var_name}
        if self.synchronizer is not None:
            d["synchronizer"] = self.synchronizer.to_dict()
        if self.partitioner is not None:
            d["partitioner"] = str(self.partitioner)
            if self.partitioner.sizes:
                d["part_sizes"] = list(self.partitioner.sizes)
            d["part_config"] = [p.to_dict() for p in self.part_config]
        return d

    def leaves(self) -> list[NodeConfig]:
        """The configs that carry synchronizers: the parts if partitioned, else self."""
        return list(self.part_config) if self.partitioner else [self]


@dataclass(frozen=True)
class GraphConfig:
    """Where the model is replicated: worker device strings in rank order."""

    replicas: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas)}


@dataclass(frozen=True)
class Strategy:
    """A complete plan: one :class:`NodeConfig` per trainable parameter plus the replicas.

    ``id`` is derived, not chosen: the first 12 hex digits of the SHA-256 of the canonical
    content (:func:`content_id`), so the same plan has the same id in every run and on every
    machine, and an edit of the plan changes it. The builder's name is a label, not content.
    """

    node_config: tuple[NodeConfig, ...]
    graph_config: GraphConfig = field(default_factory=GraphConfig)
    builder: str = "manual"
    id: str = field(init=False, compare=False)
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", content_id(self))

    # A Strategy is also a builder of itself, so a loaded one can be passed wherever a
    # builder is expected.
    def build(self, profile: Any, spec: Any) -> Strategy:
        return self

    @property
    def name(self) -> str:
        return self.builder

    @property
    def server_parameters(self) -> list[str]:
        """Parameters (some piece of them) synchronized by parameter servers."""
        return sorted(nc.var_name for nc in self.node_config
                      if any(isinstance(leaf.synchronizer, PSSynchronizer)
                             for leaf in nc.leaves()))

    @property
    def sharded_parameters(self) -> list[str]:
        """Parameters with a :class:`ShardedSynchronizer` (ZeRO stage 1, 2 or 3)."""
        return sorted(nc.var_name for nc in self.node_config
                      if isinstance(nc.synchronizer, ShardedSynchronizer))

    def config_for(self, var_name: str) -> NodeConfig:
        for nc in self.node_config:
            if nc.var_name == var_name:
                return nc
        raise KeyError(var_name)

    def with_replicas(self, replicas: list[str]) -> Strategy:
        return replace(self, graph_config=GraphConfig(tuple(replicas)))

    # -- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "id": self.id, "builder": self.builder,
                "graph_config": self.graph_config.to_dict(),
                "node_config": [nc.to_dict() for nc in self.node_config]}

    @classmethod
    def from_dict(cls, data: Any, source: str = "<strategy>") -> Strategy:
        return _StrategyParser(source).strategy(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write JSON, or YAML when the file name ends in .yml/.yaml."""
        p = Path(path)
        text = self.to_yaml() if p.suffix in (".yml", ".yaml") else self.to_json()
        p.write_text(text)
        return p

    @classmethod
    def load(cls, path: str | Path) -> Strategy:
        p = Path(path)
        if not p.is_file():
            raise StrategyError("file not found", where=str(p),
                                fix="pass the path of a strategy saved with Strategy.save")
        fix = "fix the syntax or re-save it with Strategy.save"
        if p.stat().st_size > MAX_BYTES:
            raise StrategyError(f"file too large ({p.stat().st_size} bytes)", where=str(p),
                                fix=fix)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise StrategyError(f"cannot read the file: {exc}", where=str(p), fix=fix) from None
        data = load_yaml(text, str(p), StrategyError, fix)  # YAML is a superset of JSON
        return cls.from_dict(data, source=str(p))

    def canonical(self) -> dict[str, Any]:
        """What the strategy does, without its labels (id, builder): the replicas and every
        parameter's synchronizers, in a form that serializes the same way everywhere."""
        return {"version": self.version, "graph_config": self.graph_config.to_dict(),
                "node_config": [nc.to_dict() for nc in self.node_config]}

    def summary(self) -> str:
        """A human-readable table: parameter, synchronizer, partition."""
        lines = [f"strategy {self.id} (builder {self.builder}, "
                 f"{len(self.graph_config.replicas)} replicas)"]
        for nc in self.node_config:
            if nc.partitioner:
                parts = "; ".join(sync_text(p.synchronizer) for p in nc.part_config)
                lines.append(f"  {nc.var_name}: partitioned {nc.partitioner} -> {parts}")
            else:
                lines.append(f"  {nc.var_name}: {sync_text(nc.synchronizer)}")
        return "\n".join(lines)


def content_id(strategy: Strategy) -> str:
    """The strategy's id: a hash of :meth:`Strategy.canonical` (keys sorted, no spaces)."""
    text = json.dumps(strategy.canonical(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def sync_text(s: Synchronizer | None) -> str:
    """One synchronizer in a line, as the summaries and the differences print it."""
    if isinstance(s, AllReduceSynchronizer):
        if s.gather_rows:
            return f"AllReduce(group={s.group}, gather_rows)"
        rank = f", rank={s.powersgd_rank}" if s.compressor == "powersgd" else ""
        spec = "" if s.spec == "auto" else f", spec={s.spec}"
        engine = f", engine={s.engine}" if s.engine != "stratagem" else ""
        return f"AllReduce(group={s.group}, compressor={s.compressor}{rank}{spec}{engine})"
    if isinstance(s, PSSynchronizer):
        mode = "async" if not s.sync else f"staleness={s.staleness}"
        rows = ", rows" if s.row_sparse else ""
        copy = ", replicated" if s.local_replication else ""
        return f"PS(dest={s.reduction_destination}, {mode}{rows}{copy})"
    if isinstance(s, ShardedSynchronizer):
        if s.stage == 3:
            return (f"Sharded(stage=3, unit={s.unit or '(own module)'}, "
                    f"reshard_after_forward={s.reshard_after_forward}, prefetch={s.prefetch})")
        return f"Sharded(stage={s.stage})"
    return "none"


class _StrategyParser:
    """Strict parsing: unknown fields and wrong types are errors naming the path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, fix: str) -> StrategyError:
        return StrategyError(problem, where=f"{self.source}: {where}", fix=fix)

    def keys(self, where: str, data: dict, allowed: tuple[str, ...]) -> None:
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise self.fail(f"{where}.{unknown[0]}", "unknown field",
                            f"allowed fields are {', '.join(allowed)}")

    def mapping(self, where: str, data: Any) -> dict:
        if not isinstance(data, dict):
            raise self.fail(where, f"expected a mapping, got {type(data).__name__}",
                            "see docs/reference/strategy-schema.md")
        return data

    def strategy(self, data: Any) -> Strategy:
        data = self.mapping("(top level)", data)
        self.keys("(top level)", data, ("version", "id", "builder", "graph_config",
                                        "node_config"))
        version = data.get("version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise self.fail("version", f"unsupported schema version {version!r}",
                            f"this Stratagem reads version {SCHEMA_VERSION}; re-save the "
                            "strategy with a matching release")
        graph = self.mapping("graph_config", data.get("graph_config", {}))
        self.keys("graph_config", graph, ("replicas",))
        replicas = graph.get("replicas", [])
        if not isinstance(replicas, list) or not all(isinstance(r, str) for r in replicas):
            raise self.fail("graph_config.replicas", "expected a list of device strings",
                            'e.g. ["10.0.0.1:GPU:0", "10.0.0.2:GPU:0"]')
        raw_nodes = data.get("node_config")
        if not isinstance(raw_nodes, list):
            raise self.fail("node_config", "expected a list of per-parameter configs",
                            "add one entry per trainable parameter")
        nodes = tuple(self.node(f"node_config[{i}]", n) for i, n in enumerate(raw_nodes))
        for key in ("id", "builder"):
            if key in data and not isinstance(data[key], (str, int)):
                raise self.fail(key, f"expected a string, got {type(data[key]).__name__}",
                                f"write {key} as a short name")
        # A written ``id`` is read and not kept: the id is the content's hash, so a file of
        # an older release (random ids) or a hand-edited one gets the id of what it says.
        return Strategy(node_config=nodes, graph_config=GraphConfig(tuple(replicas)),
                        builder=str(data.get("builder", "manual")))

    def node(self, where: str, data: Any, in_part: bool = False) -> NodeConfig:
        data = self.mapping(where, data)
        self.keys(where, data, ("var_name", "synchronizer", "partitioner", "part_sizes",
                                "part_config"))
        name = data.get("var_name")
        if not isinstance(name, str) or not name:
            raise self.fail(f"{where}.var_name", "missing or not a string",
                            "name the parameter as model.named_parameters() does")
        sync = self.synchronizer(f"{where}.synchronizer", data["synchronizer"]) \
            if data.get("synchronizer") is not None else None
        part = None
        parts: tuple[NodeConfig, ...] = ()
        if data.get("partitioner") is not None:
            if in_part:  # refused here, not only by validate: nesting would recurse unbounded
                raise self.fail(f"{where}.partitioner", "nested partitioning",
                                "partition the parameter once")
            sizes = data.get("part_sizes")
            if sizes is not None and not (isinstance(sizes, list) and all(
                    isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
                raise self.fail(f"{where}.part_sizes", f"expected a list of integers, got "
                                f"{sizes!r}", "give one length per part, e.g. [3, 2]")
            part = Partitioner.parse(data["partitioner"], sizes,
                                     where=f"{self.source}: {where}.partitioner")
            raw_parts = data.get("part_config") or []
            if not isinstance(raw_parts, list):
                raise self.fail(f"{where}.part_config", "expected a list",
                                "give one config per part")
            parts = tuple(self.node(f"{where}.part_config[{i}]", p, in_part=True)
                          for i, p in enumerate(raw_parts))
        elif data.get("part_config") is not None or data.get("part_sizes") is not None:
            key = "part_config" if data.get("part_config") is not None else "part_sizes"
            raise self.fail(f"{where}.{key}", "given without a partitioner",
                            'add a partitioner, e.g. "2,1", or remove it')
        elif sync is None:
            raise self.fail(where, f"parameter {name!r} has neither a synchronizer nor a "
                            "partitioner", "add a synchronizer, e.g. {type: AllReduce}")
        return NodeConfig(var_name=name, synchronizer=sync, partitioner=part, part_config=parts)

    def synchronizer(self, where: str, data: Any) -> Synchronizer:
        data = self.mapping(where, data)
        kind = data.get("type")
        if not isinstance(kind, str) or kind not in _SYNC_TYPES:
            raise self.fail(f"{where}.type", f"unknown synchronizer type {kind!r}",
                            f"use one of {', '.join(_SYNC_TYPES)}")
        cls = _SYNC_TYPES[kind]
        fields = tuple(f for f in cls.__dataclass_fields__ if f != "kind")
        self.keys(where, data, ("type", *fields))
        values = {k: v for k, v in data.items() if k != "type"}
        defaults = cls()
        for k, v in values.items():
            expected = type(getattr(defaults, k))
            if not isinstance(v, expected) or (expected is int and isinstance(v, bool)):
                raise self.fail(f"{where}.{k}", f"expected {expected.__name__}, got {v!r}"[:200],
                                f"write {k} as a {expected.__name__}")
            limit = _INT_LIMITS.get(k)
            if limit is not None and v > limit:
                raise self.fail(f"{where}.{k}", f"{k} {v} is too large"[:200],
                                f"use at most {limit}")
        return cls(**values)


_INT_LIMITS = {"staleness": MAX_STALENESS, "group": MAX_GROUP,
               "powersgd_rank": MAX_POWERSGD_RANK, "stage": max(SHARD_STAGES),
               "prefetch": MAX_PREFETCH}
