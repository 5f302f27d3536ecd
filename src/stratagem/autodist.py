"""AutoDist: the user-facing entry point that turns a single-device script distributed.

It reads the resource spec, joins the process group that the launcher (``stratagem run``
or plain ``torchrun``) prepared, builds and validates a strategy for the model, compiles it
for this rank and wraps the model. With one process it does no communication at all.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem import checkpoint, elastic, env
from stratagem.adapt.loop import AdaptiveTrainer, TrainerConfig
from stratagem.adapt.step_metrics import StepRecorder
from stratagem.analysis import ModelProfile, analyze
from stratagem.data import DistributedDataLoader
from stratagem.distributed.process_group import (
    broadcast_bytes,
    comm_device,
    default_backend,
    init_process_group,
)
from stratagem.errors import StratagemError, install_excepthook
from stratagem.launch.env import active_nodes, nproc_override
from stratagem.observe import MetricsFile, ProgressDisplay, logger
from stratagem.planner import Choice, choose, explain_text
from stratagem.planner.memory import check_rescale_fits
from stratagem.resource import ResourceSpec
from stratagem.runtime import DistributedModel, compile_plan
from stratagem.runtime.ps import Cluster, join_cluster, run_server
from stratagem.runtime.ps.optim import sparse_class
from stratagem.runtime.skeleton import skeleton
from stratagem.strategy import (
    AllReduce,
    Auto,
    Strategy,
    StrategyBuilder,
    resolve_builder,
    validate,
)
from stratagem.strategy.diff import differences
from stratagem.strategy.validate import server_devices

ENV_SPEC = env.RESOURCE_SPEC
ENV_STRATEGY = env.STRATEGY

__all__ = ["AutoDist", "PlanOnly", "plan_only", "resolve_builder"]


_PLAN_ONLY: list[tuple[ResourceSpec, str | None]] = []


class PlanOnly(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by :meth:`AutoDist.distribute` under :func:`plan_only` once the strategy is
    built: the script stops there and the caller reads ``autodist``."""

    def __init__(self, autodist: AutoDist) -> None:
        super().__init__("strategy built (plan only)")
        self.autodist = autodist


@contextlib.contextmanager
def plan_only(spec: ResourceSpec, strategy: str | None = None) -> Iterator[None]:
    """Within it, AutoDist plans for ``spec`` as its rank 0 without joining any group, and
    ``distribute`` raises :class:`PlanOnly` (``stratagem plan SCRIPT``); ``strategy``
    overrides the script's builder."""
    _PLAN_ONLY.append((spec, strategy))
    try:
        yield
    finally:
        _PLAN_ONLY.pop()


def _rows_allowed(model: nn.Module, optimizer: Any) -> bool:
    """Whether the optimizer has a sparse rule for every parameter (PS rows need one)."""
    if optimizer is None:
        return True
    for group in optimizer.param_groups:
        try:
            sparse_class(optimizer, group, "Auto")
        except StratagemError:
            return False
    return True


def _env_int(name: str, default: int) -> int:
    """torch elastic's RANK/WORLD_SIZE/LOCAL_RANK (not Stratagem's own variables)."""
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class AutoDist:
    """Distribute a single-device model and optimizer according to a strategy.

    ``resource_spec_file`` (or env STRATAGEM_RESOURCE_SPEC) describes the machines; without
    one, this machine with the launched number of workers. ``strategy_builder`` is a builder,
    a Strategy, a builder name or a strategy file; ``stratagem run --strategy`` overrides it.
    """

    def __init__(self, resource_spec_file: str | os.PathLike[str] | None = None,
                 strategy_builder: StrategyBuilder | Strategy | str | None = None, *,
                 resource_spec: ResourceSpec | None = None, seed: int = 0,
                 verbose: bool = True) -> None:
        install_excepthook()
        if _PLAN_ONLY:  # `stratagem plan SCRIPT`: build the strategy, join nothing
            self._plan_only(_PLAN_ONLY[-1], strategy_builder, seed)
            return
        # In-process elastic jobs (STRATAGEM_RESCALE_STORE): join the group, set RANK etc.
        self.elastic_group: elastic.ElasticGroup | None = elastic.join_job()
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.seed = seed
        self.verbose = verbose
        self.resource_spec = self._load_spec(resource_spec_file, resource_spec)
        override = env.strategy_override()
        if override and strategy_builder is not None and self.rank == 0 and verbose:
            print(f"stratagem: --strategy {override} overrides the script's strategy",
                  file=sys.stderr)
        self._builder = resolve_builder(override or strategy_builder)
        self.device = self._pick_device()
        self.cluster: Cluster | None = None  # parameter-server layout, when the job has servers
        self.role = "worker"
        self._init_process_group()
        self.rank_devices = self._discover_rank_devices()
        self.strategy: Strategy | None = None
        self.profile: ModelProfile | None = None
        self.model: DistributedModel | None = None
        self.choice: Choice | None = None  # the planner's choice, when the builder is Auto
        self._plan_pending = False  # Auto plans on the first training batch (see distribute)
        self._saved_strategy: dict[str, Any] | None = None  # the checkpoint's strategy
        self._kept_strategy = False  # resumed with the checkpoint's strategy, not planned
        self.optimizer: torch.optim.Optimizer | None = None
        self.adaptive: AdaptiveTrainer | None = None  # the adaptive loop, once distributed
        # Fully built: follow in-process rescales (the lifecycle calls back, see below).
        elastic.current_job().add_participant(self)

    # -- set-up -------------------------------------------------------------------------
    def _plan_only(self, plan: tuple[ResourceSpec, str | None], builder: Any,
                   seed: int) -> None:
        """Rank 0 of the spec's job as far as choosing a strategy needs: no process group,
        no job context; ``distribute`` raises :class:`PlanOnly` once it has the strategy."""
        spec, override = plan
        self.elastic_group = None
        self.rank, self.local_rank, self.world_size = 0, 0, spec.num_workers
        self.seed, self.verbose = seed, False
        self.resource_spec = spec
        self._builder = resolve_builder(override or builder)
        self.device = torch.device("cpu")
        self.cluster, self.role = None, "worker"
        self.rank_devices = list(spec.replicas)
        self.strategy, self.profile, self.model = None, None, None
        self.choice, self.optimizer, self.adaptive = None, None, None
        self._plan_pending, self._saved_strategy = False, None
        self._kept_strategy = False

    def _load_spec(self, path: Any, spec: ResourceSpec | None) -> ResourceSpec:
        if spec is None:
            path = path or env.resource_spec_path()
            spec = (ResourceSpec.from_file(path) if path else
                    ResourceSpec.of_job(self.world_size, env.job_nodes(self.world_size)))
            nproc = nproc_override()  # `stratagem run --nproc N` with a single-node spec
            if path and nproc is not None and spec.is_local:
                spec = spec.with_local_workers(nproc)
            active = active_nodes()  # `stratagem run --nnodes MIN:MAX`: the reachable nodes
            if path and active is not None:
                spec = spec.subset(active)
        if server_devices(spec) and self.world_size == spec.num_workers + len(
                server_devices(spec)):
            return spec  # the spec's dedicated parameter servers run in this job too
        if spec.num_workers != self.world_size:
            if self.world_size == 1:
                warnings.warn(
                    f"the resource spec {spec.source} has {spec.num_workers} workers but this "
                    "is a single process; training on this machine alone (launch with "
                    "`stratagem run --resource-spec` to use the spec)", stacklevel=3)
                return ResourceSpec.local(1)
            raise StratagemError(
                f"the resource spec has {spec.num_workers} workers but {self.world_size} "
                "processes were launched", where=spec.source,
                fix="launch with `stratagem run --resource-spec FILE`, or make torchrun's "
                    "--nnodes x --nproc-per-node match the spec")
        return spec

    def _pick_device(self) -> torch.device:
        """This worker's spec GPU (``gpus: [2, 3]``: local rank 1 -> ``cuda:3``), else CPU."""
        if self.resource_spec.uses_gpus and torch.cuda.is_available():
            gpu = self.resource_spec.gpu_for(env.node_address(),
                                             self.local_rank)
            index = self.local_rank if gpu is None else gpu  # unknown node: torchrun's way
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _discover_rank_devices(self) -> list[str]:
        """The spec device string of every rank (index = rank).

        torch elastic orders ranks by node address, not by the spec, so each rank reports its
        node (STRATAGEM_NODE_ADDRESS, set by the launcher) and local rank to the others.
        """
        spec = self.resource_spec
        if self.cluster is not None:  # logical ranks: the workers in replica order
            return list(spec.replicas)
        if self.world_size == 1:
            return spec.replicas[:1]
        addresses = [n.address for n in spec.nodes]
        mine = env.node_address()
        if mine in addresses:
            node = addresses.index(mine)
        elif spec.is_local:
            node = 0
        elif spec.of_this_job:
            # no spec given, several nodes: torch elastic's group rank says which
            node = env.job_node_rank(self.rank, self.world_size, len(spec.nodes))
        else:
            node = -1
        local = torch.tensor([node, self.local_rank], dtype=torch.int64, device=comm_device())
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        pairs = [tuple(int(v) for v in t.tolist()) for t in gathered]
        if any(n < 0 for n, _ in pairs):
            raise StratagemError(
                "cannot tell which node of the resource spec each rank runs on",
                where=spec.source,
                fix="launch with `stratagem run --resource-spec`, or export "
                    "STRATAGEM_NODE_ADDRESS=<this node's spec address> on every node")
        try:
            return [spec.nodes[n].worker_devices()[lr] for n, lr in pairs]
        except IndexError:
            raise StratagemError(
                f"ranks report (node, local rank) pairs {pairs} that the spec has no worker for",
                where=spec.source, fix="make each node's 'workers' match --nproc-per-node"
            ) from None

    def _init_process_group(self) -> None:
        servers = server_devices(self.resource_spec)
        if servers and self.world_size == self.resource_spec.num_workers + len(servers):
            # Workers and dedicated servers: each process learns its role and logical rank;
            # the default group then holds the workers only (see runtime/ps/cluster.py).
            self.cluster = join_cluster(self.resource_spec.replicas, servers)
            self.rank, self.role = self.cluster.rank, self.cluster.role
            self.world_size = self.resource_spec.num_workers
            if self.role == "server":
                self.device = torch.device("cpu")
            return
        if self.world_size == 1 or dist.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ:
            raise StratagemError(
                f"WORLD_SIZE={self.world_size} but no MASTER_ADDR in the environment",
                fix="start the script with `stratagem run` or torchrun, not by hand")
        init_process_group(default_backend(self.device))

    def log(self, message: str) -> None:
        if self.verbose and self.rank == 0:
            recorder = self.adaptive.recorder if self.adaptive is not None else None
            if recorder is not None and recorder.progress is not None:
                recorder.progress.clear()  # the message starts on a clean line
            logger().info(message)

    def _recorder(self) -> StepRecorder | None:
        """Rank 0's metrics file (in ``env.run_dir()``) and progress display."""
        if self.rank != 0:
            return None
        directory = env.run_dir()
        mode = env.progress() if self.verbose else "off"
        recorder = StepRecorder(MetricsFile(directory) if directory else None,
                                ProgressDisplay(mode) if mode != "off" else None,
                                self._tensorboard())
        atexit.register(recorder.close)  # the last step's record
        return recorder

    @staticmethod
    def _tensorboard() -> Any:
        """A SummaryWriter on ``env.tensorboard_dir()``, or None (unset or no tensorboard)."""
        directory = env.tensorboard_dir()
        if directory is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger().warning(f"{env.TENSORBOARD_DIR} is set but tensorboard is not "
                             "installed (pip install tensorboard): no TensorBoard scalars")
            return None
        try:
            return SummaryWriter(str(directory))
        except OSError as exc:  # a side output: never the end of the job
            logger().warning(f"cannot write TensorBoard scalars to {directory}: "
                             f"{exc.strerror or exc}; training goes on without them")
            return None

    def log_metrics(self, **values: Any) -> None:
        """Record the script's own numbers (``loss=...``) with the current step, in the
        metrics file and the progress line; rank 0's values are kept. Call it right
        after ``optimizer.step()`` (or before it, for the step about to run)."""
        if self.adaptive is None:
            raise StratagemError("log_metrics before distribute()", where="AutoDist",
                                 fix="call ad.distribute(model, optimizer) first")
        self.adaptive.log_metrics(**values)

    # -- the user API -------------------------------------------------------------------
    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def build_strategy(self, model: nn.Module, sample_input: Any = None,
                       optimizer: Any = None) -> Strategy:
        """Analyze ``model`` and build (and validate) its strategy without wrapping it.

        With the Auto builder, ``sample_input`` (one worker's batch, as ``model(*it)``
        takes it) lets the planner measure the model; rank 0's choice is then sent to the
        other workers, since measurements differ between processes."""
        self.profile = analyze(model)
        if isinstance(self._builder, Auto):
            return validate(self._plan(model, sample_input, optimizer), self.profile,
                            self.resource_spec)
        strategy = self._builder.build(self.profile, self.resource_spec)
        return validate(strategy, self.profile, self.resource_spec)

    def _plan(self, model: nn.Module, sample_input: Any, optimizer: Any) -> Strategy:
        options = self._builder
        if options.rows and not _rows_allowed(model, optimizer):
            options = replace(options, rows=False)
        if options.servers and self.elastic_group is not None:
            self.log("Auto: all-reduce strategies only (an in-process elastic job rescales "
                     "those)")
            options = replace(options, servers=False)
        if (options.max_zero_stage > 2 and self.elastic_group is not None
                and self.resource_spec.memory_limit() is not None):
            self.log("Auto: ZeRO stages 1 and 2 only (an in-process rescale of stage-3 "
                     "units gathers the whole parameters and optimizer state on every "
                     "worker: a model that needs stage 3 to fit has no room for that)")
            options = replace(options, max_zero_stage=2)
        if (options.servers and self.adaptive is not None
                and self.adaptive.needs_gradient_statistics):
            self.log("Auto: no parameter servers (the adaptive batch size reads the "
                     "gradient noise scale from the workers' gradients: all-reduced or "
                     "sharded, not the servers')")
            options = replace(options, servers=False)
        if self.cluster is not None and sample_input is not None:
            self.log("Auto: dedicated parameter servers plan from the profile (no "
                     "calibration), so that every process chooses alike")
            sample_input = None
        # Inside the job (every worker plans at once): measure the links, and time the
        # best few candidates for real (trial steps) when the options ask for it.
        together = sample_input is not None and self.world_size > 1 and not _PLAN_ONLY
        self.choice = choose(model, self.resource_spec, sample_input=sample_input,
                             options=options, probe=together and options.probe,
                             trials=together and options.trials > 0, optimizer=optimizer)
        if not together:
            return self.choice.strategy
        return self._agree(self.choice.strategy)

    def _agree(self, strategy: Strategy) -> Strategy:
        """Rank 0's strategy on every worker (sent as JSON bytes, parsed strictly)."""
        payload = broadcast_bytes(strategy.to_json().encode() if self.rank == 0 else None)
        if self.rank == 0:
            return strategy
        return Strategy.from_dict(json.loads(payload.decode()), source="rank 0's Auto strategy")

    def explain(self) -> str:
        """What Auto chose and why: groups, predicted step split into compute, exposed
        communication and overheads, bytes per link, the alternatives it rejected."""
        if self.choice is None and self._kept_strategy and self.strategy is not None:
            return (f"Resumed with the checkpoint's strategy {self.strategy.id}, which Auto "
                    f"planned in an earlier run for these {self.world_size} workers; this "
                    "run did not plan (its explanation is that run's).\n"
                    + self.strategy.summary())
        if self.choice is None:
            raise StratagemError(
                "explain() needs a strategy chosen by Auto" + (
                    ", and Auto plans on the first training batch" if self._plan_pending
                    else ""),
                where="AutoDist.explain",
                fix="call it after the first training step" if self._plan_pending else
                    'use strategy_builder="Auto" and call distribute() (or '
                    "build_strategy()) first")
        return explain_text(self.choice)

    def distribute(self, model: nn.Module, optimizer: Any = None, *,
                   scaling_rule: Any = None, scaler: Any = None,
                   adaptive: TrainerConfig | None = None,
                   sample_input: Any = None) -> tuple[nn.Module, Any]:
        """Return (distributed model, optimizer); the optimizer object is the same, its
        ``step``/``zero_grad`` wrapped by the adaptive loop (``stratagem.adapt.loop``): LR
        scaled by ``scaling_rule`` (default by optimizer type) when the batch size changes,
        gradient accumulation over the loader's micro-batches. ``scaler``: a
        ``torch.amp.GradScaler`` for mixed precision (``DistributedModel.attach_scaler``).
        ``adaptive`` tunes the adaptive loop (:class:`stratagem.adapt.TrainerConfig`:
        decision interval, smoothing, preconditioner refresh). ``sample_input``: one
        worker's batch for the Auto builder to calibrate on (see :meth:`build_strategy`).

        Auto without ``sample_input`` in a job of several workers plans on the first
        training batch instead: the model all-reduces until then, and at the start of the
        first forward in training mode every worker calibrates on its batch, the links are
        probed, the best candidates are timed, and the model switches to the chosen
        strategy (values unchanged)."""
        if not isinstance(model, nn.Module):
            raise StratagemError(f"expected a torch.nn.Module, got {type(model).__name__}",
                                 where="AutoDist.distribute", fix="pass the model object")
        self._check_model_device(model)
        model.to(self.device)
        self._check_optimizer(model, optimizer)
        self._plan_pending = self._plans_on_first_batch(sample_input)
        kept, tracked = None, self._plan_pending
        if self._plan_pending:
            self.profile = analyze(model)
            self._track_strategy()  # the checkpoint's strategy, before deciding to plan
            kept = self._checkpointed_strategy(self.profile)
        if kept is not None:
            self.strategy, self._plan_pending = kept, False
        elif self._plan_pending:
            self.strategy = validate(AllReduce().build(self.profile, self.resource_spec),
                                     self.profile, self.resource_spec)
        else:
            self.strategy = self.build_strategy(model, sample_input, optimizer)
        if _PLAN_ONLY:
            raise PlanOnly(self)
        self.log(self.profile.summary() if self.profile else "")
        if self._plan_pending:
            self.log("Auto: plans on the first training batch (calibration, link probe, "
                     "trial steps); all-reduce until then")
        elif kept is not None:
            self.log(self.strategy.summary())
            self.log(f"Auto: resumed with the checkpoint's strategy {kept.id}, planned for "
                     f"these {self.world_size} workers (no new planning; a job on other "
                     "workers plans anew)")
        else:
            self._announce()
        plan = compile_plan(self.strategy, self.profile, rank=self.rank,
                            world_size=self.world_size, device=self.device,
                            servers=self._servers_for(self.strategy))
        if self.role == "server":
            self._serve(model, optimizer, plan)  # exits the process
        if self.elastic_group is not None and plan.shards is not None and plan.shards.units:
            # an in-process rescale rebuilds the stage-3 units from a copy of the model
            # without values (runtime/skeleton.py): a model that cannot be copied is
            # refused now, not at its first rescale; so is one whose gather of the whole
            # model at a rescale would not fit the memory limit
            skeleton(model)
            check_rescale_fits(self.strategy, self.profile, self.resource_spec,
                               self.world_size, optimizer)
        self.model = DistributedModel(model, plan, optimizer=optimizer, cluster=self.cluster)
        if self._plan_pending:
            self.model.on_first_training_forward(
                lambda args, kwargs: self._plan_on_batch(args, kwargs, optimizer))
        if scaler is not None:
            self.model.attach_scaler(scaler)
        self.optimizer = optimizer
        # Job state for checkpoint-restart (restored here when a checkpoint exists).
        if elastic.track_model(self.model, optimizer):
            self.log(f"resumed from checkpoint {elastic.restore_point()}")
        if not tracked:
            self._track_strategy()
        if optimizer is not None:
            self.adaptive = AdaptiveTrainer(
                self.model, optimizer, scaling_rule=scaling_rule, rank=self.rank,
                world_size=self.world_size, log=self.log,
                num_nodes=sum(1 for n in self.resource_spec.nodes if n.workers > 0) or 1,
                config=adaptive or TrainerConfig(), recorder=self._recorder())
        return self.model, optimizer

    def _plans_on_first_batch(self, sample_input: Any) -> bool:
        """Auto with nothing to calibrate on yet, in a job of several workers that plan
        together (no dedicated servers: those plan from the profile)."""
        return (isinstance(self._builder, Auto) and sample_input is None
                and self.world_size > 1 and self.cluster is None and not _PLAN_ONLY)

    def _checkpointed_strategy(self, profile: ModelProfile) -> Strategy | None:
        """The strategy of the checkpoint this job resumes from, when it was planned for
        the same workers and fits this model: kept, so a restart neither spends the
        planning again nor flips to another plan on timing noise. Every worker must agree
        (they plan together otherwise); None means plan anew."""
        saved = None
        if self._saved_strategy is not None:
            with contextlib.suppress(StratagemError):
                saved = validate(Strategy.from_dict(self._saved_strategy,
                                                    source="the checkpoint's strategy"),
                                 profile, self.resource_spec)
                if (list(saved.graph_config.replicas) != list(self.resource_spec.replicas)
                        or (saved.server_parameters and self.elastic_group is not None)):
                    saved = None  # other workers; or servers an in-process rescale can't
        flag = torch.tensor([1 if saved is not None else 0], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # (several workers: see the caller)
        if not int(flag.item()):
            saved = None
        self._kept_strategy = saved is not None
        return saved

    def _announce(self) -> None:
        """Print the strategy (and, from Auto, the prediction behind it)."""
        self.log(self.strategy.summary() if self.strategy else "")
        if self.choice is not None:
            text = explain_text(self.choice)
            self.log("\n".join(text.splitlines()[:3]))
            if self.verbose and self.rank == 0:  # the whole of ad.explain() at debug level
                logger().debug(text)
            hidden = self.strategy.server_parameters if self.strategy else []
            if hidden:
                self.log(f"Auto: {len(hidden)} parameter(s) go to parameter servers: their "
                         ".grad stays None on the workers (gradient clipping sees the "
                         "all-reduced ones only); strategy_builder=Auto(servers=False) "
                         "keeps every gradient on the workers")

    def _plan_on_batch(self, args: tuple, kwargs: dict, optimizer: Any) -> None:
        """The first training forward's inputs as Auto's sample batch: plan on them, then
        switch the model to the chosen strategy (every worker at once: all reach it)."""
        sample = None if args and kwargs else kwargs or args
        if sample is None:
            self.log("Auto: the first batch mixes positional and keyword inputs; planning "
                     "from the model's profile (pass sample_input= to distribute())")

        def make_plan() -> Any:
            self.strategy = self.build_strategy(self.model.module, sample, optimizer)
            return compile_plan(self.strategy, self.profile, rank=self.rank,
                                world_size=self.world_size, device=self.device,
                                servers=self._servers_for(self.strategy))

        began = time.perf_counter()
        self.model.replan(make_plan, optimizer=optimizer, cluster=self.cluster)
        self._plan_pending = False
        if self.adaptive is not None and self.adaptive.recorder is not None:
            # In the first step's record: `stratagem report` marks the gap it leaves.
            self.adaptive.recorder.log({"auto_plan_s": time.perf_counter() - began})
        self._announce()
        self._say_if_replanned()

    def _servers_for(self, strategy: Strategy) -> list[str]:
        """The job's dedicated servers (error if the strategy needs ones not started)."""
        started = server_devices(self.resource_spec) if self.cluster is not None else []
        needed = sorted({leaf.synchronizer.reduction_destination
                         for nc in strategy.node_config for leaf in nc.leaves()
                         if getattr(leaf.synchronizer, "reduction_destination", "")
                         and leaf.synchronizer.reduction_destination
                         not in strategy.graph_config.replicas} - set(started))
        if needed:
            raise StratagemError(
                f"the strategy sends parameters to dedicated servers {needed}, but no server "
                "process was started", where=f"strategy {strategy.id}",
                fix="launch with `stratagem run --resource-spec FILE` (it starts one server "
                    "per node with 'workers: 0'), or use a strategy without them")
        return started

    def _serve(self, model: nn.Module, optimizer: Any, plan: Any) -> None:
        """A dedicated parameter server: serve until the workers finish, then exit(0), so
        the rest of the training script never runs here."""
        if plan.ps is not None:
            stats = run_server(model, plan, optimizer, self.cluster)
            if self.verbose:
                print(f"stratagem: server {self.cluster.device(self.rank)} done: "
                      f"{stats.summary()}", flush=True)
        sys.exit(0)

    def _check_model_device(self, model: nn.Module) -> None:
        """A model the script put on a GPU is not moved to the CPU behind its back (its
        batches would follow it to the GPU and the forward fail on a device mismatch). A
        meta-device model (no values) is refused: distribute() cannot materialize it."""
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            raise StratagemError(
                "the model is on the meta device (no values)", where="AutoDist.distribute",
                fix="plan with stratagem.planner.choose and wrap it with DistributedModel(..., "
                    "materialize=MetaInit(seed=...)) (docs/how-to/meta-device.md), or build "
                    "it on a real device")
        on_gpu = sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
        if self.device.type != "cpu" or not on_gpu:
            return
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise StratagemError(
            f"the model is on {', '.join(on_gpu)} but this worker trains on the CPU: the "
            f"resource spec ({self.resource_spec.source}) gives it no GPU ({gpus} GPU(s) "
            f"here, {self.world_size} workers in the job)", where="AutoDist.distribute",
            fix="run one worker per GPU (`stratagem run --nproc N`, N at most the GPUs), list "
                "the GPUs under the node's `gpus` in the resource spec, or leave the model on "
                "the CPU and move it and its batches to `ad.device`")

    def _check_optimizer(self, model: nn.Module, optimizer: Any) -> None:
        if optimizer is None:
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise StratagemError(f"expected a torch.optim.Optimizer, got "
                                 f"{type(optimizer).__name__}", where="AutoDist.distribute",
                                 fix="pass the optimizer built over model.parameters()")
        own = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:
            if any(id(p) not in own for p in group["params"]):
                raise StratagemError(
                    "the optimizer holds parameters that are not in the model",
                    where="AutoDist.distribute",
                    fix="build the optimizer from model.parameters() before distribute()")

    def data_loader(self, dataset: Any, batch_size: int, shuffle: bool = False,
                    **kwargs: Any) -> DistributedDataLoader:
        """A loader whose ``batch_size`` is the GLOBAL batch, split across replicas, with
        its batches on this worker's device (``ad.device``, where the model is).

        Its position is part of the job state (restored here when a checkpoint exists), and
        it stops the job gracefully on SIGTERM; iterate it on every rank.
        """
        loader = DistributedDataLoader(dataset, batch_size, rank=self.rank,
                                       world_size=self.world_size, shuffle=shuffle,
                                       seed=kwargs.pop("seed", self.seed),
                                       on_batch=self._set_grad_weight, elastic=True,
                                       device=kwargs.pop("device", self.device), **kwargs)
        elastic.track_loader(loader)
        loader.hooks = self.adaptive  # the adaptive loop, once distributed
        return loader

    def remaining_epochs_until(self, epoch: int) -> Iterator[int]:
        """The epochs left until ``epoch``, resuming at the checkpointed one after a restart."""
        return elastic.remaining_epochs_until(epoch)

    def _set_grad_weight(self, weight: float) -> None:
        if self.model is not None:
            self.model.grad_weight = weight

    def _strategy_dict(self) -> dict[str, Any] | None:
        return self.strategy.to_dict() if self.strategy is not None else None

    def _track_strategy(self) -> None:
        """The strategy as job state: it goes into every checkpoint (strategy.json), so a
        run can be repeated with --strategy CKPT/strategy.json; restored (checksum-checked)
        into ``_saved_strategy``."""
        elastic.load_state(elastic.ObjectState(
            elastic.unique_name("strategy"), self._strategy_dict, self._restore_strategy,
            format="json"))

    def _restore_strategy(self, saved: Any) -> None:
        """Restore hook of the checkpointed strategy: the model state does not depend on it,
        so a different plan is allowed, but said (Auto plans anew after a restart on other
        workers; compared once it has)."""
        self._saved_strategy = saved if isinstance(saved, dict) else None
        if not self._plan_pending:
            self._say_if_replanned()

    def _say_if_replanned(self) -> None:
        """Say so when this run's strategy does something else than the checkpoint's: ids
        are content hashes, so an identical plan (re-planned after a restart) says nothing,
        and a different one says what differs."""
        if self.strategy is None or self._saved_strategy is None:
            return
        try:
            saved = Strategy.from_dict(self._saved_strategy, source="the checkpoint's strategy")
        except StratagemError as exc:
            self.log(f"the checkpoint's strategy cannot be read ({exc.problem}); this run uses "
                     f"{self.strategy.id}")
            return
        changes = differences(saved, self.strategy)
        if changes:
            self.log(f"the checkpoint was trained with strategy {saved.id}, this run uses "
                     f"{self.strategy.id}: " + "; ".join(changes) + ". To keep the old one, "
                     f"pass --strategy {elastic.restore_point()}/strategy.json")

    def save_checkpoint(self, path: str | os.PathLike[str], **metadata: Any) -> Path:
        """Save the distributed model and optimizer (one rank suffices; see
        :func:`stratagem.checkpoint.save`)."""
        self._require_distributed("save_checkpoint")
        return checkpoint.save(path, self.model, self.optimizer,
                                strategy_id=self.strategy.id if self.strategy else None,
                                metadata=metadata,
                                strategy=self.strategy.to_dict() if self.strategy else None)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model and optimizer saved by :meth:`save_checkpoint`; returns metadata."""
        self._require_distributed("load_checkpoint")
        return checkpoint.load(path, self.model, self.optimizer, map_location=self.device)

    def _require_distributed(self, what: str) -> None:
        if self.model is None:
            raise StratagemError(f"{what} before distribute()", where=f"AutoDist.{what}",
                                 fix="call ad.distribute(model, optimizer) first")

    # -- the job lifecycle (stratagem.elastic.Participant) ----------------------------------
    def before_membership_change(self) -> None:
        """Before an in-process rescale, in the old group: a sharded model's ranks take
        the optimizer state other ranks own (they may leave); parameters are whole on
        every rank and broadcast afterwards."""
        if self.model is not None:
            self.model.before_regroup()

    def on_membership_change(self, change: elastic.MembershipChange) -> None:
        """An in-process rescale formed a new group of ``world_size`` workers (on this
        machine; each a node of its own where Ray gave it its own GPU, ``LOCAL_WORLD_SIZE=1``);
        rebuild the strategy and plan for it, and re-bind the distributed model
        (broadcasting rank 0's tensors when someone joined)."""
        self.rank, self.world_size = change.rank, change.world_size
        self.resource_spec = ResourceSpec.of_job(
            change.world_size, env.job_nodes(change.world_size)).with_memory_of(
                self.resource_spec)  # the user's memory limits hold in every world
        self.rank_devices = list(self.resource_spec.replicas)
        if self.model is None:
            return
        self.strategy = self.build_strategy(self.model.module)
        plan = compile_plan(self.strategy, self.profile, rank=change.rank,
                            world_size=change.world_size, device=self.device)
        self.model.regroup(plan, broadcast=change.joiners)
