"""In-process resharding of stage-3 (FSDP2) units: 4 -> 2 -> 3 workers with the calls the
elastic lifecycle makes (``before_regroup``, a new group, ``regroup``), with uneven row
splits (9 rows over 4 workers, 4 over 3: some ranks hold none), also of a model built on the meta
device, against one process of plain torch. The elastic job itself (store, joiners, loaders) is
tests/elastic/test_inprocess_rescale.py (``zero3``)."""

from __future__ import annotations

import pytest
import shard_regroup_workers as w
import torch
from rt_common import check, spawn

pytestmark = pytest.mark.slow

CASES = ("zero3", "zero3_keep", "mixed", "zero3_meta")


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("regroup")
    return spawn(w.run, 4, out, where=out, cases=CASES)


@pytest.mark.parametrize("case", CASES)
def test_resharded_training_equals_one_process(case: str, chains: list[dict]) -> None:
    ref = w.reference(case)
    results = [check(r[case]) for r in chains]
    assert results[3]["left"] and "state" not in results[3]
    for r in results[:3]:
        assert r["sharded"]
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)
        for i, entry in ref["optimizer"]["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(r["optimizer"]["state"][i][k], v, rtol=1e-6,
                                           atol=1e-9, msg=f"{case} {i}.{k}")


@pytest.mark.parametrize("case", CASES)
def test_state_is_sharded_in_every_world(case: str, chains: list[dict]) -> None:
    results = [check(r[case]) for r in chains]
    whole = 2 * sum(v.numel() for v in w.reference()["state"].values())
    for world in (4, 2, 3):
        held = [r["held"][world] for r in results if world in r["held"]]
        assert len(held) == world
        assert max(held) < whole, (case, world, held)  # nobody holds all of it


def test_the_model_is_rebuilt_and_refuses_to_train_until_regrouped(chains: list[dict]
                                                                   ) -> None:
    for r in chains:
        got = check(r["zero3"])
        if "left" not in got:
            assert got["rebuilt"] and got["refused"]
