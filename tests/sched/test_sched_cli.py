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


def test_simulate_runs_out_of_the_box_on_a_bundled_workload(capsys):
    # no --profiles, a workload by name: the Pollux data shipped with the package
    code = main(["simulate", "--workload", "pollux:workload-1", "--policy", "fifo", "--quiet"])
    text = capsys.readouterr()
    assert code == 0, text.err
    row = next(line for line in text.out.splitlines() if line.startswith("workload-1 "))
    assert "fifo" in row and "160/160" in row.replace(" ", "")


def test_a_bundled_workload_name_is_checked(capsys):
    assert main(["simulate", "--workload", "pollux:workload-9"]) == 2
    err = capsys.readouterr().err
    assert "no bundled workload 'workload-9'" in err and "pollux:workload-8" in err
    assert main(["simulate", "--workload", "pollux:../x"]) == 2
    assert "no bundled workload" in capsys.readouterr().err
    assert main(["simulate"]) == 2
    assert "give one workload" in capsys.readouterr().err


@pytest.mark.parametrize(("options", "problem"), [
    (["--fairness", "nan"], "--fairness"), (["--fairness", "inf"], "--fairness"),
    (["--step-noise", "inf"], "--step-noise"), (["--interval", "nan"], "--interval"),
    (["--restart-delay", "-1"], "--restart-delay"),
    (["--nodes", "100000", "--gpus-per-node", "1000"], "--nodes"),
    (["--nodes", "4096", "--gpus-per-node", "64"], "--nodes/--gpus-per-node"),
    (["--gpus-per-node", "0"], "--gpus-per-node"), (["--load", "nan"], "--load"),
    (["--load", "0"], "--load")])
def test_simulate_options_are_bounded(setup, capsys, options, problem):
    args = ["simulate", str(setup / "w" / "mix.csv"), "--profiles", str(setup / "profiles")]
    assert main(args + options) == 2
    err = capsys.readouterr().err
    assert problem in err and "from " in err and "Traceback" not in err


def _bad_file(setup, name, content):
    path = setup / name
    path.write_bytes(content)
    return path


HEADER = b"name,time,application,num_replicas,batch_size\n"


@pytest.mark.parametrize(("content", "problem"), [
    (HEADER + b"\xff\xfe,0,toy1,1,8\n", "not UTF-8"),
    (HEADER + b"a,0,toy1,1," + b"9" * 200_000 + b"\n", "not a valid CSV"),
    (HEADER + b"a,0,toy1,1," + b"9" * 4000 + b"\n", "line 2"),
    (HEADER + b"a,0,toy1,1000000000000,8\n", "num_replicas from 1 to 65536"),
    (HEADER + b"a,1e308,toy1,1,8\n", "time from 0 to"),
    (HEADER + b"".join(b"j%d,0,toy1,1,8\n" % i for i in range(100_001)), "at most 100000"),
    (HEADER + b"a,0,toy1,1,8\n" + b"x" * (17 << 20), "too large")])
def test_hostile_workloads_are_one_error(setup, capsys, content, problem):
    path = _bad_file(setup, "bad.csv", content)
    assert main(["simulate", str(path), "--profiles", str(setup / "profiles")]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err and len(err) < 1000


@pytest.mark.parametrize(("name", "content", "problem"), [
    ("placements.csv", b"placement,local_bsz,step_time,sync_time\n1,4,0,0\n1,8,0,0\n",
     "step_time above 0"),
    ("placements.csv", b"placement,local_bsz,step_time,sync_time\n\xff1,4,0.5,0\n",
     "not UTF-8"),
    ("profile.json", b"[" * 100_000, "nested deeper"),
    ("profile.json", b'{"epochs": 1e308}', "epochs is 1e+308"),
    ("profile.json", b'{"epochs": "x"}', "not a positive number")])
def test_hostile_profiles_are_one_error(setup, capsys, name, content, problem):
    (setup / "profiles" / "toy1" / name).write_bytes(content)
    assert main(["simulate", str(setup / "w" / "mix.csv"), "--profiles",
                 str(setup / "profiles")]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err and len(err) < 1000


@pytest.mark.parametrize("hints", [
    '{"batch": {"base_batch_size": 8}, "epoch": 1e308, "progress": {"progress": 5}}',
    '{"batch": {"base_batch_size": Infinity}}', "[" * 50_000,
    '{"batch": {"base_batch_size": 8, "local_bsz_bounds": [1, 1e15]}, '
    '"progress": {"progress": 5}, "epoch": 1, "throughput_params": null}'])
def test_hostile_hints_profiles_are_one_error(tmp_path, capsys, hints):
    (tmp_path / "p" / "toy1").mkdir(parents=True)
    (tmp_path / "p" / "toy1" / "hints.json").write_text(hints)
    (tmp_path / "w.csv").write_text("name,time,application,num_replicas,batch_size\n"
                                    "a,0,toy1,1,8\n")
    assert main(["simulate", str(tmp_path / "w.csv"), "--profiles", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "hints.json" in err and "Traceback" not in err and len(err) < 1000


def test_simulate_refuses_an_unwritable_out_before_simulating(setup, capsys):
    blocker = setup / "file"
    blocker.write_text("")
    assert main(["simulate", str(setup / "w" / "mix.csv"), "--profiles",
                 str(setup / "profiles"), "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err and "mix pollux" not in err
