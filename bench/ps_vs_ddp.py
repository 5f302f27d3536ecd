"""Parameter servers (Parallax, PartitionedPS) vs torch DDP on a virtual cluster at 1 Gbit/s.

Models (bench/models.py): a DLRM-style model with a 1M x 64 ``EmbeddingBag`` (Zipf ids), its
dense MLPs alone, and an LSTM language model with a 200k-word vocabulary. Per model, every
variant runs in the same worker processes, interleaved step by step (a random order per step), from
the same initial weights on the same batches:

* ``ddp_sparse``     torch DDP on gloo, embeddings ``sparse=True`` (the strong baseline)
* ``ddp_dense``      torch DDP, embeddings ``sparse=False`` (what NCCL users get); slow, so it
                     runs only ``--dense-steps`` steps (after ``--dense-warmup``)
* ``parallax``       Stratagem, Parallax builder (dense -> all-reduce, sparse -> PS)
* ``partitioned_ps`` Stratagem, PartitionedPS builder (everything on sharded PS)
* ``allreduce``      Stratagem, AllReduce builder (dense-only model)
* ``ddp``            torch DDP (dense-only model, reference)
* ``local``          the plain model, no synchronization (compute time reference)

Per variant: median step time (max over ranks per step: the synchronous job's step time),
bytes sent per step by each worker and in total (tx of the namespace's eth0, from
/proc/net/dev: headers included), and the ratio to the lower bound computed from each step's
ids: ``2 x unique rows of the global batch x row bytes`` (push + pull) plus the ring
all-reduce bound ``2 (n-1) x dense bytes`` for the dense parameters. A variant the engine
cannot run is reported as ``unavailable: <error>``. Needs root (the virtual cluster).

    python bench/ps_vs_ddp.py [--nodes 2 4] [--bandwidth 1gbit]   # -> bench/results/
    python bench/ps_vs_ddp.py --summary                            # markdown from the JSON
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from vcluster_host import pinned_cpus, virtual_cluster

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INDEX_BYTES = 8  # int64 row index of a sparse COO gradient
NO_SLOWER = 1.03  # "no slower" tolerates 3% timing noise, as in allreduce_vs_ddp.py


# ----------------------------------------------------------------------------- worker side
def _wire_tx(ifname: str) -> int:
    """Bytes sent so far by ``ifname`` in this network namespace."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() == ifname:
            return int(data.split()[8])
    return 0


def _tcp_retrans() -> int:
    """TCP segments retransmitted so far in this network namespace (/proc/net/snmp)."""
    lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines()
             if ln.startswith("Tcp:")]
    if len(lines) < 2 or "RetransSegs" not in lines[0]:
        return 0
    return int(lines[1][lines[0].index("RetransSegs")])


def _gather_json(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (JSON, not pickles: nothing unpickles network data)."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    longest = int(max(sizes).item())
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, torch.cat([data, torch.zeros(longest - data.numel(),
                                                       dtype=torch.uint8)]))
    return [json.loads(bytes(b[:int(n)].tolist())) for b, n in zip(bufs, sizes, strict=True)]


def step_order(items: list[Any], seed: int, step: int) -> list[Any]:
    """A fresh random order of ``items`` for every step, the same on every rank.

    A rotating order keeps the cyclic sequence, so each variant would nearly always follow
    the same predecessor and inherit its after-effects (measured: a 102 MB gloo all-reduce
    leaves the next large fresh allocation on that core 4-5x slower to fault in, which cost
    the variant after DDP ~100-300 ms per LSTM step). Random orders spread them evenly."""
    import random

    out = list(items)
    random.Random(seed * 1_000_003 + step).shuffle(out)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _drain(model: Any) -> None:
    """Finish a Stratagem model's pending PS traffic (the post-update value broadcast,
    which the next forward would wait for), so it counts in this step's window."""
    wait = getattr(model, "wait_for_values", None)
    if callable(wait):
        wait()


@dataclass
class Variant:
    """One way of training a model, with its measurements on this rank."""

    name: str
    model: Any = None
    opt: Any = None
    strategy: Any = None
    error: str | None = None
    warmup: int = 0
    total_steps: int | None = None  # None: every step of the phase
    times: list[float] = field(default_factory=list)
    tx: list[int] = field(default_factory=list)
    retrans: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    parts: list[tuple[float, ...]] = field(default_factory=list)  # see STEP_PARTS


STEP_PARTS = ("zero_grad", "forward", "backward", "optimizer_step", "wait_values")
SPARSE_VARIANTS = ("ddp_sparse", "ddp_dense", "parallax", "partitioned_ps", "local")
DENSE_VARIANTS = ("allreduce", "parallax", "ddp", "local")  # the dense-only model
VARIANTS = tuple(dict.fromkeys(SPARSE_VARIANTS + DENSE_VARIANTS))


@dataclass
class Phase:
    """A model and its variants, with the data and loss they share."""

    name: str
    make: Callable[[bool], Any]  # sparse -> fresh model (weights overwritten by the base)
    batches: Callable[[int], list[Any]]  # step -> one Batch per rank
    loss: Callable[[Any, Any], Any]
    variants: list[str]
    steps: int
    warmup: int
    table: str | None = None  # the sparse table's parameter name
    row_bytes: int = 0
    config: dict[str, Any] = field(default_factory=dict)


class Worker:
    """Runs the phases on one rank; rank 0 writes the JSON."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        import stratagem as sg

        torch.set_num_threads(1)
        if not dist.is_initialized():  # a short timeout: a broken variant fails, not hangs
            dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
        self.args = args
        self.ad = sg.AutoDist(verbose=False)
        self.rank, self.world = self.ad.rank, self.ad.world_size
        self.ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        self.agree_tx = 0

    # -- helpers --------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[ps_vs_ddp {self.world} nodes] {msg}", flush=True)

    def agree(self, failed: bool) -> bool:
        """True if any rank failed (also the end-of-step synchronization point)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if failed else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def calibrate(self) -> None:
        """Bytes one :meth:`agree` sends, subtracted from every measurement window."""
        import torch.distributed as dist

        samples = []
        for _ in range(20):
            dist.barrier()
            tx0 = _wire_tx(self.ifname)
            self.agree(False)
            samples.append(_wire_tx(self.ifname) - tx0)
        self.agree_tx = int(statistics.median(samples))

    def rank_of(self, device: str) -> int:
        devices = getattr(self.ad, "rank_devices", None) or list(self.ad.resource_spec.replicas)
        return devices.index(device) if device in devices else -1

    # -- building variants ----------------------------------------------------------------
    def build(self, phase: Phase, name: str, base_state: dict[str, Any]) -> Variant:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import stratagem as sg

        a = self.args
        v = Variant(name, warmup=phase.warmup)
        if name == "ddp_dense":
            v.warmup, v.total_steps = a.dense_warmup, a.dense_warmup + a.dense_steps
            if a.dense_steps == 0:
                v.error = "skipped (--dense-steps 0)"
                return v
        failed = False
        try:
            model = phase.make(name != "ddp_dense")
            model.load_state_dict(base_state)
            if name.startswith("ddp"):
                model = DDP(model)
                opt = torch.optim.SGD(model.parameters(), lr=a.lr)
            elif name == "local":
                opt = torch.optim.SGD(model.parameters(), lr=a.lr)
            else:
                builder = {"parallax": sg.strategy.Parallax(),
                           "partitioned_ps": sg.strategy.PartitionedPS(),
                           "allreduce": sg.strategy.AllReduce()}[name]
                opt = torch.optim.SGD(model.parameters(), lr=a.lr)
                model, v.strategy = self.stratagem(model, opt, builder)
            v.model, v.opt = model, opt
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            failed = True
            v.error = f"unavailable: {_first_line(exc)}"
            if a.verbose_errors:
                traceback.print_exc()
        if self.agree(failed) and not failed:
            v.error = "unavailable: failed on another rank"
        if v.error:
            v.model = v.opt = None
            self.log(f"{phase.name}/{name}: {v.error}")
        return v

    def stratagem(self, model: Any, opt: Any, builder: Any) -> tuple[Any, Any]:
        """(DistributedModel, strategy): the runtime API, as AutoDist.distribute uses it."""
        import inspect

        import torch

        import stratagem as sg
        from stratagem.runtime import DistributedModel, compile_plan

        spec = self.ad.resource_spec
        profile = sg.analyze(model)
        strategy = sg.strategy.validate(builder.build(profile, spec), profile, spec)
        plan = compile_plan(strategy, profile, rank=self.rank, world_size=self.world,
                            device=torch.device("cpu"))
        kwargs = {}
        if "optimizer" in inspect.signature(DistributedModel).parameters:
            kwargs["optimizer"] = opt  # the PS engine applies it at the owners
        return DistributedModel(model, plan, **kwargs), strategy

    # -- one phase ------------------------------------------------------------------------
    def run_phase(self, phase: Phase) -> dict[str, Any]:
        import torch

        self.log(f"{phase.name}: building {', '.join(phase.variants)}")
        torch.manual_seed(self.args.seed)
        base_state = phase.make(True).state_dict()
        names = [n for n in phase.variants
                 if not self.args.variants or n in self.args.variants]
        variants = [self.build(phase, n, base_state) for n in names]
        dense_bytes = sum(t.numel() * t.element_size() for k, t in base_state.items()
                          if k != phase.table)
        del base_state
        owners = {v.name: self.row_owners(v.strategy, phase) for v in variants
                  if v.strategy is not None and phase.table}
        bounds: dict[int, dict[str, Any]] = {}
        t_phase = time.perf_counter()
        for step in range(phase.warmup + phase.steps):
            batches = phase.batches(step)
            if phase.table:
                bounds[step] = self.bound_stats(batches, owners)
            active = [v for v in variants if v.error is None
                      and (v.total_steps is None or step < v.total_steps)]
            for v in step_order(active, self.args.seed, step):
                self.timed_step(v, step, batches[self.rank], phase)
            if step % 5 == 4 or step == phase.warmup + phase.steps - 1:
                self.log(f"{phase.name}: step {step + 1}/{phase.warmup + phase.steps} "
                         f"({time.perf_counter() - t_phase:.0f} s)")
        comm = {}  # the runtime's own counters (all steps, warm-up included), per step
        for v in variants:
            stats = getattr(v.model, "comm_stats", None) if v.error is None else None
            if stats is not None and getattr(stats, "steps", 0):
                comm[v.name] = {k: float(f"{x / stats.steps:.4g}")
                                for k, x in vars(stats).items() if k != "steps"}
        drift = self.param_drift(variants)
        result = self.gather(phase, variants, bounds, dense_bytes)
        if self.rank == 0:
            for name, d in drift.items():
                result["variants"][name][d[0]] = d[1]
            for name, c in comm.items():
                result["variants"][name]["comm_stats_per_step_rank0"] = c
        for v in variants:
            close = getattr(v.model, "close", None)
            if v.error is None and callable(close):  # DistributedModel: release PS state
                close()
            v.model = v.opt = None
        gc.collect()
        return result

    def param_drift(self, variants: list[Variant]) -> dict[str, tuple[str, float]]:
        """Max |parameter - reference's| after the run, for variants that ran every step
        (same init, data and SGD: they should agree up to float rounding)."""
        full = [v for v in variants if v.error is None and v.total_steps is None
                and v.name != "local"]
        ref = next((v for v in full if v.name in ("ddp_sparse", "ddp")), None)
        if ref is None:
            return {}

        def state(v: Variant) -> dict[str, Any]:
            refresh = getattr(v.model, "refresh_parameters", None)
            if callable(refresh):  # collective: PS copies are only fresh in pulled rows
                refresh()
            module = getattr(v.model, "module", v.model)
            return {k: t.detach() for k, t in module.state_dict().items()}

        ref_state = state(ref)
        out = {}
        for v in full:
            if v is ref:
                continue
            st = state(v)
            diff = max(float((st[k].float() - t.float()).abs().max()) for k, t in ref_state.items())
            out[v.name] = (f"param_max_abs_diff_vs_{ref.name}", float(f"{diff:.3g}"))
        return out

    def timed_step(self, v: Variant, step: int, batch: Any, phase: Phase) -> None:
        import torch.distributed as dist

        dist.barrier()
        tx0, re0 = _wire_tx(self.ifname), _tcp_retrans()
        t0 = time.perf_counter()
        error, loss = None, float("nan")
        try:
            v.opt.zero_grad(set_to_none=True)
            marks = [time.perf_counter()]
            out = phase.loss(v.model(*batch.inputs), batch.target)
            marks.append(time.perf_counter())
            out.backward()
            marks.append(time.perf_counter())
            v.opt.step()
            marks.append(time.perf_counter())
            _drain(v.model)
            marks.append(time.perf_counter())
            parts = tuple(b - a for a, b in itertools.pairwise([t0, *marks]))
            loss = float(out.detach())
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            error = f"failed at step {step}: {_first_line(exc)}"
            if self.args.verbose_errors:
                traceback.print_exc()
        elapsed = time.perf_counter() - t0
        if self.agree(error is not None):
            v.error = error or f"failed at step {step} on another rank"
            v.model = v.opt = None
            self.log(f"{phase.name}/{v.name}: {v.error}")
            return
        sent = _wire_tx(self.ifname) - tx0 - self.agree_tx
        if step >= v.warmup:
            v.times.append(elapsed)
            v.tx.append(max(0, sent))
            v.retrans.append(_tcp_retrans() - re0)
            v.losses.append(loss)
            v.steps.append(step)
            v.parts.append(parts)

    # -- lower bounds -----------------------------------------------------------------------
    def row_owners(self, strategy: Any, phase: Phase) -> tuple[Any, list[int]] | None:
        """(part boundaries, owner rank per part) of the sparse table, if a PS holds it."""
        import torch

        from stratagem.strategy.schema import PSSynchronizer

        nc = next((n for n in strategy.node_config if n.var_name == phase.table), None)
        if nc is None:
            return None
        if nc.partitioner is None:
            if not isinstance(nc.synchronizer, PSSynchronizer):
                return None
            return torch.empty(0, dtype=torch.long), [
                self.rank_of(nc.synchronizer.reduction_destination)]
        if nc.partitioner.axis != 0:
            return None
        sizes = nc.partitioner.part_sizes(tuple(phase.config["table_shape"]))
        bounds = torch.tensor(sizes).cumsum(0)[:-1]
        return bounds, [self.rank_of(p.synchronizer.reduction_destination)
                        for p in nc.part_config]

    def bound_stats(self, batches: list[Any], owners: dict[str, Any]) -> dict[str, Any]:
        """Unique rows of the global batch and per worker; rows each worker must move."""
        import torch

        uniq = [torch.unique(b.sparse_ids) for b in batches]
        out: dict[str, Any] = {
            "unique_rows_global": int(torch.unique(torch.cat(uniq)).numel()),
            "unique_rows_per_worker": [int(u.numel()) for u in uniq],
            "remote_rows": {},
        }
        for name, layout in owners.items():
            if layout is None:
                continue
            bounds, part_owner = layout
            owner_of = torch.tensor(part_owner)
            remote = 0
            for w, u in enumerate(uniq):
                owner = owner_of[torch.searchsorted(bounds, u, right=True)]
                remote += int((owner != w).sum())
            out["remote_rows"][name] = remote
        return out

    # -- results --------------------------------------------------------------------------
    def gather(self, phase: Phase, variants: list[Variant], bounds: dict[int, dict[str, Any]],
               dense_bytes: int) -> dict[str, Any]:

        mine = {v.name: (v.times, v.tx, v.retrans) for v in variants}
        every = _gather_json(mine, self.world)
        if self.rank != 0:
            return {}
        n, rb = self.world, phase.row_bytes
        dense_lb = 2 * (n - 1) * dense_bytes
        out: dict[str, Any] = {"config": {**phase.config, "dense_param_bytes": dense_bytes},
                               "variants": {}}
        ref = next((v for v in variants if v.name in ("ddp_sparse", "ddp") and v.losses), None)
        for v in variants:
            rec: dict[str, Any] = {"status": "ok" if v.error is None else v.error}
            if v.times:
                per_rank_t = [every[r][v.name][0] for r in range(n)]
                per_rank_tx = [every[r][v.name][1] for r in range(n)]
                job = [max(ts) for ts in zip(*per_rank_t, strict=True)]
                totals = [sum(xs) for xs in zip(*per_rank_tx, strict=True)]
                retrans = [sum(xs) for xs in zip(*(every[r][v.name][2] for r in range(n)),
                                                  strict=True)]
                rec.update({
                    "steps_measured": len(job),
                    "median_step_s": round(statistics.median(job), 5),
                    "median_step_s_rank0": round(statistics.median(per_rank_t[0]), 5),
                    "step_s": [round(t, 5) for t in job],
                    "tx_bytes_per_step": {
                        "per_worker_median": [int(statistics.median(x)) for x in per_rank_tx],
                        "total_median": int(statistics.median(totals)),
                    },
                    # TCP retransmissions (all ranks): drops at the shaped links' queues
                    "tcp_retrans_segs": {"total": sum(retrans),
                                         "steps_with_any": sum(1 for x in retrans if x)},
                    "loss_rank0": [round(x, 7) for x in v.losses],
                    # where rank 0's step goes (medians of each part, ms)
                    "parts_ms_rank0": {k: round(1e3 * statistics.median(
                        p[i] for p in v.parts), 2) for i, k in enumerate(STEP_PARTS)},
                })
                if phase.table and bounds and v.name != "local":
                    lb = [2 * bounds[s]["unique_rows_global"] * rb + dense_lb for s in v.steps]
                    ratios = [t / x for t, x in zip(totals, lb, strict=True)]
                    rec["actual_over_lower_bound"] = round(statistics.median(ratios), 4)
                    if all(v.name in bounds[s]["remote_rows"] for s in v.steps):
                        pb = [2 * bounds[s]["remote_rows"][v.name] * rb + dense_lb
                              for s in v.steps]
                        rec["actual_over_placement_bound"] = round(statistics.median(
                            t / x for t, x in zip(totals, pb, strict=True)), 4)
                if ref is not None and v is not ref and v.name != "local":
                    common = dict(zip(ref.steps, ref.losses, strict=True))
                    diffs = [abs(x - common[s]) for s, x in zip(v.steps, v.losses, strict=True)
                             if s in common]
                    if diffs:  # same init, data and SGD: trajectories should agree
                        rec[f"loss_max_abs_diff_vs_{ref.name}"] = float(f"{max(diffs):.3g}")
            out["variants"][v.name] = rec
        if phase.table and bounds:
            measured = [b for s, b in bounds.items() if s >= phase.warmup]
            out["bytes"] = self.byte_bounds(measured, rb, dense_lb)
        out["ratios"] = ratios_of(out["variants"])
        return out

    def byte_bounds(self, bounds: list[dict[str, Any]], rb: int, dense_lb: int
                    ) -> dict[str, Any]:
        n = self.world
        med = statistics.median
        sparse_lb = [2 * b["unique_rows_global"] * rb for b in bounds]
        local_sum = [sum(b["unique_rows_per_worker"]) for b in bounds]
        out: dict[str, Any] = {
            "row_bytes": rb,
            "unique_rows_global_median": int(med(b["unique_rows_global"] for b in bounds)),
            "unique_rows_per_worker_median": int(med(
                x for b in bounds for x in b["unique_rows_per_worker"])),
            "lower_bound_sparse_bytes": int(med(sparse_lb)),
            "lower_bound_dense_bytes": dense_lb,
            "lower_bound_bytes": int(med(x + dense_lb for x in sparse_lb)),
            # gloo's sparse all-reduce all-gathers each rank's coalesced (index, row) pairs;
            # a ring all-gather sends every rank's block n-1 times.
            "ddp_sparse_allgather_bytes": int(med(
                (n - 1) * s * (rb + INDEX_BYTES) for s in local_sum)),
            "placement_lower_bound_bytes": {},
        }
        names = {k for b in bounds for k in b["remote_rows"]}
        for name in sorted(names):
            out["placement_lower_bound_bytes"][name] = int(med(
                2 * b["remote_rows"][name] * rb + dense_lb for b in bounds))
        return out


def _med(variants: dict[str, Any], name: str) -> float | None:
    rec = variants.get(name) or {}
    return rec.get("median_step_s")


def ratios_of(variants: dict[str, Any]) -> dict[str, float | None]:
    pairs = [("parallax", "ddp_sparse"), ("partitioned_ps", "ddp_sparse"),
             ("ddp_dense", "parallax"), ("ddp_dense", "partitioned_ps"),
             ("ddp_dense", "ddp_sparse"), ("parallax", "allreduce"), ("allreduce", "ddp"),
             ("parallax", "ddp")]
    out: dict[str, float | None] = {}
    for a, b in pairs:
        if a in variants and b in variants:
            x, y = _med(variants, a), _med(variants, b)
            out[f"{a}_over_{b}"] = round(x / y, 4) if x and y else None
    return out


def phases(args: argparse.Namespace, world: int) -> list[Phase]:
    from models import (
        DLRM,
        LSTMLM,
        DenseMLP,
        DLRMConfig,
        DLRMData,
        LMConfig,
        LMData,
        bce_loss,
        ce_loss,
    )

    dcfg = DLRMConfig(bottom=tuple(args.dlrm_bottom), top=tuple(args.dlrm_top))
    ddata = DLRMData(dcfg, args.dlrm_batch, world, args.seed)
    mcfg = DLRMConfig(bottom=tuple(args.dense_bottom), top=tuple(args.dense_top))
    lcfg = LMConfig()
    ldata = LMData(lcfg, args.lm_batch, world, args.seed)
    dlrm_config = {"model": "DLRM", "table_shape": [dcfg.num_rows, dcfg.dim],
                   "fields": dcfg.fields, "pooling": dcfg.pooling, "zipf": dcfg.zipf,
                   "bottom_mlp": [dcfg.num_dense, *dcfg.bottom, dcfg.dim],
                   "top_mlp_hidden": list(dcfg.top), "local_batch": args.dlrm_batch,
                   "lookups_per_worker": args.dlrm_batch * dcfg.fields * dcfg.pooling}
    sparse_variants = list(SPARSE_VARIANTS)
    return [
        Phase("dense_only", lambda sparse: DenseMLP(mcfg),
              lambda s: ddata.batches(s, dense_only=True), bce_loss,
              list(DENSE_VARIANTS), args.steps, args.warmup,
              config={"model": "DenseMLP (DLRM bottom + top MLP, no embedding)",
                      "mlp": [mcfg.num_dense, *mcfg.bottom, mcfg.dim, *mcfg.top, 1],
                      "local_batch": args.dlrm_batch}),
        Phase("dlrm", lambda sparse: DLRM(dcfg, sparse), ddata.batches, bce_loss,
              sparse_variants, args.steps, args.warmup, table="embedding.weight",
              row_bytes=dcfg.dim * 4, config=dlrm_config),
        Phase("lstm_lm", lambda sparse: LSTMLM(lcfg, sparse), ldata.batches, ce_loss,
              sparse_variants, args.lm_steps, args.lm_warmup, table="embedding.weight",
              row_bytes=lcfg.emb * 4,
              config={"model": "LSTMLM", "table_shape": [lcfg.vocab, lcfg.emb],
                      "hidden": lcfg.hidden, "seq_len": lcfg.seq_len, "zipf": lcfg.zipf,
                      "softmax": f"sampled: targets + {lcfg.negatives} uniform negatives "
                                 "shared per batch; dense output-layer gradient",
                      "output_layer_bytes": lcfg.vocab * (lcfg.hidden + 1) * 4,
                      "local_batch": args.lm_batch}),
    ]


def worker(args: argparse.Namespace) -> None:
    w = Worker(args)
    w.calibrate()
    result: dict[str, Any] = {
        "benchmark": "ps_vs_ddp",
        "nodes": w.world,
        "workers_per_node": 1,
        "link_gbps": args.link_gbps,
        "delay": args.delay_text,
        "commit": args.commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"cpus": os.cpu_count(), "pinning": args.pinning, "torch_threads": 1,
                 "python": platform.python_version(),
                 "loadavg_1m_start": round(os.getloadavg()[0], 2)},
        "method": {
            "interleaved": "every variant in the same processes, a seeded random order per "
                           "step (the same on every rank)",
            "step_time": "median over measured steps of the max over ranks",
            "wire_bytes": "tx of eth0 (/proc/net/dev), headers included, minus the "
                          "end-of-step sync flag",
            "lower_bound": "2 x unique rows of the global batch x row bytes + "
                           "2 (n-1) x dense parameter bytes (ring all-reduce)",
            "placement_lower_bound": "2 x rows a worker touches but does not own under the "
                                     "strategy's shards x row bytes + dense bound",
            "optimizer": f"SGD lr={args.lr}",
        },
        "agree_tx_bytes": w.agree_tx,
        "models": {},
    }
    import torch

    result["torch"] = torch.__version__
    for phase in phases(args, w.world):
        if args.only and phase.name not in args.only:
            continue
        result["models"][phase.name] = w.run_phase(phase)
    if w.rank == 0:
        result["host"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        result["targets"] = targets(result)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(summary_markdown([result]), flush=True)


# ----------------------------------------------------------------------------- targets
def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    n = result["nodes"]
    models = result["models"]
    out: list[dict[str, Any]] = []

    def add(name: str, model: str, value: float | None, goal: str, ok: bool | None,
            why: str | None = None) -> None:
        rec: dict[str, Any] = {"target": name, "model": model, "goal": goal,
                               "value": value, "met": ok}
        if why:
            rec["note"] = why
        out.append(rec)

    def status(model: str, variant: str) -> str | None:
        rec = models.get(model, {}).get("variants", {}).get(variant)
        return None if rec and rec["status"] == "ok" else (rec or {}).get("status", "missing")

    for model in ("dlrm", "lstm_lm"):
        if model not in models:
            continue
        ratios = models[model]["ratios"]
        for ps in ("parallax", "partitioned_ps"):
            r = ratios.get(f"{ps}_over_ddp_sparse")
            goal = f"<= {NO_SLOWER} (no slower)" if n <= 2 else "< 1.0 (faster)"
            ok = None if r is None else (r <= NO_SLOWER if n <= 2 else r < 1.0)
            add(f"{ps} step time / ddp_sparse", model, r, goal, ok, status(model, ps))
            rec = models[model]["variants"].get(ps, {})
            b = rec.get("actual_over_lower_bound")
            add(f"{ps} wire bytes / lower bound", model, b, "<= 1.5",
                None if b is None else b <= 1.5, status(model, ps))
        if model == "dlrm":
            for ps in ("parallax", "partitioned_ps"):
                r = ratios.get(f"ddp_dense_over_{ps}")
                add(f"ddp_dense step time / {ps}", model, r, ">= 50",
                    None if r is None else r >= 50, status(model, ps))
    if "dense_only" in models:
        r = models["dense_only"]["ratios"].get("parallax_over_allreduce")
        add("parallax step time / allreduce", "dense_only", r, f"<= {NO_SLOWER} (no slower)",
            None if r is None else r <= NO_SLOWER, status("dense_only", "parallax"))
    return out


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if unit == "ms":
        return f"{x * 1e3:.1f}"
    if unit == "MB":
        return f"{x / 1e6:.2f}"
    return f"{x:g}"


def summary_markdown(results: list[dict[str, Any]]) -> str:
    """Markdown tables from result JSONs: per model and variant, then the targets."""
    lines: list[str] = []
    for res in sorted(results, key=lambda r: r["nodes"]):
        n = res["nodes"]
        host = res.get("host", {})
        lines.append(f"#### {n} nodes, {res['link_gbps']:g} Gbit/s (commit {res['commit']}, "
                     f"{res['date']}, load average {host.get('loadavg_1m_start')} -> "
                     f"{host.get('loadavg_1m_end')} on {host.get('cpus')} CPUs)\n")
        lines.append("| model | variant | status | median step (ms) | tx/step total (MB) | "
                     "tx/step per worker (MB) | bytes / lower bound |")
        lines.append("|---|---|---|---:|---:|---:|---:|")
        for model, m in res["models"].items():
            for name, v in m["variants"].items():
                tx = v.get("tx_bytes_per_step", {})
                per = tx.get("per_worker_median")
                state = "ok" if v["status"] == "ok" else v["status"][:100]
                lines.append(
                    f"| {model} | {name} | {state} | {_fmt(v.get('median_step_s'), 'ms')} | "
                    f"{_fmt(tx.get('total_median'), 'MB')} | "
                    f"{'/'.join(_fmt(p, 'MB') for p in per) if per else 'n/a'} | "
                    f"{_fmt(v.get('actual_over_lower_bound'))} |")
        lines.append("")
        for model, m in res["models"].items():
            if "bytes" in m:
                b = m["bytes"]
                place = ", ".join(f"{k} {_fmt(x, 'MB')} MB"
                                  for k, x in b["placement_lower_bound_bytes"].items())
                lines.append(
                    f"- {model}: unique rows/step {b['unique_rows_global_median']} global, "
                    f"{b['unique_rows_per_worker_median']} per worker; lower bound "
                    f"{_fmt(b['lower_bound_bytes'], 'MB')} MB (sparse "
                    f"{_fmt(b['lower_bound_sparse_bytes'], 'MB')} + dense "
                    f"{_fmt(b['lower_bound_dense_bytes'], 'MB')}); DDP-sparse all-gather "
                    f"{_fmt(b['ddp_sparse_allgather_bytes'], 'MB')} MB"
                    + (f"; placement-aware bound: {place}" if place else ""))
        lines.append("")
        lines.append("| target | model | goal | value | met |")
        lines.append("|---|---|---|---:|---|")
        for t in res.get("targets", []):
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            note = f" ({t['note'][:80]})" if t.get("note") and t["met"] is None else ""
            lines.append(f"| {t['target']} | {t['model']} | {t['goal']} | "
                         f"{_fmt(t['value'])} | {met}{note} |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver side
def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty-src" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def driver(args: argparse.Namespace) -> int:
    VirtualCluster = virtual_cluster()
    if VirtualCluster is None:
        return 0
    rc = 0
    commit = _commit()
    for nodes in args.nodes:
        cpus = pinned_cpus(nodes)
        out = Path(args.out_dir) / f"ps_vs_ddp_{nodes}nodes{args.tag}.json"
        with VirtualCluster(nodes, bandwidth=args.bandwidth, delay=args.delay, cpus=cpus,
                            prefix=args.prefix, subnet=args.subnet) as vc, \
                tempfile.TemporaryDirectory() as tmp:
            spec = vc.write_resource_spec(Path(tmp) / "spec.yml")
            shell = (f"{sys.executable} {ROOT / 'tools' / 'vcluster.py'} exec "
                     f"--prefix {args.prefix} {{address}} --")
            delay = f"{vc.delay_s * 1e6:g}us" + ("" if vc.delay_applied else " (not applied)")
            argv = [sys.executable, "-m", "stratagem", "run", "--resource-spec", str(spec),
                    "--remote-shell", shell, str(Path(__file__).resolve()), "--worker",
                    "--out", str(out.resolve()), "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--lm-steps", str(args.lm_steps),
                    "--lm-warmup", str(args.lm_warmup), "--dense-steps", str(args.dense_steps),
                    "--dense-warmup", str(args.dense_warmup), "--dlrm-batch",
                    str(args.dlrm_batch), "--lm-batch", str(args.lm_batch), "--lr", str(args.lr),
                    "--dlrm-bottom", *map(str, args.dlrm_bottom),
                    "--dlrm-top", *map(str, args.dlrm_top),
                    "--dense-bottom", *map(str, args.dense_bottom),
                    "--dense-top", *map(str, args.dense_top),
                    "--seed", str(args.seed), "--pg-timeout", str(args.pg_timeout),
                    "--link-gbps", str(vc.bandwidth_gbps or 0), "--delay-text", delay,
                    "--commit", commit, "--pinning", ":".join(",".join(map(str, c)) for c in cpus)]
            if args.only:
                argv += ["--only", *args.only]
            if args.variants:
                argv += ["--variants", *args.variants]
            if args.verbose_errors:
                argv.append("--verbose-errors")
            t0 = time.perf_counter()
            proc = vc.run(0, argv)
            try:
                code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                print(f"{nodes} nodes: timed out after {args.timeout} s", file=sys.stderr)
                code = 124
            print(f"{nodes} nodes: exit {code} after {time.perf_counter() - t0:.0f} s "
                  f"-> {out}", flush=True)
            rc = rc or code
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--summary", action="store_true", help="print markdown from the JSON results")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--prefix", default="sgpsd",
                   help="virtual cluster name prefix (its own, so other clusters survive)")
    p.add_argument("--subnet", default="10.79.0.0/24")
    p.add_argument("--steps", type=int, default=200, help="measured steps (DLRM, dense-only)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lm-steps", type=int, default=16, help="measured steps (LSTM LM)")
    p.add_argument("--lm-warmup", type=int, default=3)
    p.add_argument("--dense-steps", type=int, default=5, help="measured steps of ddp_dense")
    p.add_argument("--dense-warmup", type=int, default=1)
    p.add_argument("--dlrm-batch", type=int, default=256, help="per worker")
    p.add_argument("--lm-batch", type=int, default=32, help="sequences per worker")
    p.add_argument("--dlrm-bottom", type=int, nargs="+", default=[64],
                   help="DLRM bottom MLP hidden sizes (13 -> ... -> 64)")
    p.add_argument("--dlrm-top", type=int, nargs="+", default=[64],
                   help="DLRM top MLP hidden sizes (100 -> ... -> 1)")
    p.add_argument("--dense-bottom", type=int, nargs="+", default=[512, 256],
                   help="dense-only model: bottom MLP hidden sizes (13 -> ... -> 64)")
    p.add_argument("--dense-top", type=int, nargs="+", default=[512, 256],
                   help="dense-only model: top MLP hidden sizes (64 -> ... -> 1)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", choices=["dense_only", "dlrm", "lstm_lm"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS,
                   help="run only these variants (e.g. to profile)")
    p.add_argument("--pg-timeout", type=int, default=180, help="collective timeout (s)")
    p.add_argument("--timeout", type=int, default=900, help="per node count (s)")
    p.add_argument("--verbose-errors", action="store_true")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--tag", default="", help="file name suffix, e.g. _100mbit")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--link-gbps", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--delay-text", default="", help=argparse.SUPPRESS)
    p.add_argument("--commit", default="unknown", help=argparse.SUPPRESS)
    p.add_argument("--pinning", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.summary:
        files = sorted(Path(args.out_dir).glob(f"ps_vs_ddp_*nodes{args.tag}.json"))
        print(summary_markdown([json.loads(f.read_text()) for f in files]))
        return 0
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
