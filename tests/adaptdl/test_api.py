"""stratagem.adaptdl exposes AdaptDL's public names with AdaptDL's signatures and semantics."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from stratagem.elastic import drop_job

NAMES = {
    "stratagem.adaptdl.torch": [
        "init_process_group", "AdaptiveDataParallel", "AdaptiveDataLoader", "Accumulator",
        "remaining_epochs_until", "current_epoch", "finished_epochs", "current_dataloader",
        "AdaScale", "AdamScale", "LinearScale", "SqrtScale", "LEGW", "LEGWScale",
        "ElasticSampler", "AdaptiveDataLoaderHelper", "AdaptiveDataLoaderMixin",
        "version_check"],
    "stratagem.adaptdl.torch.scaling_rules": [
        "ScalingRuleBase", "AdaScale", "AdamScale", "LinearScale", "SqrtScale", "LEGWScale",
        "current_dataloader"],
    "stratagem.adaptdl.torch.data": ["AdaptiveDataLoader", "current_dataloader",
                                     "ElasticSampler", "AdaptiveDataLoaderHelper",
                                     "AdaptiveDataLoaderMixin"],
    "stratagem.adaptdl.torch.gradient_noise_scale": ["GradientNoiseScale"],
    "stratagem.adaptdl.collective": ["initialize", "allreduce", "allreduce_async",
                                     "broadcast"],
    "stratagem.adaptdl.torch.parallel": ["AdaptiveDataParallel"],
    "stratagem.adaptdl.torch.accumulator": ["Accumulator"],
    "stratagem.adaptdl.torch.epoch": ["remaining_epochs_until", "current_epoch",
                                      "finished_epochs"],
    "stratagem.adaptdl.env": ["replica_rank", "num_replicas", "num_nodes", "job_id",
                              "share_path", "checkpoint_path", "master_addr", "master_port",
                              "num_restarts"],
    "stratagem.adaptdl.checkpoint": ["State", "save_all_states", "save_state", "load_state"],
}


@pytest.fixture(autouse=True)
def fresh_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "STRATAGEM_JOB_ID", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in __import__("os").environ if v.startswith("ADAPTDL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    yield


@pytest.mark.parametrize("module", sorted(NAMES))
def test_module_exposes_adaptdl_names(module: str) -> None:
    mod = __import__(module, fromlist=["_"])
    missing = [n for n in NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


def test_adaptdl_package_attributes() -> None:
    from stratagem import adaptdl

    assert adaptdl.env.replica_rank() == 0
    assert adaptdl.torch.AdaptiveDataLoader and adaptdl.checkpoint.State


def test_signatures_match_adaptdl() -> None:
    import stratagem.adaptdl.torch as adl

    def params(f):
        return list(inspect.signature(f).parameters)

    assert params(adl.AdaptiveDataParallel)[:5] == [
        "model", "optimizer", "lr_scheduler", "mp_scaler", "scaling_rule"]
    sig = inspect.signature(adl.AdaptiveDataLoader)
    assert list(sig.parameters)[:3] == ["dataset", "batch_size", "shuffle"]
    assert sig.parameters["batch_size"].default == 1 and not sig.parameters["shuffle"].default
    assert params(adl.AdaptiveDataLoader.autoscale_batch_size) == [
        "self", "max_batch_size", "local_bsz_bounds", "gradient_accumulation"]
    assert params(adl.AdaptiveDataLoader.to_tensorboard)[:2] == ["self", "writer"]
    assert params(adl.init_process_group) == ["backend", "init_method", "world_size", "rank"]
    assert params(adl.LEGWScale) == ["base_warmup_epochs", "data_size"]


def test_env_prefers_adaptdl_then_torch_elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    from stratagem.adaptdl import env

    assert (env.replica_rank(), env.num_replicas(), env.num_nodes()) == (0, 1, 1)
    assert env.job_id() is None and env.share_path() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("STRATAGEM_JOB_ID", "sg-1")
    assert (env.replica_rank(), env.num_replicas(), env.num_nodes()) == (3, 8, 2)
    assert env.job_id() == "sg-1"
    monkeypatch.setenv("ADAPTDL_REPLICA_RANK", "1")
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "2")
    monkeypatch.setenv("ADAPTDL_JOB_ID", "job")
    monkeypatch.setenv("ADAPTDL_SHARE_PATH", "/share")
    assert (env.replica_rank(), env.num_replicas(), env.num_nodes()) == (1, 2, 2)
    assert (env.job_id(), env.share_path()) == ("job", "/share")
    assert env.checkpoint_path().endswith("ckpt")


def test_a_script_asking_for_nccl_gets_nccl_with_gloo_beside_it() -> None:
    """AdaptDL scripts ask for ``"nccl"`` where CUDA is available: CUDA collectives still
    run on NCCL, and Stratagem's CPU tensors (the planner's probe and trial timings) have
    gloo; other requests are kept as asked (tests/gpu runs the drop-in on a GPU)."""
    from stratagem.adaptdl.torch.job import group_backend
    from stratagem.distributed.process_group import GPU_BACKEND, default_backend

    assert group_backend("nccl") == group_backend("NCCL") == GPU_BACKEND
    assert GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert group_backend("gloo") == "gloo"
    assert group_backend("cpu:gloo,cuda:nccl") == GPU_BACKEND
    assert group_backend(None) == default_backend()


def test_checkpoint_state_roundtrip_and_unique_names() -> None:
    from stratagem.adaptdl.checkpoint import State, load_state, save_all_states

    class Counter(State):
        def __init__(self) -> None:
            super().__init__("counter")
            self.n = 0

        def save(self, fileobj):
            fileobj.write(str(self.n).encode())

        def load(self, fileobj):
            self.n = int(fileobj.read().decode())

    c = Counter()
    assert load_state(c) is False
    with pytest.raises(ValueError, match="already exists"):
        State("counter")
    c.n = 7
    assert save_all_states() is not None
    drop_job()
    again = Counter()
    assert load_state(again) is True and again.n == 7


def test_accumulator_modes_and_restore() -> None:
    from stratagem.adaptdl.torch import Accumulator, accumulator

    # Accumulators are named by creation count (as AdaptDL's are): start this run's count at
    # zero, as a fresh process would, whatever other tests in this process made before.
    accumulator._init_count.clear()
    acc = Accumulator()
    acc["loss"] += 1.5
    acc["n"] += 2
    acc += {"n": 3}
    acc.subtract(loss=0.5)
    acc["t"] += torch.tensor([1.0, 2.0])
    assert len(acc) == 0 and "n" not in acc  # accumulation mode reads like an empty dict
    with acc.synchronized():
        assert acc["loss"] == 1.0 and acc["n"] == 5
        torch.testing.assert_close(acc["t"], torch.tensor([1.0, 2.0]))
        acc["avg"] = acc["loss"] / acc["n"]
    with pytest.raises(TypeError):
        acc["x"] = 3
    from stratagem.adaptdl.checkpoint import save_all_states

    acc["n"] += 1  # pending: summed in by the save
    save_all_states()
    drop_job()
    accumulator._init_count.clear()
    restored = Accumulator()
    with restored.synchronized():  # replayed code: the first synchronization's results
        assert restored["n"] == 5 and "avg" not in restored  # (the block recomputes it)
    with restored.synchronized():  # new: the saved values with the update made before it
        assert restored["n"] == 6


def test_scaling_rules_are_stratagem_rules() -> None:
    from stratagem.adapt.scaling_rules import ScalingRule
    from stratagem.adaptdl.torch.scaling_rules import (
        AdamScale,
        AdaScale,
        LEGWScale,
        LinearScale,
        SqrtScale,
    )

    for rule in (AdaScale(), AdamScale(), LinearScale(), SqrtScale(), LEGWScale(1, 100)):
        assert isinstance(rule, ScalingRule)
    assert LinearScale().lr_factors(4.0, num_groups=2).tolist() == [4.0, 4.0]


@pytest.mark.parametrize("explicit", [False, True])
def test_adam_gets_adamscale_and_preconditioned_statistics_only_when_asked(
        explicit: bool) -> None:
    """AdaptDL 0.2.11: an Adam optimizer without a rule gets ``AdamScale`` but plain
    gradient statistics; only an ``AdamScale`` the script passes preconditions them (its NCF
    example passes none: preconditioned statistics of never-seen embedding rows read
    ~1e9-1e11 there, against AdaptDL's ~0.005 / 0.05)."""
    import stratagem.adaptdl.torch as adl
    from stratagem.adaptdl.torch import job
    from stratagem.adaptdl.torch.scaling_rules import AdamScale

    try:
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.Adam(model.parameters())
        dmodel = adl.AdaptiveDataParallel(model, opt,
                                          scaling_rule=AdamScale() if explicit else None)
        assert isinstance(dmodel.scaling_rule, AdamScale)
        assert dmodel._trainer.preconditioned is explicit
        other = torch.nn.Linear(3, 1)
        sgd = adl.AdaptiveDataParallel(other, torch.optim.SGD(other.parameters(), lr=0.1),
                                       name="sgd")
        assert type(sgd.scaling_rule).__name__ == "AdaScale"
    finally:
        job.reset()
        drop_job()
        if torch.distributed.is_initialized():  # the one-process group the model joined
            torch.distributed.destroy_process_group()


def test_the_wrapped_model_follows_a_stage3_rescale_s_rebuild() -> None:
    """A stage-3 in-process rescale gives the distributed model a new module
    (runtime/skeleton.py); the drop-in's ``module`` and ``_state.model`` follow it."""
    import stratagem.adaptdl.torch as adl
    from stratagem.adaptdl.torch import job
    from stratagem.elastic import MembershipChange, current_job

    try:
        model = torch.nn.Linear(3, 1)
        dmodel = adl.AdaptiveDataParallel(model, torch.optim.Adam(model.parameters()))
        assert dmodel in current_job().participants()
        rebuilt = torch.nn.Linear(3, 1)
        dmodel._dist.module = rebuilt  # what DistributedModel.before_regroup does at stage 3
        dmodel.on_membership_change(MembershipChange(0, 1, newcomer=False, joiners=False))
        assert dmodel.module is rebuilt and dmodel._state.model is rebuilt
        assert [id(p) for p in dmodel.parameters()] == [id(p) for p in rebuilt.parameters()]
    finally:
        job.reset()
        drop_job()
        if torch.distributed.is_initialized():  # the one-process group the model joined
            torch.distributed.destroy_process_group()


def test_autoscaled_epochs_end_on_progress_as_adaptdl_s(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """AdaptDL's epoch under autoscaling: batches until the progress made before a batch's
    step reaches ``(epoch + 1) * len(dataset) / batch_size``, over as many passes as that
    takes. Known answer: 100 samples, batch 10, each step credited a gain of 0.5 (a batch
    whose gain is half a base step) -> epoch 0 stops after the 21st batch (progress 10.0
    before it), two full passes and one batch; epoch 1 (target 20) after 20 more.
    Without autoscaling an epoch is one pass (10 batches) whatever the progress."""
    import stratagem.adaptdl.torch as adl
    from stratagem.adaptdl.torch import data as adl_data
    from stratagem.adaptdl.torch import job

    credited = {"steps": 0}
    monkeypatch.setattr(adl_data, "_job_progress", lambda: 0.5 * credited["steps"])
    x = torch.arange(100.0)[:, None]
    try:
        loader = adl.AdaptiveDataLoader(torch.utils.data.TensorDataset(x), batch_size=10,
                                        shuffle=True)
        plain = adl.AdaptiveDataLoader(torch.utils.data.TensorDataset(x), batch_size=10)
        loader.autoscale_batch_size(40)
        epochs: list[list[list[int]]] = []
        plain_batches: list[int] = []
        for _epoch in adl.remaining_epochs_until(2):
            epochs.append([])
            for (xb,) in loader:
                epochs[-1].append([int(v) for v in xb.flatten()])
                credited["steps"] += 1  # the script's optimizer step
            plain_batches.append(sum(1 for _ in plain))
    finally:
        job.reset()
        drop_job()
        if torch.distributed.is_initialized():  # the one-process group the loaders joined
            torch.distributed.destroy_process_group()
    assert [len(e) for e in epochs] == [21, 20]
    first = epochs[0]
    for k in (0, 1):  # each full pass is a permutation of the dataset
        assert sorted(s for b in first[10 * k:10 * k + 10] for s in b) == list(range(100))
    assert all(len(b) == 10 for e in epochs for b in e)
    assert plain_batches == [10, 10]


def test_an_autoscaled_epoch_ends_after_a_step_s_last_micro_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With gradient accumulation (2 micro-batches of 5 per step of 10) the epoch ends
    after the micro-batch that completes a step: 100 samples, batch 10, gain 0.5 per step
    -> epoch 0 takes 21 whole steps (42 micro-batches), none left half accumulated."""
    import contextlib

    import stratagem.adaptdl.torch as adl
    from stratagem.adaptdl.torch import data as adl_data
    from stratagem.adaptdl.torch import job

    class Hooks:  # the adaptive loop's part that the loader sees (stratagem.data.LoaderHooks)
        current_batch = None

        def start(self, loader) -> None:
            loader.accum_steps = 1

        @contextlib.contextmanager
        def scope(self, loader, info):
            self.current_batch = info
            try:
                yield
            finally:
                self.current_batch = None

        def end(self, loader) -> None:
            pass

    credited = {"steps": 0}
    monkeypatch.setattr(adl_data, "_job_progress", lambda: 0.5 * credited["steps"])
    try:
        loader = adl.AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.arange(100.0)),
                                        batch_size=10)
        loader.autoscale_batch_size(40, gradient_accumulation=True)
        hooks = loader._loader.hooks = Hooks()
        finals = []
        for _epoch in adl.remaining_epochs_until(1):
            for (xb,) in loader:
                assert len(xb) == 5
                finals.append(hooks.current_batch.final)
                credited["steps"] += hooks.current_batch.final  # the optimizer step
    finally:
        job.reset()
        drop_job()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(finals) == 42 and finals[-1] and sum(finals) == 21
