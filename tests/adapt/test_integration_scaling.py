"""The scaling-rule wrapper: LR scaled only inside optimizer.step, transparent accumulation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from integration_workers import make_model, regression_data
from torch import nn

import stratagem as sg
from stratagem.elastic import drop_job


class RecordingSGD(torch.optim.SGD):
    """Records the learning rate each real step runs with."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    def step(self, closure=None):  # type: ignore[override]
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    yield


def setup(rule=None, optimizer=RecordingSGD, lr=0.1, batch_size=16, n=256):
    ad = sg.AutoDist(verbose=False)
    model = make_model()
    opt = optimizer(model.parameters(), lr=lr)
    model, opt = ad.distribute(model, opt, scaling_rule=rule)
    loader = ad.data_loader(regression_data(n), batch_size=batch_size)
    return ad, model, opt, loader


def run_epoch(model, opt, loader, between=None) -> int:
    count = 0
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        count += 1
        if between is not None:
            between()
    return count


def test_lr_is_scaled_only_during_the_step() -> None:
    ad, model, opt, loader = setup(sg.adapt.LinearScale())
    loader.batch_size = 64  # 4x the base batch
    lrs_between: list[float] = []
    run_epoch(model, opt, loader, lambda: lrs_between.append(opt.param_groups[0]["lr"]))
    assert opt.seen == [pytest.approx(0.4)] * 4
    assert lrs_between == [0.1] * 4  # the user's LR is untouched outside step()
    assert ad.adaptive.lr_factor == pytest.approx(4.0)


def test_base_batch_runs_at_the_users_lr() -> None:
    _, model, opt, loader = setup()
    run_epoch(model, opt, loader)
    assert opt.seen == [0.1] * 16


def test_default_rule_by_optimizer_type() -> None:
    ad, *_ = setup(optimizer=torch.optim.Adam)
    assert isinstance(ad.adaptive.rule, sg.adapt.AdamScale)
    assert ad.adaptive.gns is None or ad.adaptive.gns.preconditioned
    drop_job()
    ad, *_ = setup(optimizer=torch.optim.SGD)
    assert isinstance(ad.adaptive.rule, sg.adapt.AdaScale)


def test_accumulation_steps_and_zero_grads_are_transparent() -> None:
    ad, model, opt, loader = setup(sg.adapt.LinearScale())
    loader.batch_size, loader.accum_steps = 64, 3
    assert run_epoch(model, opt, loader) == 16  # micro-batches handed out
    assert opt.seen == [pytest.approx(0.4)] * 4  # one real step per global batch
    assert ad.adaptive.steps == 4


def test_zero_grad_after_step_style_also_accumulates() -> None:
    _, model, opt, loader = setup()
    loader.accum_steps = 1
    norms = []
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(model.module.weight.grad.norm().item())
        opt.step()
        opt.zero_grad()  # skipped after the accumulation micro-step
    assert len(norms) == 32 and all(n > 0 for n in norms)


def test_lr_scheduler_follows_progress() -> None:
    ad, model, opt, loader = setup(sg.adapt.LinearScale())
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda _: 1.0 / (1.0 + 0.1 * ad.adaptive.tracker.progress)
        if ad.adaptive.tracker else 1.0)
    loader.batch_size = 32
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    progress = ad.adaptive.tracker.progress
    assert 8.0 <= progress <= 16.0  # 8 steps at twice the base batch: gain in [1, 2] each
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / (1 + 0.1 * progress))
    assert opt.seen[0] == pytest.approx(0.2)  # LinearScale x2 on top of the schedule
