"""The metrics file of a known short run: one record per optimizer step, with the batch
sizes the loader must have produced and the losses the script reported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.errors import StratagemError
from stratagem.observe import read_metrics

DIM = 4


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STRATAGEM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("STRATAGEM_PROGRESS", "off")
    yield tmp_path / "run"


def _data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, DIM, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def test_one_record_per_step_with_reported_losses(single_process: Path) -> None:
    ad = sg.AutoDist(verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(DIM, 1)
    model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = ad.data_loader(_data(100), batch_size=32)  # 32, 32, 32, 4 per epoch
    reported = []
    for epoch in ad.remaining_epochs_until(2):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if i == 1:  # before the step: belongs to the step about to run
                ad.log_metrics(loss=loss.detach(), before=1.0)
                opt.step()
            else:  # after the step: belongs to the step just taken
                opt.step()
                ad.log_metrics(loss=loss.item())
            reported.append((epoch, loss.item()))
    records = read_metrics(single_process)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["epoch"] for r in records] == [e for e, _ in reported]
    assert [r["batch_size"] for r in records] == [32, 32, 32, 4] * 2
    assert [r["loss"] for r in records] == pytest.approx([v for _, v in reported])
    assert [r.get("before") for r in records] == [None, 1.0, None, None] * 2
    for r in records:
        assert r["replicas"] == 1 and r["lr_factor"] == 1.0 and r["adaptive"] is False
        assert "efficiency" not in r  # not an adaptive job
        assert r["allreduce_bytes"] == 0.0  # a single process sends nothing
        assert r["step_time_s"] > 0 and r["samples_per_s"] == pytest.approx(
            r["batch_size"] / r["step_time_s"])
        assert 0 <= r["compute_s"] <= r["step_time_s"]
    assert records[-1]["time"] >= records[0]["time"]


def test_adaptive_run_records_batch_changes_and_efficiency(single_process: Path) -> None:
    ad = sg.AutoDist(verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ad.distribute(model, opt, adaptive=sg.adapt.TrainerConfig(
        decision_interval=5))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, DIM, generator=g)
    noisy = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)
                                           + 5.0 * torch.randn(512, 1, generator=g))
    loader = ad.data_loader(noisy, batch_size=32, shuffle=True)
    loader.autoscale_batch_size(256, (8, 64), gradient_accumulation=True)
    steps = 0
    for _ in ad.remaining_epochs_until(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            steps += 1
    records = read_metrics(single_process)
    assert 0 < len(records) <= steps  # one per optimizer step (accumulation micro-steps not)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert sum(r["batch_size"] for r in records) == 2 * 512  # every sample, once per epoch
    assert all(r["adaptive"] is True for r in records)
    known = [r for r in records if r.get("noise_scale") is not None]
    assert known and all("efficiency" in r for r in known)
    for r in known:  # Pollux: E(M) = (phi + M0) / (phi + M), phi the noise scale, M0 = 32
        phi = r["noise_scale"]
        assert r["efficiency"] == pytest.approx((phi + 32) / (phi + r["batch_size"]))


def test_reserved_and_non_numeric_values_are_refused(single_process: Path) -> None:
    ad = sg.AutoDist(verbose=False)
    model = nn.Linear(DIM, 1)
    ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(StratagemError, match="set by Stratagem"):
        ad.log_metrics(step=3)
    with pytest.raises(StratagemError, match="not a number"):
        ad.log_metrics(loss="low")


def test_torn_last_line_is_skipped_other_bad_lines_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1}]
    path.write_text("[1]\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(StratagemError, match="line 1"):
        read_metrics(path)
    with pytest.raises(StratagemError, match="no metrics file"):
        read_metrics(tmp_path / "nowhere")


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass


def test_tensorboard_scalars_match_the_metrics_file(single_process: Path) -> None:
    from stratagem.adapt.step_metrics import StepRecorder
    from stratagem.observe import MetricsFile

    writer = FakeWriter()
    recorder = StepRecorder(MetricsFile(single_process), None, writer)
    recorder.begin_epoch()
    for step, loss in ((1, 0.9), (2, 0.5)):
        recorder.step({"step": step, "epoch": 0, "batch_size": 8, "adaptive": False}, 8)
        recorder.log({"loss": loss})
    recorder.close()
    records = read_metrics(single_process)
    tags = {(tag, step): value for tag, value, step in writer.scalars}
    for r in records:
        assert tags[("stratagem/loss", r["step"])] == r["loss"]
        assert tags[("stratagem/batch_size", r["step"])] == 8
        assert tags[("stratagem/samples_per_s", r["step"])] == r["samples_per_s"]
    assert not any(tag in ("stratagem/step", "stratagem/adaptive") for tag, _, _ in
                   writer.scalars)


def test_tensorboard_dir_without_tensorboard_warns_and_trains(
        single_process: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STRATAGEM_TENSORBOARD_DIR", str(single_process / "tb"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        ad = sg.AutoDist(verbose=False)
        model = nn.Linear(DIM, 1)
        ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert "tensorboard is not installed" in capsys.readouterr().err
        assert ad.adaptive.recorder.tensorboard is None
    else:  # installed: a real SummaryWriter writes event files
        ad = sg.AutoDist(verbose=False)
        model = nn.Linear(DIM, 1)
        model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in ad.data_loader(_data(16), batch_size=8):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        ad.adaptive.recorder.close()
        assert list((single_process / "tb").glob("events.out.tfevents.*"))
