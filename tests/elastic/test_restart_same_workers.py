"""A job stopped with SIGTERM and restarted on the same two workers keeps the strategy Auto
planned in its first run (saved with the checkpoint): no planning again, no flip to
another plan on timing noise, and training still ends where one process ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from elastic_job import reference
from harness import torchrun

pytestmark = pytest.mark.slow


def test_restart_on_the_same_workers_keeps_the_checkpoints_strategy(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = torchrun(2, tmp_path, ckpt, stop_at=2)
    assert "job state saved to" in first.log, first.log[-3000:]
    second = torchrun(2, tmp_path, ckpt)
    assert second.returncode == 0, second.log[-3000:]
    runs = sorted((json.loads(p.read_text()) for p in tmp_path.glob("run-*.json")),
                  key=lambda r: not r["planned"])
    assert [(r["world"], r["planned"]) for r in runs] == [(2, True), (2, False)], runs
    assert runs[1]["strategy"] == runs[0]["strategy"]
    assert "Resumed with the checkpoint's strategy" in runs[1]["explain"]
    got = torch.load(tmp_path / "final.pt", weights_only=True)
    for k, v in reference()["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-5, atol=1e-7, msg=k)
