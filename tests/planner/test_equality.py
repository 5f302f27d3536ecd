"""Strategies with rows and Auto's choices, run by 2 gloo workers, train to the parameters
single-process SGD reaches (one spawn runs every case)."""

from __future__ import annotations

import _spawn
import planner_workers as pw
import pytest
import torch

from stratagem.planner import choose, explain_text
from stratagem.resource import ResourceSpec


def slow_two_nodes() -> ResourceSpec:
    """The two nodes on 1 Mbit/s links: bytes decide, so Auto sends rows."""
    return ResourceSpec.from_dict({"nodes": [
        dict(n, network_bandwidth=0.001) for n in pw.two_nodes().to_dict()["nodes"]]})


def auto_cases() -> dict[str, tuple[str, str]]:
    (ids, cand), _ = pw.batch("sampled", 0)
    sampled = choose(pw.make("sampled"), slow_two_nodes(),
                     sample_input=(ids[: pw.BATCH // 2], cand)).strategy
    rows = [leaf.synchronizer for leaf in sampled.config_for("out.weight").leaves()]
    assert all(getattr(s, "row_sparse", False) for s in rows), sampled.summary()
    dense = choose(pw.make("dense"), pw.two_nodes(),
                   sample_input=pw.batch("dense", 0)[0][0][: pw.BATCH // 2]).strategy
    # a declared-sparse table of which a batch reads a few rows: Auto gathers its rows
    chosen = choose(pw.make("bag"), pw.two_nodes(),
                    sample_input=pw.batch("bag", 0)[0][0][: pw.BATCH // 2])
    bag = chosen.strategy
    assert bag.config_for("emb.weight").synchronizer.gather_rows, bag.summary()
    assert "gathered rows  all-gather" in explain_text(chosen)
    return {"auto/sampled": ("sampled", sampled.to_json()),
            "auto/dense": ("dense", dense.to_json()), "auto/bag": ("bag", bag.to_json())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cases = {"rows/manual": ("sampled", pw.rows_strategy().to_json()),
             "gather/manual": ("bag", pw.gather_strategy().to_json()), **auto_cases()}
    return _spawn.run(pw.suite, 2, tmp_path_factory.mktemp("planner_eq"), {"cases": cases},
                      _spawn.Setup(args=(2,), local_rank=True, roles=("worker",) * 2))


@pytest.mark.parametrize("case", ["rows/manual", "gather/manual", "auto/sampled", "auto/dense",
                                  "auto/bag"])
def test_matches_single_process(trained: list[dict], case: str) -> None:
    name = ("dense" if case.endswith("dense") else "bag"
            if case in ("gather/manual", "auto/bag") else "sampled")
    want = pw.reference(name)
    for rank in trained:
        got = rank[case]["state"]
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-9, msg=f"{case}: {k}")
