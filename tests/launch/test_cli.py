"""``stratagem run`` argument parsing and its one-line errors (exit code 2, no traceback)."""

from __future__ import annotations

import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stratagem import cli
from stratagem.launch import remote_shell

Script = Callable[[str, str], Path]

TWO_NODES = """
nodes:
  - address: 10.0.0.1
    chief: true
    workers: 2
  - address: 10.0.0.2
    workers: 1
"""


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert code == 2 and "run" in err and "usage: stratagem" in err


def test_python_dash_m_entry_point(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["stratagem", "--version"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("stratagem", run_name="__main__")
    assert exc.value.code == 0 and "stratagem" in capsys.readouterr().out


def test_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "run", "no_such_train.py")
    assert code == 2
    assert err.startswith("stratagem: error: training script 'no_such_train.py' not found")
    assert "Traceback" not in err


@pytest.mark.parametrize("nproc", ["0", "100000000000000000000000"])
def test_nproc_must_be_in_range(script: Script, capsys: pytest.CaptureFixture[str],
                                nproc: str) -> None:
    code, _, err = run_cli(capsys, "run", "--nproc", nproc, str(script("t.py", "")))
    assert code == 2 and f"--nproc must be 1 to 1024, got {nproc}" in err and "fix:" in err


@pytest.mark.parametrize("job_id", ["-x", "a/b", "a b", "", "x" * 65, "ok\n"])
def test_job_id_is_checked(script: Script, capsys: pytest.CaptureFixture[str],
                           job_id: str) -> None:
    code, _, err = run_cli(capsys, "run", "--dry-run", f"--job-id={job_id}",
                           str(script("t.py", "")))
    assert code == 2 and "invalid job id" in err and "fix:" in err


def test_bad_resource_spec(script: Script, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text("nodes:\n  - adress: 10.0.0.1\n")
    code, _, err = run_cli(capsys, "run", "--resource-spec", str(spec), str(script("t.py", "")))
    assert code == 2 and "stratagem: error:" in err and "adress" in err
    assert "did you mean 'address'" in err and "Traceback" not in err


def test_missing_resource_spec(script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "run", "--resource-spec", "nope.yml", str(script("t.py", "")))
    assert code == 2 and "nope.yml: file not found" in err


def test_unknown_strategy_lists_builders(script: Script,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "run", "--strategy", "NoSuchBuilder", str(script("t.py", "")))
    assert code == 2 and "unknown strategy builder 'NoSuchBuilder'" in err
    assert "AllReduce" in err


def test_missing_strategy_file(script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "run", "--strategy", "plan.yml", str(script("t.py", "")))
    assert code == 2 and "strategy file 'plan.yml' not found" in err


def test_nproc_with_multinode_spec(script: Script, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text(TWO_NODES)
    code, _, err = run_cli(capsys, "run", "--resource-spec", str(spec), "--nproc", "2",
                           str(script("t.py", "")))
    assert code == 2 and "--nproc only applies to single-node runs" in err


def test_ssh_not_installed(script: Script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text(TWO_NODES)
    monkeypatch.delenv("STRATAGEM_REMOTE_SHELL", raising=False)
    monkeypatch.setattr(remote_shell.shutil, "which", lambda name: None)
    code, _, err = run_cli(capsys, "run", "--resource-spec", str(spec), str(script("t.py", "")))
    assert code == 2 and "no `ssh` client is installed" in err
    assert "openssh-client" in err and "--remote-shell" in err


def test_remote_shell_template_needs_address(script: Script, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text(TWO_NODES)
    code, _, err = run_cli(capsys, "run", "--resource-spec", str(spec), "--remote-shell",
                           "docker exec node", str(script("t.py", "")))
    assert code == 2 and "has no {address}" in err


def test_dry_run_passes_script_args_through(script: Script,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = script("train.py", "")
    code, out, err = run_cli(capsys, "run", "--dry-run", "--nproc", "2", "--job-id", "j1",
                             str(path), "--lr", "0.1", "--nproc", "3")
    assert code == 0
    assert "job j1: 2 workers on 1 node" in err and "rendezvous c10d at 127.0.0.1:" in err
    argv = shlex.split(out.split(": ", 1)[1])
    assert argv[-5:] == [str(path), "--lr", "0.1", "--nproc", "3"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--max-restarts") + 1] == "0"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-id") + 1] == "j1"
    assert argv[argv.index("--nnodes") + 1] == "1"


def test_script_options_that_abbreviate_launcher_options_go_to_the_script(
        script: Script, capsys: pytest.CaptureFixture[str]) -> None:
    """``stratagem run --nproc 2 s.py --n 1024``: ``--n`` belongs to the script, not an
    ambiguous abbreviation of the launcher's, the agent's or torchrun's options."""
    from torch.distributed.run import get_args_parser

    path = script("train.py", "")
    code, out, err = run_cli(capsys, "run", "--dry-run", "--nproc", "2", str(path),
                             "--n", "1024", "--node", "x", "-q")
    assert code == 0, err
    argv = shlex.split(out.split(": ", 1)[1])
    torchrun = argv[argv.index("--") + 1:]  # what the agent hands torchrun, as it parses it
    args = get_args_parser().parse_args(torchrun)
    assert args.module and args.training_script == "stratagem.launch.worker"
    assert args.training_script_args == [str(path), "--n", "1024", "--node", "x", "-q"]
    assert args.nproc_per_node == "2"


@pytest.mark.parametrize(("variable", "value"), [
    ("STRATAGEM_PG_TIMEOUT_S", "nan"), ("STRATAGEM_PG_TIMEOUT_S", "0"),
    ("STRATAGEM_PEER_TIMEOUT_S", "nan"), ("STRATAGEM_CHECKPOINT_SECONDS", "inf"),
    ("STRATAGEM_CHECKPOINT_DIR", "   ")])
def test_bad_environment_fails_the_launch_not_the_workers(
        script: Script, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    code, _, err = run_cli(capsys, "run", "--dry-run", str(script("t.py", "")))
    assert code == 2 and variable in err and "Traceback" not in err


def test_checkpoint_seconds_must_be_finite(script: Script, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "run", "--dry-run", "--checkpoint-dir", str(tmp_path),
                           "--checkpoint-seconds", "inf", str(script("t.py", "")))
    assert code == 2 and "--checkpoint-seconds must be 0 to 1e9" in err


PLAN_WITHOUT_TORCH = """
import sys
import stratagem.resource
from stratagem import cli
stratagem.resource.may_have_gpus = lambda: False  # as on a machine without a GPU driver
code = cli.main(["run", "--dry-run", "--nproc", "2", *sys.argv[1:]])
assert code == 0, code
assert "torch" not in sys.modules, "the launcher imported torch"
"""


def test_the_launcher_plans_a_cpu_job_without_importing_torch(script: Script,
                                                              tmp_path: Path) -> None:
    """Importing torch costs the launcher seconds before any worker starts; it needs torch
    only to count GPUs (and to check a --strategy), not on a machine without a GPU."""
    path = script("train.py", "")
    options = ("--max-restarts", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--checkpoint-steps", "5")
    proc = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_TORCH, *options, str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "job " in proc.stderr and "2 workers on 1 node" in proc.stderr


def test_a_reader_that_leaves_early_is_not_a_traceback() -> None:
    """``stratagem ls | head -1``: the closed pipe ends the command quietly, exit code 0."""
    import subprocess
    import sys

    code = ("import argparse, sys\nfrom stratagem.cli import app as cli\n"
            "def spam(args):\n    for i in range(1_000_000):\n        print('line', i)\n"
            "    return 0\n"
            "parser = argparse.ArgumentParser()\nparser.set_defaults(handler=spam)\n"
            "cli.build_parser = lambda: parser\nsys.exit(cli.main([]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and proc.returncode == 0, err.decode()[-2000:]
