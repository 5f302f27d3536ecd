"""Gradient accumulation through the loader equals one big batch (1 and 2 processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from integration_workers import (
    reference_big_batch,
    regression_data,
    spawn,
    train,
    train_worker,
)

# 1000 samples, batch 97 in 4 micro-batches: micro-batches of 25/24/24/24 and a last global
# batch of 30 (8/8/7/7), so per-rank micro-batch sizes differ (the rescaling path).
N, BATCH, ACCUM = 1000, 97, 3


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH",
                "STRATAGEM_RESOURCE_SPEC", "STRATAGEM_STRATEGY", "STRATAGEM_HINTS_PORT"):
        monkeypatch.delenv(var, raising=False)
    yield


def assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_one_process_accumulation_equals_big_batch() -> None:
    data = regression_data(N)
    got = train(None, batch_size=BATCH, accum_steps=ACCUM, data=data)
    steps = -(-N // BATCH)
    assert got["steps"] == steps
    assert got["micro_batches"] == steps * (ACCUM + 1)
    assert sum(got["sizes"]) == N  # every sample once
    assert_params_close(got["params"], reference_big_batch(steps, BATCH, data=data))


def test_accumulation_off_matches_too() -> None:
    data = regression_data(N)
    got = train(None, batch_size=BATCH, data=data)
    assert_params_close(got["params"], reference_big_batch(-(-N // BATCH), BATCH, data=data))


@pytest.mark.slow
def test_two_processes_accumulation_equals_big_batch(tmp_path: Path) -> None:
    data = regression_data(N)
    results = spawn(train_worker, 2, tmp_path, steps=None, batch_size=BATCH,
                    accum_steps=ACCUM, data=data)
    want = reference_big_batch(-(-N // BATCH), BATCH, data=data)
    for r in results:
        assert_params_close(r["params"], want)
    assert sum(sum(r["sizes"]) for r in results) == N
