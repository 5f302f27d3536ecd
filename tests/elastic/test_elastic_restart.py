"""Stop a torchrun job mid-epoch with SIGTERM and restart it with another world size.

One job, three launches: 2 workers (stopped inside step 2, epoch 0), 1 worker launched as an
elastic job with ``--nnodes 1:2`` (stopped inside step 7, epoch 1, after the batch size
changed), 3 workers (runs to the end). Every sample of every epoch must be trained exactly
once, in the global batches of an uninterrupted run, and the final model and optimizer must
match an uninterrupted single-process run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _state import assert_state_close
from elastic_job import EPOCHS, N, reference, reference_batches
from harness import logged_steps, torchrun

from stratagem import checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    out = tmp_path_factory.mktemp("out")
    ckpt = out / "ckpt"
    runs = [torchrun(2, out, ckpt, stop_at=2)]
    runs.append(torchrun(1, out, ckpt, stop_at=7, elastic_nnodes=True))
    runs.append(torchrun(3, out, ckpt))
    return out, ckpt, runs


def test_stopped_runs_saved_and_final_run_completed(chain: tuple[Path, Path, list]) -> None:
    out, ckpt, runs = chain
    for run in runs[:2]:
        assert "job state saved to" in run.log, run.log[-3000:]
    assert runs[2].returncode == 0, runs[2].log[-3000:]
    assert (out / "final.pt").is_file()
    # The two newest checkpoints are kept; the last one was written by the 1-worker run.
    kept = checkpoint.CheckpointDir(ckpt).checkpoints()
    assert [p.name for p in kept] == ["ckpt-00000001", "ckpt-00000002"]
    assert checkpoint.read_meta(kept[-1])["world_size"] == 1
    # Each run is on other workers than the checkpoint's: each plans anew.
    runs = [json.loads(p.read_text()) for p in out.glob("run-*.json")]
    assert sorted((r["world"], r["planned"]) for r in runs) == [(1, True), (2, True),
                                                                 (3, True)], runs


def test_every_sample_exactly_once_per_epoch(chain: tuple[Path, Path, list]) -> None:
    out, _, _ = chain
    steps = logged_steps(out)
    batches = reference_batches()
    assert sorted(steps) == list(range(1, len(batches) + 1)), "a step was lost or repeated"
    worlds = {}
    seen: dict[int, list[int]] = {e: [] for e in range(EPOCHS)}
    for step, recs in steps.items():
        world = recs[0]["world"]
        worlds[step] = world
        assert sorted(r["rank"] for r in recs) == list(range(world)), f"step {step}"
        global_batch = sum((r["ids"] for r in sorted(recs, key=lambda r: r["rank"])), [])
        assert global_batch == batches[step - 1], f"step {step}: not the reference batch"
        seen[recs[0]["epoch"]] += global_batch
    for epoch, ids in seen.items():
        assert sorted(ids) == list(range(N)), f"epoch {epoch}"
    assert [worlds[s] for s in sorted(worlds)] == [2, 2] + [1] * 5 + [3] * 6


def test_final_state_matches_uninterrupted_single_process(
        chain: tuple[Path, Path, list]) -> None:
    out, _, _ = chain
    got = torch.load(out / "final.pt", weights_only=True)
    assert_state_close(got, reference())
