"""Each test starts with an empty job-state registry and its own checkpoint directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stratagem.elastic import state


@pytest.fixture(autouse=True)
def job_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The checkpoint directory ($STRATAGEM_CHECKPOINT_DIR) of a fresh single-process job."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "ADAPTDL_CHECKPOINT_PATH", "STRATAGEM_RESOURCE_SPEC", "STRATAGEM_STRATEGY"):
        monkeypatch.delenv(var, raising=False)
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv(state.ENV_CHECKPOINT_DIR, str(ckpt))
    yield ckpt
