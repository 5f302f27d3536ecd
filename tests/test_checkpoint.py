"""Checkpoints: single-process loadable with weights_only, checksummed, atomic."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem import checkpoint
from stratagem.adapt import State, load_state, reset_states, restore_point, save_all_states
from stratagem.errors import CheckpointError


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_roundtrip_restores_model_and_optimizer(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt, metadata={"step": 3})
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    assert checkpoint.load(tmp_path / "ck", fresh, fresh_opt) == {"step": 3}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    # Plain torch, one process, weights_only: no Stratagem needed to read it.
    state = torch.load(tmp_path / "ck" / "model.pt", weights_only=True)
    assert torch.equal(state["0.weight"], model[0].weight)


def test_optimizer_over_fewer_parameters_is_a_checkpoint_error(tmp_path: Path) -> None:
    """Like the restore path (``track_model``): a mismatched optimizer is a CheckpointError
    with a fix, not torch's bare ValueError."""
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    fewer = torch.optim.Adam(list(fresh.parameters())[:2], lr=0.01)  # first layer only
    with pytest.raises(CheckpointError, match="optimizer does not match") as err:
        checkpoint.load(tmp_path / "ck", fresh, fewer)
    assert err.value.where == str(tmp_path / "ck") and "same parameters" in (err.value.fix or "")


def test_corrupt_file_is_detected(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    with (tmp_path / "ck" / "model.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage")
    with pytest.raises(CheckpointError, match="checksum mismatch in model.pt"):
        checkpoint.load(tmp_path / "ck", model)


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt, metadata={"v": 1})
    checkpoint.save(tmp_path / "ck", model, opt, metadata={"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert checkpoint.read_meta(tmp_path / "ck")["metadata"] == {"v": 2}


def test_not_a_checkpoint_and_wrong_model(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint.load(tmp_path, nn.Linear(2, 2))
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    with pytest.raises(CheckpointError, match="from a different model") as err:
        checkpoint.load(tmp_path / "ck", nn.Linear(2, 2))
    assert "not in the checkpoint: weight, bias" in err.value.problem
    assert "only in the checkpoint: 0.weight, 0.bias, 2.weight, 2.bias" in err.value.problem


def test_wrong_model_names_the_parameters_that_differ(tmp_path: Path) -> None:
    model, opt = _trained()  # Linear(4, 8), ReLU, Linear(8, 1)
    checkpoint.save(tmp_path / "ck", model, opt)
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(tmp_path / "ck", wider)
    problem = err.value.problem
    assert "shape differs (checkpoint vs model): 2.weight [1, 8] vs [2, 8], 2.bias [1] vs [2]" \
        in problem
    assert "0.weight" not in problem and "not in the checkpoint" not in problem
    assert err.value.fix and "same model" in err.value.fix


def _drop_entry_and_truncate(ckpt: Path, name: str) -> None:
    """What a damaged checkpoint looked like that verify() used to accept."""
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["sha256"][name]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])


def test_verify_checks_files_meta_json_does_not_list(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    _drop_entry_and_truncate(tmp_path / "ck", "model.pt")
    with pytest.raises(CheckpointError, match="model.pt is not listed in meta.json"):
        checkpoint.verify(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="model.pt is not listed in meta.json"):
        checkpoint.load(tmp_path / "ck", nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                                       nn.Linear(8, 1)))


def test_unlisted_damaged_file_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    store = checkpoint.CheckpointDir(tmp_path)
    good = store.save(_write("a"))
    bad = store.save(_write("b"))
    _drop_entry_and_truncate(bad, "x.json")
    with pytest.warns(UserWarning, match="x.json is not listed in meta.json"):
        assert store.latest_good() == good


@pytest.mark.parametrize("meta", [
    "[" * 100_000 + "]" * 100_000,
    '{"sha256": {"../../etc/passwd": "' + "0" * 64 + '"}, "world_size": 1}',
    '{"sha256": {"model.pt": 3}, "world_size": 1}',
    '{"sha256": {}, "world_size": "2"}',
    '{"sha256": {}, "world_size": 1, "states": []}',
], ids=["deep", "path", "digest-type", "world-type", "states-type"])
def test_malformed_meta_json_is_a_checkpoint_error(tmp_path: Path, meta: str) -> None:
    (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(CheckpointError) as err:
        checkpoint.verify(tmp_path)
    assert err.value.fix


# -- CheckpointDir: numbered series, keep the previous, fall back when corrupt ------------
def _write(tag: str):
    def write(tmp: Path) -> None:
        (tmp / "x.json").write_text(tag)
    return write


def test_series_keeps_the_newest_two_and_cleans_leftovers(tmp_path: Path) -> None:
    store = checkpoint.CheckpointDir(tmp_path)
    for tag in "abc":
        store.save(_write(tag))
    (tmp_path / "ckpt-00000004.tmp").mkdir()  # a save that crashed half-way
    assert [p.name for p in store.checkpoints()] == ["ckpt-00000002", "ckpt-00000003"]
    assert store.latest_good() == tmp_path / "ckpt-00000003"
    store.save(_write("d"))  # reuses the crashed number, overwriting the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "ckpt-00000004"]
    assert (tmp_path / "ckpt-00000004" / "x.json").read_text() == "d"
    assert checkpoint.read_meta(tmp_path / "ckpt-00000004")["seq"] == 4


@pytest.mark.parametrize("damage", ["bytes", "missing", "meta"])
def test_corrupt_latest_falls_back_with_a_warning(tmp_path: Path, damage: str) -> None:
    store = checkpoint.CheckpointDir(tmp_path)
    good = store.save(_write("a"))
    bad = store.save(_write("b"))
    if damage == "bytes":
        (bad / "x.json").write_text("B")
    elif damage == "missing":
        (bad / "x.json").unlink()
    else:
        (bad / "meta.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ckpt-00000002 is unusable"):
        assert store.latest_good() == good
    assert (tmp_path / "ckpt-00000002.corrupt").is_dir()
    nxt = store.save(_write("c"))
    assert nxt.name == "ckpt-00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001", "ckpt-00000003"]


def test_no_good_checkpoint(tmp_path: Path) -> None:
    store = checkpoint.CheckpointDir(tmp_path / "missing")
    assert store.latest_good() is None
    only = checkpoint.CheckpointDir(tmp_path).save(_write("a"))
    (only / "x.json").write_text("zz")
    with pytest.warns(UserWarning, match="unusable"):
        assert checkpoint.CheckpointDir(tmp_path).latest_good() is None


def test_verify_reports_the_bad_file(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path / "ck", model, opt)
    assert checkpoint.verify(tmp_path / "ck")["world_size"] == 1
    (tmp_path / "ck" / "optimizer.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="checksum mismatch in optimizer.pt"):
        checkpoint.verify(tmp_path / "ck")


# -- the elastic restore (job-state registry) uses the same checks ----------------------
class Blob(State):
    """A job state holding raw bytes."""

    def __init__(self, name: str, data: bytes) -> None:
        self.data = data
        super().__init__(name)

    def save(self, f) -> None:  # noqa: ANN001
        f.write(self.data)

    def load(self, f) -> None:  # noqa: ANN001
        self.data = f.read()


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for var in ("RANK", "WORLD_SIZE", "ADAPTDL_CHECKPOINT_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STRATAGEM_CHECKPOINT_DIR", str(tmp_path / "job"))
    reset_states()
    yield tmp_path / "job"
    reset_states()


def _blob_file(ckpt: Path) -> str:
    (name,) = [p.name for p in ckpt.iterdir() if p.name.startswith("blob")]
    return name


def test_elastic_restore_falls_back_past_an_unlisted_damaged_file(job_dir: Path) -> None:
    blob = Blob("blob", b"first")
    save_all_states()
    blob.data = b"second"
    newest = save_all_states()
    assert newest is not None
    _drop_entry_and_truncate(newest, _blob_file(newest))
    reset_states()
    again = Blob("blob", b"")
    with pytest.warns(UserWarning, match="is not listed in meta.json"):
        assert load_state(again) is True
    assert again.data == b"first"


def test_state_names_with_any_characters_still_verify(job_dir: Path) -> None:
    Blob("my state é", b"x")
    saved = save_all_states()
    assert saved is not None
    assert "my state é.pt" in checkpoint.verify(saved)["sha256"]


def test_load_state_verifies_the_file_it_reads(job_dir: Path) -> None:
    Blob("blob", b"payload")
    saved = save_all_states()
    assert saved is not None
    reset_states()
    assert restore_point() == saved  # chosen (and verified) first ...
    name = _blob_file(saved)
    (saved / name).write_bytes(b"tampered")  # ... then damaged before the state loads
    with pytest.raises(CheckpointError, match=f"checksum mismatch in {name}"):
        load_state(Blob("blob", b""))

def test_grad_scaler_is_saved_and_restored(tmp_path: Path) -> None:
    """A GradScaler attached to the model (or passed) is in the checkpoint: its scale and
    growth tracker after an overflow and some growth come back."""
    from stratagem.analysis import analyze
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import DistributedModel, compile_plan
    from stratagem.strategy import AllReduce

    def build() -> tuple[DistributedModel, torch.optim.Optimizer, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        profile = analyze(model)
        strategy = AllReduce().build(profile, ResourceSpec.local(1))
        plan = compile_plan(strategy, profile, rank=0, world_size=1, device=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        dm = DistributedModel(model, plan, optimizer=opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        dm.attach_scaler(scaler)
        return dm, opt, scaler

    dm, opt, scaler = build()
    for step in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = dm(torch.randn(16, 4)).pow(2).mean()
        scaler.scale(loss * (float("inf") if step == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 11  # (a backoff at step 1, then growth twice)
    checkpoint.save(tmp_path / "ck", dm, opt)
    dm2, opt2, scaler2 = build()
    checkpoint.load(tmp_path / "ck", dm2, opt2)
    assert scaler2.state_dict() == scaler.state_dict()
    plain = torch.amp.GradScaler("cpu")  # passed explicitly, into a plain model's load
    checkpoint.load(tmp_path / "ck", nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
                    scaler=plain)
    assert plain.get_scale() == scaler.get_scale()
