"""Multi-process correctness: 2 and 4 gloo ranks against single-process plain torch.

One spawn per world size runs every case (see rt_workers.world2/world4); each test below
checks its part of the results.
"""

from __future__ import annotations

import pytest
import rt_workers
import torch
from rt_common import BATCH, check, reference, reference_sparse_adam, spawn

RTOL = 1e-5


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("w2")
    return spawn(rt_workers.world2, 2, out, ckpt_dir=str(out / "ckpt"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(rt_workers.world4, 4, tmp_path_factory.mktemp("w4"))


def assert_state_close(got: dict, want: dict, rtol: float = RTOL, atol: float = 1e-8) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


def assert_replicas_equal(results: list[dict]) -> None:
    for r in results[1:]:
        assert_state_close(r, results[0], rtol=0, atol=0)


_REFS: dict = {}


def ref(model: str, opt: str, **kw) -> dict:
    key = (model, opt, tuple(sorted(kw.items())))
    if key not in _REFS:
        _REFS[key] = reference(model, opt, **kw)
    return _REFS[key]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["/".join(c) for c in rt_workers.EQUIV_CASES])
def test_matches_single_process(world: int, case: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(f"world{world}")
    per_rank = [check(r[case]) for r in results]
    _, opt, model = case.split("/")
    assert_replicas_equal(per_rank)
    assert_state_close(per_rank[0], ref(model, opt))


def test_grad_weight_uneven_batches(world2: list[dict]) -> None:
    per_rank = [check(r["grad_weight"]) for r in world2]
    assert_replicas_equal(per_rank)
    assert_state_close(per_rank[0], ref("mlp", "sgd", steps=10))


def test_no_sync_accumulation_equals_big_batch(world2: list[dict]) -> None:
    per_rank = [check(r["no_sync"]) for r in world2]
    for r in per_rank:
        assert r["synced_inside_no_sync"] == 0
        assert r["steps"] == 10
    assert_replicas_equal([r["state"] for r in per_rank])
    assert_state_close(per_rank[0]["state"], ref("mlp", "sgd", steps=10))


@pytest.mark.parametrize("world", [2, 4])
def test_batchnorm_buffers_identical(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = [check(r["batchnorm"]) for r in request.getfixturevalue(f"world{world}")]
    assert_replicas_equal([r["final"] for r in per_rank])
    assert_replicas_equal([r["initial"] for r in per_rank])  # initial broadcast
    for r in per_rank[1:]:
        torch.testing.assert_close(r["eval_out"], per_rank[0]["eval_out"], rtol=0, atol=0)
    final, initial = per_rank[0]["final"], per_rank[0]["initial"]
    assert final["bn.num_batches_tracked"].item() == 10
    assert not torch.equal(final["bn.running_mean"], initial["bn.running_mean"])


def test_one_collective_per_group_in_launch_order(world2: list[dict]) -> None:
    for r in (check(r["stats"]) for r in world2):
        groups = len(r["order"])
        assert groups == 6  # chunk_size=1: one group per parameter
        assert r["launched"] == r["order"] * 3  # same fixed order every step, every rank
        assert r["collectives"] == groups * 3
        assert r["overlapped"] == groups * 3  # all launched from hooks during backward
        assert r["steps"] == 3
        assert r["payload"] == r["nbytes"] * 3
        assert r["wire"] == pytest.approx(r["payload"] * 2 * (2 - 1) / 2)
        assert r["wait"] >= 0
        assert r["grads_in_buffers"] == [True] * 3  # param.grad is a view of the group buffer
        assert r["buffers_kept"]  # no per-step reallocation
    assert world2[0]["stats"]["order"] == world2[1]["stats"]["order"]


def test_unused_parameter_gets_zero_gradient(world2: list[dict]) -> None:
    per_rank = [check(r["unused"]) for r in world2]
    assert_replicas_equal(per_rank)
    assert_state_close(per_rank[0], ref("gated", "plain_sgd", steps=6))


@pytest.mark.parametrize("case", ["sparse", "sparse_columns"])
def test_sparse_embedding_densified(world2: list[dict], case: str) -> None:
    """A sparse embedding's gradient all-reduced dense, split in parts by rows
    (PartitionedAR) or by columns: each part takes its rows of the sparse gradient."""
    per_rank = [check(r[case]) for r in world2]
    assert_replicas_equal(per_rank)
    assert_state_close(per_rank[0], ref("sparse", "plain_sgd", steps=8))


@pytest.mark.parametrize("world", [2, 4])
def test_gathered_rows_train_as_one_process(world: int, request: pytest.FixtureRequest
                                            ) -> None:
    """``gather_rows``: the sparse embedding's rows all-gathered (DDP's way) and summed on
    every rank; the optimizer gets a sparse gradient, plain SGD and SparseAdam train to
    single-process training's parameters."""
    per_rank = [check(r["gather_rows"]) for r in request.getfixturevalue(f"world{world}")]
    assert all(all(r["sparse_grads"]) for r in per_rank)
    assert "rows all-gathered" in per_rank[0]["summary"]
    assert_replicas_equal([r["sgd"] for r in per_rank])
    assert_state_close(per_rank[0]["sgd"], ref("sparse", "plain_sgd", steps=8))
    assert_replicas_equal([r["sparse_adam"] for r in per_rank])
    assert_state_close(per_rank[0]["sparse_adam"], reference_sparse_adam(steps=6))


def test_sparse_adam_gets_row_sparse_gradients(world2: list[dict]) -> None:
    """SparseAdam refuses dense gradients: its step gets the rows of the embedding
    gradient all-reduced densely, and training matches single-process SparseAdam."""
    per_rank = [check(r["sparse_adam"]) for r in world2]
    for name in ("AllReduce", "PartitionedAR"):
        states = [r[name] for r in per_rank]
        assert_replicas_equal(states)
        assert_state_close(states[0], reference_sparse_adam(steps=6))


def test_plan_for_another_rank_is_refused(world2: list[dict]) -> None:
    for r in world2:
        assert "compile the plan with this process's rank" in check(r["wrong_rank"])


# Relative tolerances on the final full-data MSE after 150 SGD-momentum steps (none: ~0.34
# from 0.54). fp16/bf16 only round the averaged gradient (observed relative differences
# <1e-4); PowerSGD rank 2 approximates it (observed +6%; rank 1 +23%, rank 4 +1%).
LOSS_TOL = {"fp16": 1e-3, "bf16": 1e-2, "powersgd": 0.15}


@pytest.mark.parametrize("comp", ["fp16", "bf16", "powersgd"])
def test_compressor_close_to_uncompressed(world2: list[dict], comp: str) -> None:
    runs = [check(r["compressors"]) for r in world2]
    for r in runs:
        for name in ("none", comp):
            check(r[name])
    base, got = runs[0]["none"], runs[0][comp]
    assert_replicas_equal([r[comp]["params"] for r in runs])
    assert abs(got["loss"] - base["loss"]) <= LOSS_TOL[comp] * base["loss"] + 1e-3, \
        (got["loss"], base["loss"])
    if comp in ("fp16", "bf16"):
        assert got["payload"] * 2 == base["payload"]
    else:
        assert got["compressed"] > 0
        assert got["payload"] < base["payload"] / 2


def test_powersgd_state_roundtrip(world2: list[dict]) -> None:
    for r in (check(r["powersgd_roundtrip"]) for r in world2):
        assert r["keys"] and all(k.startswith("group") for k in r["keys"])
        assert_state_close(r["reloaded"], r["continued"], rtol=0, atol=0)
        # Without the state, error feedback and Q restart: the result differs.
        assert any(not torch.equal(r["fresh"][k], r["continued"][k]) for k in r["continued"])


def test_checkpoint_save_from_every_rank_or_one(world2: list[dict]) -> None:
    """Without per-rank synchronizer state a save is one rank's job: both ranks calling it
    write one checkpoint, rank 0 alone writes it while rank 1 went on; PowerSGD's error
    feedback keeps it collective (every rank's sync file)."""
    for r in (check(r["save"]) for r in world2):
        assert r["allreduce"]["files"] == ["meta.json", "model.pt", "optimizer.pt"]
        assert r["powersgd"]["files"] == ["meta.json", "model.pt", "optimizer.pt",
                                          "sync-rank0.pt", "sync-rank1.pt"]
        for name in ("allreduce", "powersgd"):
            assert_state_close(r[name]["saved"], r[name]["state"], rtol=0, atol=0)
    assert_state_close(check(world2[0]["save"])["alone"],
                       check(world2[0]["save"])["allreduce"]["state"], rtol=0, atol=0)


def test_batch_is_divisible() -> None:
    assert BATCH % 4 == 0
