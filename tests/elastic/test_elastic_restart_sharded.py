"""Checkpoint-restart of a sharded (ZeRO) job onto other world sizes (issue 45 item 3).

One job, two torchrun launches: 4 workers with ZeRO-3 (FSDP2; stopped by SIGTERM inside
step 5: every rank writes its pieces of the model and optimizer state), then 2 workers with
ZeRO-2 to the end (restored by joining the pieces; one process restoring from pieces is
tested in tests/runtime/test_sharded_checkpoint.py). Every sample is trained once in the
reference's global batches, and the final model and optimizer equal an uninterrupted
single-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _state import assert_state_close
from elastic_job import reference, reference_batches
from harness import logged_steps, torchrun

from stratagem import checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    out = tmp_path_factory.mktemp("out")
    ckpt = out / "ckpt"
    runs = [torchrun(4, out, ckpt, stop_at=5, args=("--zero", "3"))]
    first = checkpoint.CheckpointDir(ckpt).checkpoints()
    runs.append(torchrun(2, out, ckpt, args=("--zero", "2")))
    return out, first[-1] if first else ckpt, runs


def test_runs_saved_sharded_and_completed(chain: tuple[Path, Path, list]) -> None:
    out, first, runs = chain
    assert "job state saved to" in runs[0].log, runs[0].log[-3000:]
    assert runs[1].returncode == 0, runs[1].log[-3000:]
    meta = checkpoint.read_meta(first)  # the 4-worker ZeRO-3 save: pieces from each rank
    assert meta["states"]["model"]["shards"] == 4
    assert meta["states"]["optimizer"]["shards"] == 4
    assert all((first / f"model-shard{r}.pt").is_file() for r in range(4))
    assert not (first / "model.pt").exists()


def test_steps_follow_the_worlds_once_each(chain: tuple[Path, Path, list]) -> None:
    out, _, _ = chain
    steps = logged_steps(out)
    batches = reference_batches()
    assert sorted(steps) == list(range(1, len(batches) + 1)), "a step was lost or repeated"
    worlds = [steps[s][0]["world"] for s in sorted(steps)]
    assert worlds == [4] * 5 + [2] * (len(batches) - 5), worlds
    for step, recs in steps.items():
        assert all(r["sharded"] == (r["world"] > 1) for r in recs)
        ids = sum((r["ids"] for r in sorted(recs, key=lambda r: r["rank"])), [])
        assert ids == batches[step - 1], f"step {step}: not the reference batch"


def test_final_state_matches_uninterrupted_single_process(
        chain: tuple[Path, Path, list]) -> None:
    out, _, _ = chain
    got = torch.load(out / "final.pt", weights_only=True)
    assert_state_close(got, reference())
