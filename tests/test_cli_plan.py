"""`stratagem plan`: explains a strategy for a model without training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.cli import main
from stratagem.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models.py"


def test_plan_prints_strategy_and_plan_and_saves(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "s.yaml"
    assert main(["plan", "--model", f"{MODELS}:mlp", "--nproc", "2", "--strategy",
                 "AllReduce", "--show-plan", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 worker(s): 127.0.0.1:CPU:0, 127.0.0.1:CPU:1" in text
    assert "0.weight: all-reduce group 0 (none)" in text
    assert "plan for rank 0/2" in text and "launch order" in text
    saved = Strategy.load(out)
    assert [nc.var_name for nc in saved.node_config][:2] == ["0.weight", "0.bias"]


def test_plan_with_a_spec_file_and_saved_strategy(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    spec = ROOT / "examples" / "specs" / "two-node.yml"
    first = tmp_path / "s.json"
    assert main(["plan", "--model", f"{MODELS}:mlp", "--resource-spec", str(spec),
                 "--strategy", "PartitionedAR", "--out", str(first)]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", f"{MODELS}:mlp", "--resource-spec", str(spec),
                 "--strategy", str(first)]) == 0
    assert "builder PartitionedAR" in capsys.readouterr().out


def test_bad_model_target_is_one_clear_error() -> None:
    for target, needle in [("nocolon", "MODULE:CALLABLE"), (f"{MODELS}:nope", "no callable"),
                           ("no_such_module_x:f", "cannot import")]:
        proc = subprocess.run([sys.executable, "-m", "stratagem", "plan", "--model", target],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert needle in proc.stderr and "fix:" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_plan_with_auto_explains_within_80_columns(capsys) -> None:  # noqa: ANN001
    assert main(["plan", "--model", f"{MODELS}:Recommender", "--nproc", "2",
                 "--strategy", "Auto"]) == 0
    text = capsys.readouterr().out
    for needle in ("Auto chose", "predicted step", "parameter groups", "best alternatives",
                   "why it lost", "builder Auto"):
        assert needle in text
    explanation = text[text.index("Auto chose"):text.index("strategy ", text.index(
        "best alternatives"))]
    assert max(len(line) for line in explanation.splitlines()) <= 80


def test_plan_json_has_the_prediction(capsys) -> None:  # noqa: ANN001
    import json

    assert main(["plan", "--model", f"{MODELS}:mlp", "--nproc", "2", "--strategy",
                 "AllReduce", "--json", "--batch-size", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    predicted = report["predicted"]
    assert predicted["total_s"] == pytest.approx(
        predicted["compute_s"] + predicted["exposed_comm_s"] + predicted["overhead_s"])
    assert report["strategy"]["builder"] == "AllReduce"
    assert main(["plan", "--model", f"{MODELS}:mlp", "--nproc", "2", "--strategy",
                 "Auto", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["alternatives"] and auto["groups"]


def test_plan_a_training_script_stops_at_distribute(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    spec = ROOT / "examples" / "specs" / "two-node.yml"
    out = tmp_path / "auto.json"
    assert main(["plan", "--resource-spec", str(spec), str(ROOT / "examples" / "train_mlp.py"),
                 "--strategy", "Auto", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 worker(s)" in text and "Auto chose" in text and "predicted step" in text
    assert Strategy.load(out).builder.startswith("Auto")
    # the script's own builder when --strategy is not given
    assert main(["plan", "--resource-spec", str(spec),
                 str(ROOT / "examples" / "train_mlp.py")]) == 0
    assert "builder AllReduce" in capsys.readouterr().out


def test_plan_a_script_that_never_distributes_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('hello')\n")
    proc = subprocess.run([sys.executable, "-m", "stratagem", "plan", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "without calling AutoDist.distribute()" in proc.stderr and "fix:" in proc.stderr
