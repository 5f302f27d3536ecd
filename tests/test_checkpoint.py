"""Checkpoints: single-process loadable with weights_only, checksummed, atomic."""

from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem import checkpoint
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
    with pytest.raises(CheckpointError, match="model does not match"):
        checkpoint.load(tmp_path / "ck", nn.Linear(2, 2))


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
