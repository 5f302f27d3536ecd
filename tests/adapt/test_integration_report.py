"""Per-epoch progress line on rank 0 and TensorBoard scalars."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from integration_workers import make_model, regression_data
from torch import nn

import stratagem as sg
from stratagem.adapt import EpochReport


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag] = (value, step)


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    yield


def test_line_is_readable() -> None:
    report = EpochReport(epoch=3, steps=120, global_bsz=384, num_replicas=2, local_bsz=96,
                         accum_steps=1, lr_factor=4.9, gain=4.9, throughput=5200.0,
                         goodput=4300.0, efficiency=0.83, noise_scale=1700.0,
                         progress=2104.3, adaptive=True)
    line = report.line()
    for part in ("epoch 3", "batch 384 (2 x 96 x 2 accum)", "lr x4.9", "goodput 4.3e+03/s",
                 "efficiency 0.83", "throughput 5.2e+03/s", "noise scale 1.7e+03"):
        assert part in line
    unknown = EpochReport(0, 1, 32, 1, 32, 0, 1.0, 1.0, None, None, None, None, 1.0)
    assert "?" not in unknown.line() and "goodput" not in unknown.line()
    fixed = EpochReport(0, 1, 32, 1, 32, 0, 1.0, 1.0, 900.0, 800.0, 0.9, 50.0, 1.0)
    assert "goodput" not in fixed.line() and "efficiency" not in fixed.line()


def test_epoch_line_and_tensorboard(capsys: pytest.CaptureFixture[str]) -> None:
    ad = sg.AutoDist(verbose=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ad.distribute(model, opt)
    loader = ad.data_loader(regression_data(512, noise=5.0), batch_size=32, shuffle=True)
    loader.autoscale_batch_size(256, (8, 64), gradient_accumulation=True)
    writer = FakeWriter()
    for epoch in ad.remaining_epochs_until(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        loader.to_tensorboard(writer, epoch, tag_prefix="adapt")
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("stratagem: epoch ")]
    assert len(lines) == 2 and "batch " in lines[0] and "throughput" in lines[0]
    assert writer.scalars["adapt/Total_Batch_Size"] == (float(loader.batch_size), 1)
    for tag in ("Local_Batch_Size", "Accumulation_Steps", "Learning_Rate_Factor", "Gain",
                "Throughput", "Gradient_Noise_Scale", "Progress"):
        assert f"adapt/{tag}" in writer.scalars
