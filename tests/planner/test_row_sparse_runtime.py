"""Detected sparsity in the runtime: dense-declared parameters synchronized as rows
(``PSSynchronizer.row_sparse``). Training with 2 gloo workers against one process is in
test_equality.py (one spawn for all multi-process cases)."""

from __future__ import annotations

import planner_workers as pw
import pytest
import torch

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.runtime import compile_plan
from stratagem.strategy import (
    NodeConfig,
    PSSynchronizer,
    Strategy,
    validate,
)

W0 = pw.W0


def test_plan_marks_rows_from_gradient() -> None:
    model = pw.make("sampled")
    profile = analyze(model)
    strategy = validate(pw.rows_strategy(), profile, pw.two_nodes())
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
    s = pw.rows_strategy()
    back = Strategy.from_dict(s.to_dict())
    assert back.config_for("table").synchronizer.row_sparse
    assert "row_sparse" not in PSSynchronizer(reduction_destination=W0).to_dict()
