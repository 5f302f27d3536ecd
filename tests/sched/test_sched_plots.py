"""Issue 49: the simulator's plots for a small workload. The allocation plot's axis ended
before the makespan and showed GPUs held through an idle gap (a decision's allocation was
drawn until the next decision); the JCT CDF said "mean 0.01 h" for every policy; two
policies with the same completion times drew one line over the other."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from stratagem.sched.simulator.engine import SimOptions, SimResult  # noqa: E402
from stratagem.sched.simulator.job import JobRecord  # noqa: E402
from stratagem.sched.simulator.report import (  # noqa: E402
    allocation_figure,
    allocation_series,
    jct_cdf_figure,
    time_unit,
)


def _job(name: str, submit: float, done: float) -> JobRecord:
    return JobRecord(name=name, application="cifar10", submit_time=submit,
                     start_time=submit, completion_time=done, jct=done - submit,
                     num_restarts=0, gpu_seconds=1.0, epochs=1, final_batch_size=64)


def _result() -> SimResult:
    """A runs 0-100 s, nothing runs 100-300 s, B runs 300-420 s; decisions every 120 s."""
    return SimResult(policy="pollux", workload="small",
                     options=SimOptions(num_nodes=1, gpus_per_node=4, interval=120.0),
                     jobs=[_job("a", 0.0, 100.0), _job("b", 300.0, 420.0)],
                     times=[0.0, 120.0, 240.0, 360.0],
                     allocations=[{"a": 2}, {}, {}, {"b": 4}],
                     applications={"a": "cifar10", "b": "cifar10"})


def test_allocation_covers_the_makespan_and_the_idle_gap_is_empty() -> None:
    times, apps, stack = allocation_series(_result())
    assert apps == ["cifar10"] and times[-1] == 420.0

    def held(t: float) -> float:  # step-post, as drawn
        return float(stack[0, np.searchsorted(times, t, side="right") - 1])

    assert held(50.0) == 2.0
    assert held(101.0) == 0.0  # a's GPUs back at its completion, not at the next decision
    assert held(200.0) == 0.0  # the idle gap holds nothing
    assert held(400.0) == 4.0
    fig = allocation_figure(_result())
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time (min)"
    assert ax.get_xlim()[1] == pytest.approx(420.0 / 60)  # the axis reaches the makespan
    assert ax.get_legend().get_bbox_to_anchor().y1 < ax.get_window_extent().y0  # below


def test_jct_cdf_units_fit_the_workload_and_coinciding_lines_stay_visible() -> None:
    assert time_unit(30.0) == ("s", 1.0) and time_unit(7200.0) == ("h", 3600.0)
    fig = jct_cdf_figure({"pollux": [100.0, 120.0], "tiresias": [100.0, 120.0],
                          "fifo": [100.0, 300.0]})
    ax = fig.axes[0]
    assert ax.get_xlabel() == "job completion time (min, log scale)"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["pollux (mean 1.83 min)", "tiresias (mean 1.83 min), the same as pollux",
                      "fifo (mean 3.33 min)"]
    styles = [line.get_linestyle() for line in ax.lines]
    assert len(set(styles)) == 3  # the same values drawn, but told apart
    pollux, tiresias = ax.lines[0], ax.lines[1]
    assert tiresias.get_zorder() > pollux.get_zorder()
    assert tiresias.get_linewidth() < pollux.get_linewidth()  # the wide one shows beneath
