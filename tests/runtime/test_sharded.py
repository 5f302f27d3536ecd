"""Sharded strategies (ZeRO 1-3) on 2 and 4 gloo ranks against single-process plain torch
(Adam), and stage 1 against torch's ZeroRedundancyOptimizer."""

from __future__ import annotations

import pytest
import shard_workers
import torch
from rt_common import check, reference, spawn

pytestmark = pytest.mark.slow

RTOL = 1e-5


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(shard_workers.world, 2, tmp_path_factory.mktemp("s2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(shard_workers.world, 4, tmp_path_factory.mktemp("s4"))


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference("mlp", "adam")


def close(got: dict, want: dict, rtol: float = RTOL) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-8, msg=k)


CASES = [*shard_workers.CASES, "zero2_accumulate", "zero3_accumulate"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(world: int, case: str, ref: dict,
                                request: pytest.FixtureRequest) -> None:
    results = [check(r[case]) for r in request.getfixturevalue(f"world{world}")]
    for r in results:
        close(r["state"], ref)
        close(r["state"], results[0]["state"], rtol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_is_sharded(world: int, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(f"world{world}")
    full = 2 * sum(v.numel() for v in reference("mlp", "adam", steps=1).values())
    for case in ("zero1", "zero2", "zero3"):
        held = [check(r[case])["state_numel"] for r in results]
        assert sum(held) == full, case  # every element's state once, on one worker
        assert max(held) < full * 0.75, (case, held)  # and spread over the workers


@pytest.mark.parametrize("world", [2, 4])
def test_stage1_equals_zero_redundancy_optimizer(world: int, ref: dict,
                                                 request: pytest.FixtureRequest) -> None:
    for r in request.getfixturevalue(f"world{world}"):
        theirs = check(r["torch_zero"])["state"]
        close(theirs, ref)
        close(check(r["zero1"])["state"], theirs)


def test_full_state_dict_loads_into_another_world(world2: list[dict],
                                                  world4: list[dict]) -> None:
    for r in [*world2, *world4]:
        got = check(r["roundtrip"])
        close(got["loaded"], got["want"], rtol=0)


def test_full_state_dict_loads_into_plain_torch(world4: list[dict], ref: dict) -> None:
    """4 workers' ZeRO-3 state -> one process: plain tensors a plain model loads."""
    from rt_common import make_model

    state = check(world4[0]["zero3"])["state"]
    assert all(type(v) is torch.Tensor for v in state.values())
    plain = make_model("mlp", 3)
    plain.load_state_dict(state)
    close({k: v.detach() for k, v in plain.state_dict().items()}, ref)
