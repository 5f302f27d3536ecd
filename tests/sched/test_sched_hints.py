"""A user's own job: the hints a real Stratagem adaptive run writes, simulated as a workload."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.adapt.hints import ENV_HINTS_FILE, ENV_HINTS_PORT
from stratagem.cli import main
from stratagem.elastic import state
from stratagem.sched.simulator.profile import load_profile


@pytest.fixture
def job_hints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Train a small regression model for 2 epochs with autoscaling; its hints.json."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", ENV_HINTS_PORT):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "job" / "hints.json"
    monkeypatch.setenv(ENV_HINTS_FILE, str(path))
    state.reset_states()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 5.0 * torch.randn(1024, 1, generator=g)
    ad = sg.AutoDist(verbose=False)
    model = nn.Linear(6, 1)
    model, opt = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = ad.data_loader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    loader.autoscale_batch_size(256, (8, 64), gradient_accumulation=True)
    for _ in ad.remaining_epochs_until(2):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    ad.adaptive.publish()
    yield path
    state.reset_states()


def test_hints_of_a_real_run_simulate_as_a_workload(job_hints, tmp_path, capsys):
    root = tmp_path / "profiles" / "regress"
    root.mkdir(parents=True)
    shutil.copy(job_hints, root / "hints.json")
    (root / "profile.json").write_text(json.dumps({"epochs": 20}))
    hints = json.loads(job_hints.read_text())
    profile = load_profile(root)
    assert profile.base_batch_size == 32 and profile.epochs == 20
    plain = [m for m in hints["profile"] if m["accum_steps"] == 0]
    assert plain, hints["profile"]
    for m in plain:  # measured configurations come back as measured
        assert profile.step_time((m["num_replicas"],), m["local_bsz"])[0] == pytest.approx(
            m["step_time"])
    workload = tmp_path / "mine.csv"
    workload.write_text("name,time,application,num_replicas,batch_size\n"
                        + "".join(f"r{i},{30 * i},regress,1,32\n" for i in range(6)))
    out = tmp_path / "out"
    assert main(["simulate", str(workload), "--profiles", str(tmp_path / "profiles"),
                 "--policy", "pollux,fifo", "--nodes", "2", "--out", str(out)]) == 0
    assert "mine" in capsys.readouterr().out
    for policy in ("pollux", "fifo"):
        summary = json.loads((out / "mine" / policy / "result.json").read_text())["summary"]
        assert summary["completed"] == 6 and summary["mean_jct"] > 0
