"""SIGTERM during a step, in one process: the step completes, the job state is saved, the
process exits 143, and the restarted job ends exactly where an uninterrupted one does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from elastic_job import N, reference, reference_batches, train
from harness import logged_steps

from stratagem import checkpoint
from stratagem.adapt import EXIT_CODE
from stratagem.elastic import drop_job


def _sigterm_at(step: int):
    def hook(current: int) -> None:
        if current == step:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step: after backward, before step()
    return hook


def _stopped(out: Path, step: int) -> None:
    with pytest.raises(SystemExit) as exc:
        train(out, on_step=_sigterm_at(step))
    assert exc.value.code == EXIT_CODE
    drop_job()  # the "restart": a fresh process would start with nothing registered


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for pid, state in want["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v), f"{pid}.{k}"


@pytest.mark.parametrize("stop", [2, 5, 13], ids=["mid-epoch", "epoch-end", "last-step"])
def test_sigterm_during_step_loses_nothing(tmp_path: Path, job_state: Path, stop: int) -> None:
    _stopped(tmp_path, stop)
    meta = checkpoint.read_meta(checkpoint.CheckpointDir(job_state).checkpoints()[-1])
    assert set(meta["states"]) == {"model", "sync", "optimizer", "loader", "epoch", "steps",
                                   "strategy"}
    final = train(tmp_path)
    _assert_equal(final, reference())  # bitwise: same world size, nothing lost or redone
    steps = logged_steps(tmp_path)
    batches = reference_batches()
    assert sorted(steps) == list(range(1, len(batches) + 1))
    assert all(len(recs) == 1 and recs[0]["ids"] == batches[s - 1]
               for s, recs in steps.items())


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path: Path,
                                                          job_state: Path) -> None:
    _stopped(tmp_path, 3)
    _stopped(tmp_path, 8)
    first, latest = checkpoint.CheckpointDir(job_state).checkpoints()
    with (latest / "model.pt").open("r+b") as f:
        f.seek(64)
        f.write(b"\xffcorrupt")
    with pytest.warns(UserWarning, match=r"ckpt-00000002 is unusable \(checksum mismatch"):
        final = train(tmp_path)
    _assert_equal(final, reference())  # steps 4-8 redone from the previous checkpoint
    steps = logged_steps(tmp_path)
    assert [len(steps[s]) for s in sorted(steps)] == [1] * 3 + [2] * 5 + [1] * 5
    assert (job_state / "ckpt-00000002.corrupt").is_dir()
    assert first.is_dir()


def test_every_sample_once_when_stopped_twice_in_one_epoch(tmp_path: Path) -> None:
    _stopped(tmp_path, 6)
    _stopped(tmp_path, 7)
    train(tmp_path)
    by_epoch: dict[int, list[int]] = {}
    for recs in logged_steps(tmp_path).values():
        by_epoch.setdefault(recs[0]["epoch"], []).extend(recs[0]["ids"])
    assert all(sorted(ids) == list(range(N)) for ids in by_epoch.values())
