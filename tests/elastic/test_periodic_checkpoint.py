"""Periodic checkpoints (``STRATAGEM_CHECKPOINT_STEPS``/``_SECONDS``) and resuming from one
after a crash: the job continues as if nothing happened (single process, in-process)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import _spawn
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import stratagem as sg
from stratagem import env
from stratagem.checkpoint import CheckpointDir, job_store
from stratagem.elastic import (
    background_save,
    boundary,
    exit_point,
    job_context,
    register_state,
    wait_for_checkpoint,
)
from stratagem.elastic.context import current_job
from stratagem.elastic.state import ObjectState, load_state
from stratagem.errors import CheckpointError

N, BATCH, EPOCHS = 20, 2, 2  # 10 steps per epoch


class Crash(Exception):
    pass


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g),
                         torch.randn(N, 1, generator=g))


def _job() -> tuple[sg.AutoDist, nn.Linear, nn.Module, torch.optim.Optimizer, Any]:
    """The job's objects: Adam on a linear model, a shuffled loader (restored if there is
    a checkpoint)."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    ad = sg.AutoDist(verbose=False)
    model, opt = ad.distribute(plain, torch.optim.Adam(plain.parameters(), lr=0.05))
    return ad, plain, model, opt, ad.data_loader(_data(), batch_size=BATCH, shuffle=True,
                                                 seed=7)


def _train(crash_at: int | None = None, seen: list[int] | None = None) -> nn.Module:
    """The job: Adam on a linear model, shuffled; raises Crash before step ``crash_at``'s
    optimizer step (like a SIGKILL: nothing saved after the previous checkpoint)."""
    with job_context():
        ad, plain, model, opt, loader = _job()
        steps = {"n": 0}
        load_state(ObjectState("steps", lambda: dict(steps), steps.update, format="json"))
        for _ in ad.remaining_epochs_until(EPOCHS):
            for ids, x, y in loader:
                steps["n"] += 1
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if steps["n"] == crash_at:
                    raise Crash
                if seen is not None:
                    seen += ids.tolist()
                opt.step()
        return plain


def _newest(root: Path) -> Path:
    newest = CheckpointDir(root).latest_good()
    assert newest is not None
    return newest


def test_a_checkpoint_every_k_steps(job_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.CHECKPOINT_STEPS, "3")
    with pytest.raises(Crash):
        _train(crash_at=8)
    newest = _newest(job_state)
    assert newest.name == "ckpt-00000002"  # saved after steps 3 and 6 (numbered from 1)
    loader = json.loads((newest / "loader.json").read_text())
    assert (loader["epoch"], loader["offset"]) == (0, 6 * BATCH)
    assert json.loads((newest / "steps.json").read_text()) == {"n": 6}


def test_resuming_after_a_crash_trains_every_sample_once_and_ends_the_same(
        job_state: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(env.CHECKPOINT_STEPS, "4")
    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path / "calm"))
    calm = _train()
    monkeypatch.setenv(env.CHECKPOINT_DIR, str(job_state))
    before: list[int] = []
    with pytest.raises(Crash):
        _train(crash_at=15, seen=before)  # epoch 1, step 5; checkpoint after step 12
    after: list[int] = []
    resumed = _train(seen=after)
    kept = before[:12 * BATCH]  # what the checkpoint holds: 12 steps
    assert sorted(kept[:N]) == list(range(N))  # epoch 0 once
    assert sorted(kept[N:] + after) == list(range(N))  # epoch 1 once, across the crash
    for name, value in calm.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_a_checkpoint_every_t_seconds_on_rank_0s_clock(
        job_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.CHECKPOINT_SECONDS, "10")
    now = [0.0]
    monkeypatch.setattr(boundary, "clock", lambda: now[0])
    with job_context():
        value = {"v": 0}
        register_state("value", type("S", (), {"state_dict": lambda self: dict(value),
                                               "load_state_dict": value.update})())
        saved = []
        for t in (0, 5, 10, 12, 20, 22):  # the clock starts at the first boundary
            now[0] = float(t)
            value["v"] = t
            exit_point(step=True)
            wait_for_checkpoint()  # written in the background
            newest = CheckpointDir(job_state).latest_good()
            saved.append(newest.name if newest else None)
    # due at 10 (10 s after 0); then the clock restarts at 12: due at 22, not 20
    assert saved == [None, None, "ckpt-00000001", "ckpt-00000001", "ckpt-00000001",
                     "ckpt-00000002"]


def test_no_periodic_checkpoint_without_the_settings(job_state: Path) -> None:
    with job_context():
        for _ in range(5):
            exit_point(step=True)
    assert CheckpointDir(job_state).latest_good() is None


@pytest.mark.parametrize("var", [env.CHECKPOINT_STEPS, env.CHECKPOINT_SECONDS])
def test_bad_settings_name_the_variable(var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, "-2")
    with pytest.raises(sg.StratagemError, match=var):
        env.checkpoint_steps() if var == env.CHECKPOINT_STEPS else env.checkpoint_seconds()


def test_a_background_save_holds_its_steps_state_while_training_goes_on(
        job_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save after step 3 is still being written at step 5 (a slow writer); restored, it
    holds the parameters, optimizer state and loader position recorded at step 3."""
    monkeypatch.setenv(env.CHECKPOINT_STEPS, "3")
    written, release = threading.Event(), threading.Event()
    writing: list[str] = []

    def slow_writer(tmp: Path, rank: int) -> None:
        writing.append(tmp.name)
        written.set()
        assert release.wait(60)

    monkeypatch.setattr(background_save, "before_publish", slow_writer)
    with job_context():
        _, plain, model, opt, loader = _job()
        for step, (_, x, y) in enumerate(loader, start=1):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 3:  # the reference: what the checkpoint after this step must hold
                at_save = copy.deepcopy((plain.state_dict(), opt.state_dict()))
            if step == 5:
                assert written.wait(60)
                assert writing == ["ckpt-00000001.tmp"]  # the writer is still at it...
                assert CheckpointDir(job_state).latest_good() is None  # ...not complete
                release.set()
                wait_for_checkpoint()
                break
        assert not torch.equal(plain.weight, at_save[0]["weight"])  # training went on
    with job_context():
        _, fresh, _, opt2, loader = _job()
        assert loader.state_dict()["offset"] == 3 * BATCH
        for name, value in at_save[0].items():
            assert torch.equal(fresh.state_dict()[name], value), name
        restored = opt2.state_dict()["state"]
        for index, slots in at_save[1]["state"].items():
            for slot, value in slots.items():
                assert torch.equal(torch.as_tensor(restored[index][slot]),
                                   torch.as_tensor(value)), (index, slot)


KILLED_WRITER = """
import os, signal, torch
from stratagem.elastic import background_save, exit_point, job_context
from stratagem.elastic.context import current_job
from stratagem.elastic.state import ObjectState, load_state

def die_in_second_write(tmp, rank):  # files written, not yet committed
    if tmp.name == "ckpt-00000002.tmp":
        os.kill(os.getpid(), signal.SIGKILL)

background_save.before_publish = die_in_second_write
with job_context():
    w = torch.zeros(256, 256)
    load_state(ObjectState("w", lambda: {"w": w}, lambda s: w.copy_(s["w"])))
    for step in range(1, 10):
        w += 1
        exit_point(step=True)  # a save after steps 2 and 4 (STRATAGEM_CHECKPOINT_STEPS=2)
"""


def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint(
        job_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.CHECKPOINT_STEPS, "2")
    script = tmp_path / "job.py"
    script.write_text(KILLED_WRITER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert (job_state / "ckpt-00000002.tmp" / "w.pt").is_file()  # killed mid-save
    with job_context():
        w = torch.full((256, 256), -1.0)
        assert load_state(ObjectState("w", lambda: {"w": w}, lambda s: w.copy_(s["w"])))
        assert torch.equal(w, torch.full((256, 256), 2.0))  # the checkpoint after step 2
        w += 1
        exit_point(step=True)
        exit_point(step=True)  # due: the next save replaces the leftover
        wait_for_checkpoint()
    assert sorted(p.name for p in job_state.iterdir()) == ["ckpt-00000001", "ckpt-00000002"]


def _two_ranks(rank: int) -> dict:
    """Background saves of a shared and a per-rank state; rank 1 writes slowly in the first,
    misses rank 0's (shortened) deadline in the second and fails in the third."""
    release = threading.Event()
    saves: list[str] = []

    def slow_rank_1(tmp: Path, r: int) -> None:
        saves.append(tmp.name)
        if r == 1 and len(saves) == 3:
            raise OSError("disk full")
        if r == 1:
            release.wait(1.0 if len(saves) == 1 else 3.0)

    background_save.before_publish = slow_rank_1
    out: dict = {}
    with job_context():
        w = torch.zeros(64)
        load_state(ObjectState("w", lambda: {"w": w}, lambda s: w.copy_(s["w"])))
        mine = {"r": torch.tensor([rank])}
        load_state(ObjectState("mine", lambda: dict(mine), mine.update, per_rank=True))
        w += 1
        exit_point(step=True)  # STRATAGEM_CHECKPOINT_STEPS=1: a background save
        w += 1  # training goes on while it is written
        wait_for_checkpoint()
        os.environ[env.PG_TIMEOUT] = "2"  # rank 0 waits for rank 1's part at most 2 s
        exit_point(step=True)
        late = f"{current_job().saving.key}/1"  # rank 1's part, set after rank 0 gave up
        try:
            wait_for_checkpoint()
        except CheckpointError as exc:
            out["error"] = exc.render()
        store = job_store()
        torch.distributed.barrier()  # rank 1 has set it now
        if rank == 0:
            out["late_key_set"] = store.check([late])
        release.set()
        exit_point(step=True)
        try:
            wait_for_checkpoint()
        except CheckpointError as exc:
            out["failed"] = exc.render()
        newest = CheckpointDir(os.environ[env.CHECKPOINT_DIR]).latest_good()
        out["newest"] = newest.name if newest else None
        if rank == 0:  # the next save deleted it: failed saves do not grow the store
            out["late_key_left"] = store.check([late])
    return out


def test_ranks_report_their_parts_to_rank_0_through_the_store(
        job_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.CHECKPOINT_STEPS, "1")
    results = _spawn.run(_two_ranks, 2, tmp_path / "out", {}, _spawn.Setup(init_group=True))
    assert "error" not in results[1]  # rank 1 did its part, late
    assert "rank 1 did not finish writing its part within 2 s" in results[0]["error"]
    for failed in (results[0]["failed"], results[1]["failed"]):  # rank 0: from rank 1's report
        assert "rank 1 could not write its part: OSError: disk full" in failed
    assert results[0]["late_key_set"] and not results[0]["late_key_left"]
    assert results[0]["newest"] == "ckpt-00000001"  # the first save, both ranks' parts
    first = job_state / "ckpt-00000001"
    meta = json.loads((first / "meta.json").read_text())
    assert sorted(meta["sha256"]) == ["mine-rank0.pt", "mine-rank1.pt", "w.pt"]
    loaded = torch.load(first / "w.pt", weights_only=True)["w"]
    assert torch.equal(loaded, torch.ones(64))  # the state at the save, not after
    assert torch.load(first / "mine-rank1.pt", weights_only=True)["r"].item() == 1
