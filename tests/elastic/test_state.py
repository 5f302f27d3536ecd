"""The job-state registry and the restart-aware epoch loop, in one process."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path, PurePosixPath

import pytest
import torch
from torch import nn

from stratagem import checkpoint
from stratagem.adapt import (
    ENV_ADAPTDL_CHECKPOINT,
    ENV_CHECKPOINT_DIR,
    ObjectState,
    State,
    checkpoint_root,
    current_epoch,
    finished_epochs,
    load_state,
    register_state,
    remaining_epochs_until,
    restore_point,
    save_all_states,
)
from stratagem.elastic import drop_job, track_model
from stratagem.errors import CheckpointError, StratagemError


class Blob(State):
    """AdaptDL style: writes its own bytes."""

    def __init__(self, name: str, data: bytes = b"") -> None:
        self.data = data
        super().__init__(name)

    def save(self, f) -> None:
        f.write(self.data)

    def load(self, f) -> None:
        self.data = f.read()


def test_states_round_trip_as_tensors_and_json(job_state: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    assert track_model(model, opt) is False  # nothing to restore yet
    assert track_model(nn.Linear(1, 1)) is False  # a second model: "model-1"
    assert register_state("sched", sched) is False
    Blob("blob", b"\x00raw")
    ObjectState("cfg", lambda: {"a": [1, 2]}, lambda s: None, format="json")
    path = save_all_states()
    assert path == job_state / "ckpt-00000001"
    assert json.loads((path / "cfg.json").read_text()) == {"a": [1, 2]}

    drop_job()
    torch.manual_seed(1)
    model2 = nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1)
    assert track_model(model2, opt2) is True
    second = nn.Linear(1, 1)
    assert track_model(second) is True
    assert register_state("sched", sched2) is True
    blob = Blob("blob")
    assert load_state(blob) and blob.data == b"\x00raw"
    assert load_state(Blob("never-saved")) is False
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])
    assert sched2.last_epoch == 1
    # A job checkpoint is an ordinary checkpoint, loadable by plain torch / checkpoint.load.
    model3 = nn.Linear(3, 2)
    checkpoint.load(restore_point(), model3)
    assert torch.equal(model3.weight, model.weight)


def test_pickles_are_refused(job_state: Path) -> None:
    ObjectState("evil", lambda: {"obj": PurePosixPath("/etc")}, lambda s: None)
    save_all_states()
    drop_job()
    with pytest.raises(CheckpointError, match="cannot restore state 'evil'"):
        load_state(ObjectState("evil", dict, lambda s: None))


def test_per_rank_state_restarts_fresh_at_another_world_size(job_state: Path) -> None:
    ObjectState("local", lambda: {"x": torch.ones(2)}, lambda s: None, per_rank=True)
    ObjectState("empty", dict, lambda s: None, per_rank=True)
    path = save_all_states()
    assert (path / "local-rank0.pt").is_file()
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps(meta | {"world_size": 2}))
    drop_job()
    got = []
    with pytest.warns(UserWarning, match="saved per rank by 2 replicas, now 1"):
        assert load_state(ObjectState("local", dict, got.append, per_rank=True)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was lost: no warning
        assert load_state(ObjectState("empty", dict, got.append, per_rank=True)) is False
    assert got == []


def test_environment_and_no_directory(job_state: Path, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    assert checkpoint_root() == job_state
    monkeypatch.delenv(ENV_CHECKPOINT_DIR)
    monkeypatch.setenv(ENV_ADAPTDL_CHECKPOINT, str(tmp_path / "adaptdl"))
    assert checkpoint_root() == tmp_path / "adaptdl"
    monkeypatch.delenv(ENV_ADAPTDL_CHECKPOINT)
    assert checkpoint_root() is None
    Blob("b", b"1")
    with pytest.warns(UserWarning, match="no checkpoint saved"):
        assert save_all_states() is None
    assert load_state(Blob("b")) is False


def test_state_default_save_load_is_weights_only() -> None:
    state = ObjectState("t", lambda: {"w": torch.arange(3)}, lambda s: None)
    buf = io.BytesIO()
    state.save(buf)
    buf.seek(0)
    got = []
    state._put = got.append
    state.load(buf)
    assert torch.equal(got[0]["w"], torch.arange(3))


# -- epochs ---------------------------------------------------------------------------------
def test_epochs_resume_where_the_checkpoint_was_taken() -> None:
    assert current_epoch() is None and finished_epochs() == 0
    seen = []
    for epoch in remaining_epochs_until(5):
        assert current_epoch() == epoch and finished_epochs() == epoch
        seen.append(epoch)
        if epoch == 2:
            save_all_states()  # mid-epoch 2
            break
    assert current_epoch() is None
    drop_job()
    assert list(remaining_epochs_until(5)) == [2, 3, 4]  # epoch 2 again: it had not finished
    assert finished_epochs() == 5
    save_all_states()
    drop_job()
    assert list(remaining_epochs_until(5)) == []
    assert list(remaining_epochs_until(7)) == [5, 6]


def test_epoch_loops_do_not_nest() -> None:
    with pytest.raises(StratagemError, match="cannot be nested"):
        for _ in remaining_epochs_until(2):
            for _ in remaining_epochs_until(2):
                pass
