"""Batch-size decisions: larger batches for noisy gradients, hysteresis, all ranks agree."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from integration_workers import regression_data, spawn, train, train_worker

from stratagem.adapt import Autoscaler, BatchConfig, GradientNoiseScale, ThroughputParams

PARAMS = ThroughputParams(alpha_c=0.02, beta_c=0.0005, alpha_r=0.01, beta_r=0.0,
                          alpha_n=0.02, beta_n=0.0, gamma=1.5)
BASE = 32


def noise(noise_scale: float, base: int = BASE) -> GradientNoiseScale:
    """A tracker whose estimate is |G|^2 = 1, tr(Sigma) = noise_scale (synthetic)."""
    gns = GradientNoiseScale(base)
    b, var = 16, float(noise_scale)
    t, s = 1 + var / (2 * b), 1 + var / b  # E|mean|^2 and E|g_i|^2 of two micro-batches
    for _ in range(25):  # enough updates for a decision
        assert gns.update([[s], [s]], [t], b)
    assert gns.noise_scale == pytest.approx(noise_scale)
    return gns


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    yield


def test_large_noise_scale_picks_a_larger_batch() -> None:
    scaler = Autoscaler(BASE, 1024, (8, 128), gradient_accumulation=True)
    current = BatchConfig.of(BASE, 2)
    small, _ = scaler.decide(PARAMS, noise(2.0), 1, 2, current)
    large, choice = scaler.decide(PARAMS, noise(5000.0), 1, 2, current)
    assert small == current  # little noise: a larger batch only wastes samples
    assert large.global_bsz >= 4 * BASE
    assert large.local_bsz <= 128 and large.global_bsz <= 1024
    assert large.global_bsz == 2 * large.local_bsz * (large.accum_steps + 1)
    assert choice is not None and choice.efficiency > 0.5


def test_no_model_yet_keeps_the_batch_within_the_memory_limit() -> None:
    scaler = Autoscaler(256, 1024, (8, 64), gradient_accumulation=True)
    config, choice = scaler.decide(None, None, 1, 2, BatchConfig.of(256, 2))
    assert choice is None
    assert config == BatchConfig(256, 64, 1)  # 2 replicas x 64 x 2 micro-batches
    no_accum = Autoscaler(256, 1024, (8, 64))
    assert no_accum.decide(None, None, 1, 2, BatchConfig.of(256, 2))[0].global_bsz == 128


def test_restored_configuration_follows_a_new_world_size() -> None:
    """A restart at another size (``--nnodes`` shrink or grow) restores the old replicas'
    configuration; without a model yet it is re-derived for the new number of replicas."""
    scaler = Autoscaler(8, 32, (1, 4), gradient_accumulation=True)
    on_two = BatchConfig.of(8, 2)  # 2 x 4
    alone = scaler.decide(None, None, 1, 1, on_two)[0]
    assert alone == BatchConfig(8, 4, 1)  # one replica: 2 accumulated micro-batches of 4
    assert scaler.decide(None, None, 2, 2, alone)[0] == BatchConfig(8, 4, 0)  # grown back
    assert scaler.decide(None, None, 2, 2, on_two)[0] is on_two  # unchanged: kept as is
    big = BatchConfig.of(16, 1, 3)  # 4 micro-batches of 4 on one replica
    assert scaler.decide(None, None, 1, 1, big)[0] == BatchConfig(16, 4, 3)
    assert scaler.decide(None, None, 1, 4, big)[0] == BatchConfig(16, 4, 0)


def test_hysteresis_keeps_a_nearly_optimal_batch_and_switches_on_a_real_gain() -> None:
    scaler = Autoscaler(BASE, 1024, (8, 256))
    gns = noise(400.0)
    best, choice = scaler.decide(PARAMS, gns, 1, 2, BatchConfig.of(BASE, 2))
    assert best.global_bsz > BASE
    # a neighbour of the optimum predicted within 5%: kept
    near = BatchConfig.of(best.global_bsz + 2, 2)
    kept, kept_choice = scaler.decide(PARAMS, gns, 1, 2, near)
    assert kept == near and kept_choice.goodput >= choice.goodput / 1.05
    # the base batch is far worse: switch to the optimum
    assert scaler.decide(PARAMS, gns, 1, 2, BatchConfig.of(BASE, 2))[0] == best
    # a higher threshold keeps even the base batch when the gain is below it
    gain = choice.goodput / scaler.decide(PARAMS, gns, 1, 2, BatchConfig.of(BASE, 2))[1].goodput
    lazy = Autoscaler(BASE, 1024, (8, 256), threshold=10.0)
    if gain < 11.0:
        assert lazy.decide(PARAMS, gns, 1, 2, BatchConfig.of(BASE, 2))[0].global_bsz == BASE


def test_training_with_noisy_gradients_grows_the_batch() -> None:
    data = regression_data(4096, noise=20.0)
    got = train(None, batch_size=BASE, lr=0.002, data=data, epochs=2,
                autoscale={"max_batch_size": 512, "local_bsz_bounds": (8, 128),
                           "gradient_accumulation": True},
                options={"max_stats_every": 1})  # tiny steps: statistics on every step
    assert got["batch_size"] > BASE
    assert got["batch_size"] <= 512
    # a single replica beyond the base batch keeps two micro-batches (measurable noise)
    assert got["accum_steps"] >= 1
    assert got["progress"] > got["steps"]  # larger batches were worth more than one step


@pytest.mark.slow
def test_two_ranks_agree_on_every_decision(tmp_path: Path) -> None:
    data = regression_data(4096, noise=20.0)
    results = spawn(train_worker, 2, tmp_path, steps=None, batch_size=BASE, lr=0.002,
                    data=data, epochs=2,
                    autoscale={"max_batch_size": 512, "local_bsz_bounds": (8, 128),
                               "gradient_accumulation": True},
                    options={"max_stats_every": 2})
    a, b = results
    assert a["batch_size"] == b["batch_size"] > BASE
    assert a["sizes"] == b["sizes"]  # same micro-batch sizes, step by step
    for k in a["params"]:
        torch.testing.assert_close(a["params"][k], b["params"][k], rtol=0, atol=0)
    assert a["progress"] == b["progress"]


def test_autoscaling_says_which_parameters_the_noise_scale_leaves_out() -> None:
    """Parameters on parameter servers keep their gradients with their owners: turning
    autoscaling on in a job of several workers names them (one worker has no servers)."""
    from torch.utils.data import TensorDataset

    from stratagem.adapt import AdaptiveTrainer
    from stratagem.data import DistributedDataLoader

    class OnServers(torch.nn.Linear):
        server_parameters = ["emb.weight", "fc.bias", "fc.weight", "out.weight"]

    data = TensorDataset(torch.randn(64, 3))
    for world, said in ((2, True), (1, False)):
        model = OnServers(3, 1)
        lines: list[str] = []
        trainer = AdaptiveTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  world_size=world, log=lines.append)
        loader = DistributedDataLoader(data, 8, rank=0, world_size=world)
        loader.hooks = trainer
        assert not trainer.needs_gradient_statistics
        loader.autoscale_batch_size(32)
        assert trainer.needs_gradient_statistics
        assert any("4 parameter(s) on parameter servers (emb.weight, fc.bias, fc.weight, "
                   "...)" in line for line in lines) == said, lines
