"""sg.adapt.Accumulator: local updates, sums over replicas, kept across restarts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_workers import accumulator_worker, spawn

import stratagem as sg
from stratagem.elastic import drop_job, state


@pytest.fixture(autouse=True)
def fresh_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(state.ENV_CHECKPOINT_DIR, str(tmp_path / "ckpt"))
    yield tmp_path / "ckpt"


def test_accumulation_mode_reads_as_empty_and_sums_on_sync() -> None:
    stats = sg.adapt.Accumulator(start=1)
    stats["loss"] += 2.5
    stats["loss"] += 0.5
    stats += {"n": 3}
    stats -= {"n": 1}
    assert len(stats) == 0 and "loss" not in stats
    with pytest.raises(TypeError):
        stats["loss"] = 4
    with stats.synchronized():
        assert dict(stats) == {"start": 1, "loss": 3.0, "n": 2}
        stats["avg"] = stats["loss"] / stats["n"]
    with stats.synchronized():
        assert stats["avg"] == 1.5
        stats.clear()
    with stats.synchronized():
        assert len(stats) == 0


def test_values_survive_a_restart(fresh_job: Path) -> None:
    stats = sg.adapt.Accumulator()
    stats["seen"] += 5
    sg.adapt.save_all_states()  # syncs pending updates first
    drop_job()
    again = sg.adapt.Accumulator()
    with again.synchronized():
        assert again["seen"] == 5


@pytest.mark.slow
def test_synchronized_sums_over_two_ranks(tmp_path: Path) -> None:
    for result in spawn(accumulator_worker, 2, tmp_path):
        assert result["first"] == {"n": 3, "loss": 1.5, "only_rank1": 7}
        assert result["second"] == {"n": 23, "loss": 1.5, "only_rank1": 7, "mean": 0.5}
