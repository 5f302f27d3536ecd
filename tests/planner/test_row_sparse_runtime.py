"""Detected sparsity in the runtime: dense-declared parameters synchronized as rows
(``PSSynchronizer.row_sparse``) train to what one process trains, with 2 gloo workers."""

from __future__ import annotations

import _spawn
import planner_workers as pw
import pytest
import torch

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.runtime import compile_plan
from stratagem.strategy import (
    AllReduceSynchronizer,
    NodeConfig,
    Partitioner,
    PSSynchronizer,
    Strategy,
    validate,
)

W0, W1 = "10.0.0.1:CPU:0", "10.0.0.2:CPU:0"


def rows(dest: str) -> PSSynchronizer:
    return PSSynchronizer(reduction_destination=dest, local_replication=True, row_sparse=True)


def rows_strategy() -> Strategy:
    """Table on worker 1, output weight and bias split over both workers: all as rows
    (the 1-D bias's parts go dense, see test_plan_marks_rows_from_gradient); the hidden
    layer all-reduced."""
    return Strategy(node_config=(
        NodeConfig("table", rows(W1)),
        NodeConfig("hidden.weight", AllReduceSynchronizer()),
        NodeConfig("hidden.bias", AllReduceSynchronizer()),
        NodeConfig("out.weight", partitioner=Partitioner((2, 1)), part_config=(
            NodeConfig("out.weight/part_0", rows(W0)),
            NodeConfig("out.weight/part_1", rows(W1)))),
        NodeConfig("out.bias", partitioner=Partitioner((2,)), part_config=(
            NodeConfig("out.bias/part_0", rows(W0)),
            NodeConfig("out.bias/part_1", rows(W1))))))


def test_rows_of_dense_gradients_match_single_process(tmp_path) -> None:
    strategy = rows_strategy()
    results = _spawn.run(pw.train_with, 2, tmp_path, {"name": "sampled",
                                                      "strategy_json": strategy.to_json()},
                         _spawn.Setup(args=(2,), local_rank=True, roles=("worker",) * 2))
    want = pw.reference("sampled")
    for r in results:
        assert "rows" in r["plan"] or "sparse" in r["plan"]
        for k, v in want.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)


def test_plan_marks_rows_from_gradient() -> None:
    model = pw.make("sampled")
    profile = analyze(model)
    strategy = validate(rows_strategy(), profile, pw.two_nodes())
    plan = compile_plan(strategy, profile, rank=0, world_size=2, device=torch.device("cpu"))
    by_param = {p.param: p for p in plan.ps.pieces}
    assert by_param["table"].sparse and by_param["table"].rows_from_grad
    assert all(p.sparse and p.rows_from_grad for p in plan.ps.pieces_of("out.weight"))
    # parts of a 1-D parameter stay dense: torch's dense.add_(sparse) on a 1-D view at an
    # offset misses the view (it lost part 1's updates before this rule)
    assert not any(p.sparse for p in plan.ps.pieces_of("out.bias"))


def test_row_sparse_without_local_replication_is_refused() -> None:
    profile = analyze(pw.make("sampled"))
    bad = Strategy(node_config=tuple(
        NodeConfig(p.name, PSSynchronizer(reduction_destination=W0, row_sparse=True))
        for p in profile.params))
    with pytest.raises(StrategyError, match="local_replication"):
        validate(bad, profile, pw.two_nodes())


def test_row_sparse_round_trips_through_json() -> None:
    s = rows_strategy()
    back = Strategy.from_dict(s.to_dict())
    assert back.config_for("table").synchronizer.row_sparse
    assert "row_sparse" not in PSSynchronizer(reduction_destination=W0).to_dict()
