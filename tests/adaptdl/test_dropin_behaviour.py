"""AdaptDL's behaviour through stratagem.adaptdl, each against a known answer: sample
accounting across explicit saves and restarts at 1 -> 4 -> 2 replicas, a broken loop, the
ceil(B/N) split, collectives on 2 replicas, custom scaling rules, gradient statistics."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from unittest import mock

import dropin_workers as w
import numpy as np
import pytest
import torch
import torch.distributed as dist
from _spawn import Setup, run

from stratagem.elastic import state as sg_state
from stratagem.errors import StratagemError

UNSET = ("ADAPTDL_MASTER_ADDR", "ADAPTDL_MASTER_PORT", "ADAPTDL_NUM_REPLICAS",
         "ADAPTDL_REPLICA_RANK", "STRATAGEM_CHECKPOINT_DIR")


def _run(fn, world: int, out: Path, **kwargs) -> list:
    """``fn`` on ``world`` replicas sharing the checkpoint directory next to ``out``."""
    return run(fn, world, out, {"ckpt": str(out.parent / "ckpt"), **kwargs},
               Setup(args=(world,), unset=UNSET))


def test_explicit_save_replays_the_batch_in_hand_across_1_4_2_replicas(tmp_path: Path
                                                                       ) -> None:
    first = _run(w.save_and_restart, 1, tmp_path / "one", save_at=2)
    second = _run(w.save_and_restart, 4, tmp_path / "four", save_at=5)
    third = _run(w.save_and_restart, 2, tmp_path / "two", save_at=None)
    trained = [s for run_ in (first, second, third) for r in run_ for s in r["trained"]]
    assert Counter(trained) == Counter(range(w.N))  # every sample exactly once
    # The batches held at the saves were trained after the restarts.
    later = {s for r in second + third for s in r["trained"]}
    assert set(first[0]["held"]) <= later and len(first[0]["held"]) == 10
    held_at_four = {s for r in second for s in r["held"]}
    assert len(held_at_four) == 12 and held_at_four <= {s for r in third for s in r["trained"]}
    # AdaptDL's split: ceil(10 / N) samples per replica, N * ceil(10 / N) in all.
    assert first[0]["sizes"] == [(10, 10, 10)] * 2
    assert all(r["sizes"] == [(3, 3, 12)] * 5 for r in second)
    assert all(r["sizes"] == [(5, 5, 10)] * 2 for r in third)


def test_a_broken_loop_is_followed_by_a_full_pass(tmp_path: Path) -> None:
    results = _run(w.broken_loop, 2, tmp_path / "out")
    for name in ("adaptdl", "stratagem"):
        firsts = [r[name]["first"] for r in results]
        seconds = [r[name]["second"] for r in results]
        assert [len(f) for f in firsts] == [30, 30]  # 6 batches of 5 per replica
        assert [len(s) for s in seconds] == [10, 10], name  # a fresh pass: all 10 batches
        assert sorted(s for per_rank in seconds for b in per_rank for s in b) == list(
            range(w.N))


def test_collective_and_accumulator_on_two_replicas(tmp_path: Path) -> None:
    results = _run(w.collective_ops, 2, tmp_path / "out")
    for rank, r in enumerate(results):
        assert r["sum"] == 3
        assert r["union"] == {0, 1, 10, 11}
        assert r["tensor"] == [3.0, 3.0] and r["array"] == [1, 2]
        assert r["nested"] == {"ranks": (0, 1), "n": 2}
        assert r["broadcast"] == {"from": 0, "tag": "r0"}
        assert r["async"] == [9, 3, 6]
        assert "cannot send a object" in r["refused"]
        assert "already initialized" in r["again"]
        assert r["acc"] == (3, [2.0, 1.0]), rank


def test_custom_scaling_rule_scales_the_steps_stratagem_runs(tmp_path: Path) -> None:
    results = _run(w.custom_rule, 2, tmp_path / "out")
    r = results[0]
    assert r["bound"] and r["lr_after"] == 0.1  # the script's LR is left as it was
    model = torch.nn.Linear(3, 1)
    model.load_state_dict(r["initial"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * 0.25)  # the rule's factor
    for i in range(3):  # three global batches of 20, in order (no shuffling)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(r["x"][20 * i:20 * i + 20]),
                                     r["y"][20 * i:20 * i + 20]).backward()
        opt.step()
    for other in results:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(other["final"][k], v)


def test_replicas_get_adaptdl_s_samples_and_statistics_of_a_known_answer(
        tmp_path: Path) -> None:
    """AdaptDL deals each batch out strided (replica r: every N-th sample from the r-th),
    and the local squared norms of the gradient statistics depend on that deal. Batch
    [1, 2, 3, 4], sample gradient -2t: replica 0 gets [1, 3] (mean gradient -4), replica 1
    [2, 4] (-6); S = (16 + 36) / 2 = 26, T = 5^2 = 25, so |G|^2 = 2T - S = 24 and the
    variance at the base batch (AdaptDL's units) is (S - T) * 1 = 1 -- contiguous halves
    ([1, 2], [3, 4]) would give 21."""
    results = _run(w.split_statistics, 2, tmp_path / "out")
    assert [r["samples"] for r in results] == [[1.0, 3.0], [2.0, 4.0]]
    for r in results:
        assert r["sqr"] == pytest.approx([24.0])
        assert r["var"] == pytest.approx([1.0])


# -- in-process: no process group needed ----------------------------------------------------
@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "STRATAGEM_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    sg_state.reset_states()
    yield
    sg_state.reset_states()


def test_accumulator_of_several_replicas_without_a_group_fails_clearly(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "4")
    from stratagem.adaptdl.torch import Accumulator

    acc = Accumulator()
    acc["n"] += 1
    with pytest.raises(StratagemError, match="no process group") as err, acc.synchronized():
        pass
    assert "init_process_group" in str(err.value)


def test_save_state_keeps_the_other_states_of_the_last_checkpoint(fresh: None) -> None:
    from stratagem.adaptdl.checkpoint import State, load_state, save_all_states, save_state

    class Value(State):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.value = 0

        def save(self, fileobj) -> None:
            fileobj.write(str(self.value).encode())

        def load(self, fileobj) -> None:
            self.value = int(fileobj.read().decode())

    a, b = Value("a"), Value("b")
    a.value, b.value = 1, 2
    save_all_states()
    a.value, b.value = 10, 20
    save_state(a)
    sg_state.reset_states()
    a, b = Value("a"), Value("b")
    assert load_state(a) and load_state(b)
    assert (a.value, b.value) == (10, 2)


def test_elastic_sampler_covers_the_rest_of_the_epoch() -> None:
    from stratagem.adaptdl.torch import ElasticSampler

    data = list(range(23))
    sampler = ElasticSampler(data, shuffle=True)
    sampler.num_replicas = 3
    sampler.set_epoch(4, index=5)
    shares = []
    for rank in range(3):
        sampler.rank = rank
        shares.append(list(sampler))
        assert len(sampler) == len(shares[-1]) == math.ceil(18 / 3)
    assert list(sampler) == shares[-1]  # deterministic
    counts = Counter(s for share in shares for s in share)
    assert len(counts) == 18 and sum(counts.values()) == 18
    sampler.set_epoch(5, index=5)
    assert [list(sampler)] != [shares[-1]]  # another epoch, another order
    sampler.shuffle = False
    sampler.rank, sampler.num_replicas = 1, 4
    sampler.set_epoch(0, index=21)  # 2 samples left for 4 replicas: padded
    assert list(sampler) == [22]
    sampler.rank = 3
    assert list(sampler) == [22]


def test_adaptdl_style_rules_and_their_factors() -> None:
    from stratagem.adapt.noise_scale import GradientNoiseScale as CoreGNS
    from stratagem.adaptdl.torch import scaling_rules as sr

    class Halve(sr.ScalingRuleBase):
        def scale_lr(self, scale: float) -> float:
            return 0.5

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([p], lr=0.1)
    adp = mock.Mock(require_backward_grad_sync=True)
    from stratagem.adaptdl.torch.gradient_noise_scale import GradientNoiseScale

    adp.gns = GradientNoiseScale(adp, opt, num_replicas=1, accum_scale=1.0)
    rule = Halve()
    rule.initialize(adp, opt, patch_optimizer=True)
    opt.zero_grad()
    (p * torch.tensor([3.0, 4.0])).sum().backward()
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.05 * 3, -2.0 - 0.05 * 4]))
    assert opt.param_groups[0]["lr"] == 0.1
    assert adp.gns.get_progress() == pytest.approx(1.0)  # gain 1 at scale 1
    # Through Stratagem's interface: measured statistics in base-batch units.
    core = CoreGNS(base_batch_size=8, num_groups=2)
    core.update([[1.0, 4.0], [3.0, 6.0]], [1.5, 4.5], 8)  # sqr [1, 4], var/sample [8, 8]
    var = np.asarray(core.group_vars) / 8
    sqr = np.asarray(core.group_sqr_norms)
    expected = (var + sqr) / (var / 4 + sqr)
    np.testing.assert_allclose(sr.AdaScale().lr_factors(4.0, core, 0.0, 2), expected)
    np.testing.assert_allclose(sr.AdamScale().lr_factors(4.0, core, 0.0, 2), np.sqrt(expected))
    np.testing.assert_allclose(Halve().lr_factors(4.0, core, 0.0, 2), [0.5, 0.5])
    assert sr.SqrtScale().lr_factors(9.0, None, 0.0, 3).tolist() == [3.0] * 3
    # Nothing measured: AdaptDL's starting statistics (variance floored at 1e-6): ~1.
    np.testing.assert_allclose(sr.AdaScale().lr_factors(4.0, None, 0.0, 2), [1.0, 1.0],
                               rtol=1e-5)
    assert sr.AdaScale().lr_factors(1.0, None, 0.0, 2).tolist() == [1.0, 1.0]
    with mock.patch.object(sr, "current_dataloader", return_value=mock.Mock(batch_size=50)):
        legw = sr.LEGWScale(2, 1000)  # warmup: 2 * S * 1000 / 50 = 160 steps at S = 4
        assert legw.lr_factors(4.0, None, 40.0, 1).tolist() == [2.0 * 40 / 160]
        assert legw.lr_factors(4.0, None, 400.0, 1).tolist() == [2.0]
    with pytest.raises(ValueError, match="not initialized"):
        Halve().step()


def test_gradient_noise_scale_known_answer_with_accumulation() -> None:
    from stratagem.adaptdl.torch.gradient_noise_scale import GradientNoiseScale

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    adp = mock.Mock(require_backward_grad_sync=False)
    gns = GradientNoiseScale(adp, opt, num_replicas=1, accum_scale=2.0)
    g1, g2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    (p * g1).sum().backward()  # an accumulation micro-step
    assert not gns.should_zero_grad and gns.accum_count == 1
    adp.require_backward_grad_sync = True
    (p * g2).sum().backward()
    assert gns.should_zero_grad and gns.accum_count == 2
    local = (g1.pow(2).sum() + g2.pow(2).sum()).item() / 2
    total = ((g1 + g2) / 2).pow(2).sum().item()
    scale = 2.0 * 2  # accum_scale x micro-steps
    np.testing.assert_allclose(gns.raw_sqr_avg, [2 * total - local])
    np.testing.assert_allclose(gns.raw_var_avg, [(local - total) * scale])
    var, sqr = (local - total) * scale, 2 * total - local
    assert gns.gain(3.0) == pytest.approx((var + sqr) / (var / 3 + sqr))


def test_an_accumulator_s_loss_is_recorded_like_log_metrics(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49: AdaptDL-style scripts report no loss to Stratagem (they never call
    ``ad.log_metrics``), so ``stratagem report`` had no loss panel for them. The loss an
    Accumulator synchronizes is recorded; a validation pass (no training since) is not."""
    from types import SimpleNamespace

    from stratagem.adaptdl.torch import Accumulator, job

    logged: list[dict] = []
    trainer = SimpleNamespace(steps=3)
    fake = SimpleNamespace(adaptive=trainer, log_metrics=lambda **v: logged.append(v))
    monkeypatch.setattr(job, "_autodist", fake)
    monkeypatch.setattr(job, "_loss_steps", -1)
    train = Accumulator()
    train["loss_sum"] += 6.0
    train["total"] += 4
    with train.synchronized():
        train["loss_avg"] = train["loss_sum"] / train["total"]
    assert logged == [{"loss": 1.5}]
    val = Accumulator()  # validation: no optimizer step since
    val["loss_sum"] += 9.0
    val["total"] += 3
    with val.synchronized():
        pass
    assert logged == [{"loss": 1.5}]
    trainer.steps = 6
    with train.synchronized():  # the next epoch: only loss_sum and total (no average)
        pass
    assert logged == [{"loss": 1.5}, {"loss": 1.5}]


def test_private_names_that_adaptdl_examples_read(tmp_path: Path) -> None:
    """``model._state.model`` (AdaptDL's NCF example), ``adaptdl.torch._metrics``
    (its DCGAN example, its Ray Tune integration), and the gradient statistics (not 0.0),
    checked against the exact statistics of the initial weights: per-sample gradient
    variance over the base batch of 20, squared mean gradient."""
    results = _run(w.private_names, 2, tmp_path / "out")
    r = results[0]
    assert r["model_is_module"] and r["optimizer"] and r["scheduler"]
    assert r["scaler"] is None and r["gain"][0] == r["gain"][1] and r["lr_factor"] == 1.0
    assert r["saved"] == ["weight", "bias"]
    assert r["before"] is None and r["unscaled"] is None  # AdaptDL: None until measured
    assert min(r["batches"]) == 20
    sqr, var = r["grad_params"]
    assert (sqr, var) == pytest.approx(r["gns"])
    assert r["scalars"]["Gradient_Norm_Sqr"] == pytest.approx(sqr)
    assert r["scalars"]["Gradient_Variance"] == pytest.approx(var)
    assert r["hints"] and r["progress"] > 0 and r["goodput"] is None
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(r["initial"])
    grads = []
    for xi, yi in zip(r["x"], r["y"], strict=True):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(xi[None]), yi[None]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    g = torch.stack(grads).double()
    want_sqr = float(g.mean(0).pow(2).sum())
    want_var = float(g.var(0).sum()) / 20  # at AdaptDL's base batch
    assert sqr == pytest.approx(want_sqr, rel=0.2)
    assert var == pytest.approx(want_var, rel=0.2)
    assert all(o["grad_params"] == r["grad_params"] for o in results)
