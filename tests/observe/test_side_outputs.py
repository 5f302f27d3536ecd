"""Side outputs never end training (issue 47 item 9): a full or unwritable run directory,
TensorBoard directory or hints file warns once and training goes on; a failed checkpoint
write leaves no temporary file or directory holding the space."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem import checkpoint
from stratagem.adapt.hints import HintsPublisher
from stratagem.adapt.step_metrics import StepRecorder
from stratagem.elastic import background_save
from stratagem.observe import MetricsFile, read_metrics

FULL = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(autouse=True)
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH",
                "STRATAGEM_TENSORBOARD_DIR", "STRATAGEM_HINTS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STRATAGEM_PROGRESS", "off")
    yield


def _train(steps_wanted: int = 8) -> int:
    ad = sg.AutoDist(verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8 * steps_wanted, 4, generator=torch.Generator().manual_seed(0))
    steps = 0
    for xb, yb in ad.data_loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                 batch_size=8):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        ad.log_metrics(loss=loss.item())
        steps += 1
    ad.adaptive.recorder.close()
    return steps


def test_a_run_dir_that_cannot_be_created_warns_once(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("STRATAGEM_RUN_DIR", str(blocker / "run"))  # a file in the way
    assert _train() == 8
    err = capsys.readouterr().err
    assert err.count("cannot write the metrics file") == 1 and "training goes on" in err


def test_a_full_disk_under_the_metrics_file_warns_once(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    monkeypatch.setenv("STRATAGEM_RUN_DIR", str(tmp_path / "run"))
    writes = {"n": 0}
    append = MetricsFile._append

    def fill_after_three(self: MetricsFile, line: str) -> bool:
        writes["n"] += 1
        if writes["n"] > 3:
            raise FULL
        return append(self, line)

    monkeypatch.setattr(MetricsFile, "_append", fill_after_three)
    assert _train() == 8
    err = capsys.readouterr().err
    assert err.count("cannot write the metrics file") == 1 and "No space left" in err
    assert writes["n"] == 4  # stopped after the failure: no line after a torn one
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


class FullWriter:
    """A SummaryWriter whose disk is full."""

    log_dir = "/tb"

    def __init__(self) -> None:
        self.calls = 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls += 1
        raise FULL

    def flush(self) -> None:
        raise FULL


def test_tensorboard_on_a_full_disk_warns_once(capsys: pytest.CaptureFixture[str]) -> None:
    writer = FullWriter()
    recorder = StepRecorder(None, None, writer)
    for step in range(1, 4):
        recorder._held = {"step": step, "loss": 1.0}
        recorder.flush()
    recorder.close()
    err = capsys.readouterr().err
    assert err.count("cannot write TensorBoard scalars to /tb") == 1
    assert writer.calls == 1


def test_hints_on_a_full_disk_warn_once_and_leave_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt" / "hints.json"
    publisher = HintsPublisher(path=path, port=None)
    full = {"on": True}
    fsync = __import__("os").fsync

    def maybe_full(fd: int) -> None:
        if full["on"]:
            raise FULL
        fsync(fd)

    monkeypatch.setattr("stratagem.adapt.hints.os.fsync", maybe_full)
    publisher.publish({"version": 1, "n": 1})
    publisher.publish({"version": 1, "n": 2})
    assert list(path.parent.iterdir()) == []  # no .hints.json.PID.tmp holding the space
    assert capsys.readouterr().err.count("cannot write the hints file") == 1
    full["on"] = False  # space again: the next publish writes the whole file
    publisher.publish({"version": 1, "n": 3})
    assert '"n": 3' in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["hints.json"]


def test_a_failed_collective_save_leaves_no_tmp_directory(tmp_path: Path) -> None:
    def write(tmp: Path) -> None:
        (tmp / "model.pt").write_bytes(b"x" * 4096)
        raise FULL

    series = checkpoint.CheckpointDir(tmp_path / "ckpt")
    with pytest.raises(OSError, match="No space left"):
        series.save(write)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_failed_background_save_leaves_no_tmp_directory(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    written: list[Path] = []

    def fill(path: Path, data: bytes) -> None:
        path.write_bytes(data[:100])  # part of it landed, then the disk was full
        written.append(path)
        raise FULL

    monkeypatch.setattr(background_save.ckpt, "write_durably", fill)
    series = checkpoint.CheckpointDir(tmp_path / "ckpt")
    save = background_save.BackgroundSave(series, 1, 7, {"model.pt": b"y" * 4096}, {})
    save.start()
    with pytest.raises(Exception, match="No space left"):
        save.wait()
    assert written and list((tmp_path / "ckpt").iterdir()) == []
