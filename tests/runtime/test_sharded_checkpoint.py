"""Sharded checkpoints (issue 45 item 3): 4 ZeRO workers save (every rank its pieces) after
half the steps; 2 workers, and one plain-torch process, resume from it, and the result
equals single-process training continued from the same point."""

from __future__ import annotations

from pathlib import Path

import pytest
import shard_ckpt_workers as w
import torch
from rt_common import STEPS, batch, check, loss_fn, make_model, make_optimizer, spawn

from stratagem import checkpoint
from stratagem.errors import CheckpointError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    for r in spawn(w.save_world, 4, out / "runs4", ckpt=out):
        for case in w.SAVED:
            assert check(r[case])["sharded"]
    return out


@pytest.fixture(scope="module")
def resumed(saved: Path) -> list[dict]:
    return spawn(w.load_world, 2, saved / "runs2", ckpt=saved)


@pytest.fixture(scope="module")
def ref() -> tuple[dict, dict]:
    """One process, plain torch, all steps: model and optimizer state."""
    m, o = w.train_plain(STEPS)
    return ({k: v.detach().clone() for k, v in m.state_dict().items()}, o.state_dict())


def close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-8, msg=k)


def close_optimizer(got: dict, want: dict) -> None:
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        close(got["state"][i], entry)
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


def test_every_rank_writes_its_own_pieces(saved: Path) -> None:
    for case in w.SAVED:
        path = saved / f"{case}-sharded"
        meta = checkpoint.verify(path)
        assert meta["shards"] == 4 and not (path / "model.pt").exists()
        sizes = []
        for r in range(4):
            part = torch.load(path / f"optimizer-shard{r}.pt", weights_only=True)
            sizes.append(sum(p["data"].numel() for p in part["pieces"].values()))
        assert all(sizes), (case, sizes)  # every rank holds (and writes) a share
        assert max(sizes) < 0.75 * sum(sizes), (case, sizes)


@pytest.mark.parametrize("name", list(w.RESUMED))
def test_four_to_two_workers_equals_one_process(name: str, resumed: list[dict],
                                                 ref: tuple[dict, dict]) -> None:
    for r in resumed:
        got = check(r[name])
        close(got["state"], ref[0])
        close_optimizer(got["optimizer"], ref[1])


@pytest.mark.parametrize("case", w.WRAPPED)
def test_state_held_before_wrapping_is_sharded(case: str, resumed: list[dict],
                                               ref: tuple[dict, dict]) -> None:
    """An optimizer stepped before the model is wrapped (or a restored job that Auto
    re-plans to a sharded strategy) keeps its state: owners keep theirs, FSDP2 slices."""
    for r in resumed:
        got = check(r[f"{case}_wrapped_late"])
        close(got["state"], ref[0])
        close_optimizer(got["optimizer"], ref[1])


@pytest.mark.parametrize("source", ["zero3-sharded", "mixed-sharded", "zero1-full"])
def test_into_one_plain_process(source: str, saved: Path, ref: tuple[dict, dict]) -> None:
    """checkpoint.load into a plain torch model and Adam, then plain training on."""
    m = make_model("mlp", 5)
    o = make_optimizer("adam", m.parameters())
    checkpoint.load(saved / source, m, o)
    for step in range(w.HALF, STEPS):
        x, y = batch("mlp", step)
        o.zero_grad()
        loss_fn("mlp", m(x), y).backward()
        o.step()
    close({k: v.detach() for k, v in m.state_dict().items()}, ref[0])
    close_optimizer(o.state_dict(), ref[1])


def test_consolidate_writes_what_plain_torch_loads(saved: Path, tmp_path: Path) -> None:
    out = checkpoint.consolidate(saved / "zero3-sharded", tmp_path / "plain")
    model_state = torch.load(out / "model.pt", weights_only=True)
    optim_state = torch.load(out / "optimizer.pt", weights_only=True)
    full = torch.load(saved / "zero3-full" / "model.pt", weights_only=True)
    close(model_state, full)
    m = make_model("mlp", 5)
    m.load_state_dict(model_state)
    o = make_optimizer("adam", m.parameters())
    o.load_state_dict(optim_state)
    assert checkpoint.verify(out)["metadata"] == {}


def test_a_missing_piece_is_named(saved: Path, tmp_path: Path) -> None:
    parts = [torch.load(saved / "zero3-sharded" / f"model-shard{r}.pt", weights_only=True)
             for r in range(4)]
    del parts[2]
    with pytest.raises(CheckpointError, match="rows"):
        checkpoint.assemble_pieces(parts, "test")
