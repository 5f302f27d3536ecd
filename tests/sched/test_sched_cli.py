"""``stratagem simulate``: outputs, the summary table, errors."""

from __future__ import annotations

import csv
import json

import pytest
from _sched_data import write_toy_profile

from stratagem.cli import main

WORKLOAD = ("name,time,application,num_replicas,batch_size\n"
            "a,0,toy2,2,8\nb,0,toy2,1,8\nc,30,toy1,1,8\nd,200,toy2,2,8\n")


@pytest.fixture
def setup(tmp_path):
    write_toy_profile(tmp_path / "profiles" / "toy1", 1)
    write_toy_profile(tmp_path / "profiles" / "toy2", 2)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "mix.csv").write_text(WORKLOAD)
    return tmp_path


def test_simulate_writes_reports_plots_and_a_table(setup, capsys):
    out = setup / "out"
    code = main(["simulate", str(setup / "w"), "--profiles", str(setup / "profiles"),
                 "--policy", "all", "--nodes", "1", "--gpus-per-node", "2",
                 "--restart-delay", "0", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr()
    table = text.out.splitlines()
    # the table fits in 80 columns; the last line names the output folder, however long
    assert table[-1] == f"results in {out}/"
    assert all(len(line) <= 80 for line in table[:-1])
    assert sum(line.startswith("mix ") for line in table) == 5  # every policy
    assert "mix fifo: 4/4 jobs" in text.err  # progress lines (not a terminal here)
    fifo = {r["name"]: r for r in csv.DictReader((out / "mix" / "fifo" / "jobs.csv").open())}
    assert float(fifo["a"]["jct"]) == pytest.approx(60.0)
    result = json.loads((out / "mix" / "pollux" / "result.json").read_text())
    assert result["summary"]["completed"] == 4 and result["options"]["interval"] == 60.0
    summary = json.loads((out / "summary.json").read_text())
    assert [s["policy"] for s in summary] == ["pollux", "pollux-paper", "tiresias", "optimus",
                                             "fifo"]
    pngs = [out / "mix" / "jct_cdf.png"] + [out / "mix" / p / "allocation.png"
                                           for p in ("pollux", "fifo")]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_errors_are_one_readable_message(setup, capsys):
    args = ["simulate", str(setup / "w" / "mix.csv"), "--profiles", str(setup / "profiles")]
    assert main(args + ["--policy", "gandiva"]) == 2
    assert "unknown policy 'gandiva'" in capsys.readouterr().err
    assert main(args + ["--policy", ","]) == 2
    assert "no policy given" in capsys.readouterr().err
    assert main(args + ["--interval", "0"]) == 2
    assert "interval" in capsys.readouterr().err
    assert main(["simulate", str(setup / "nope.csv"), "--profiles", "x"]) == 2
    assert "workload not found" in capsys.readouterr().err
    assert main(args[:2] + ["--profiles", str(setup / "w")]) == 2
    assert "no profile for application" in capsys.readouterr().err
