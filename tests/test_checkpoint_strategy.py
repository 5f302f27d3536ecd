"""The strategy a job trains with travels in its checkpoints (strategy.json), so a run can be
repeated with ``--strategy CKPT/strategy.json`` (issue 12: Auto's choice is reproducible)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem import checkpoint, elastic
from stratagem.elastic import drop_job


def _distributed(builder: str) -> tuple[sg.AutoDist, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ad = sg.AutoDist(strategy_builder=builder, verbose=False)
    dist_model, _ = ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return ad, dist_model


@pytest.mark.parametrize("builder", ["AllReduce", "Auto"])
def test_save_checkpoint_writes_the_strategy_it_trained_with(tmp_path: Path,
                                                             builder: str) -> None:
    ad, _ = _distributed(builder)
    path = ad.save_checkpoint(tmp_path / "ckpt")
    checkpoint.verify(path)  # strategy.json is listed in meta.json and checksummed
    saved = sg.Strategy.load(path / checkpoint.STRATEGY)
    assert saved.id == ad.strategy.id
    assert saved.to_dict() == ad.strategy.to_dict()


def test_elastic_checkpoints_carry_the_strategy_and_a_changed_plan_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ad, _ = _distributed("AllReduce")
    path = elastic.save_all_states(tmp_path)
    assert path is not None
    assert sg.Strategy.load(path / "strategy.json").id == ad.strategy.id
    drop_job()  # a restart that now plans another strategy
    logged: list[str] = []
    monkeypatch.setattr(sg.AutoDist, "log", lambda self, m: logged.append(m))
    monkeypatch.setenv("STRATAGEM_CHECKPOINT_DIR", str(tmp_path))
    ad2, _ = _distributed("PartitionedAR")
    assert ad2.strategy.id != ad.strategy.id
    (said,) = [m for m in logged if ad.strategy.id in m]
    assert "strategy.json" in said and ad2.strategy.id in said
    # ...and what differs: PartitionedAR splits 0.weight [8, 4] where AllReduce did not
    assert "0.weight: AllReduce(" in said and "-> partitioned" in said, said


def test_a_restart_with_the_same_plan_says_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49: ids were random, so every restart said "trained with strategy X, this run
    uses Y" for the identical strategy; they are content hashes now."""
    ad, _ = _distributed("AllReduce")
    assert elastic.save_all_states(tmp_path) is not None
    drop_job()
    logged: list[str] = []
    monkeypatch.setattr(sg.AutoDist, "log", lambda self, m: logged.append(m))
    monkeypatch.setenv("STRATAGEM_CHECKPOINT_DIR", str(tmp_path))
    ad2, _ = _distributed("AllReduce")
    assert ad2.strategy.id == ad.strategy.id
    assert not [m for m in logged if "checkpoint was trained" in m], logged


def test_saved_strategy_reproduces_an_auto_run(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``stratagem run --strategy CKPT/strategy.json`` (STRATAGEM_STRATEGY) over a script that
    asks for Auto: the saved strategy is used as it is, not planned anew."""
    ad, _ = _distributed("Auto")
    path = ad.save_checkpoint(tmp_path / "ckpt")
    drop_job()
    monkeypatch.setenv("STRATAGEM_STRATEGY", str(path / checkpoint.STRATEGY))
    again, _ = _distributed("Auto")
    assert again.choice is None  # nothing planned
    assert again.strategy.to_dict()["node_config"] == ad.strategy.to_dict()["node_config"]
