"""Rank 0's progress: a live line on a terminal, plain lines without control characters in a
pipe; epochs counted from 1, as the examples print them; adaptive fields only for adaptive
jobs."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.observe import ProgressDisplay, ProgressFields

SCRIPT = Path(__file__).with_name("progress_script.py")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # everything but \t and \n


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("STRATAGEM_", "ADAPTDL_"))}
    env["STRATAGEM_RUN_DIR"] = str(tmp_path)
    return env


def _run_in_pty(args: list[str], env: dict[str, str]) -> str:
    """Run with stdout and stderr on a pseudo-terminal; everything it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL,
                            env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode()


def test_pipe_gets_plain_lines_without_control_characters(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         env=_env(tmp_path), timeout=120, check=True).stdout
    assert not CONTROL.search(out), repr(out)
    ends = [ln for ln in out.splitlines() if ln.startswith("epoch ") and "step 3/3" in ln]
    assert [ln.split()[1] for ln in ends] == ["1", "2"]  # from 1, as people count
    for line in ends:
        assert "samples/s" in line and "loss " in line
        assert "?" not in line and "batch" not in line and "efficiency" not in line
    # the progress line's epoch matches what the script printed right after it
    lines = out.splitlines()
    for epoch in (0, 1):
        done = lines.index(f"script epoch {epoch} done")
        assert lines[done - 1].startswith(f"epoch {epoch + 1} step 3/3")
    # the same run's metrics file renders (plots from a real run, not a hand-written file)
    pytest.importorskip("matplotlib")
    from stratagem.cli.report import PLOTS, render

    render(tmp_path)
    assert all((tmp_path / "report" / f"{p}.png").stat().st_size > 5000 for p in PLOTS)


def test_terminal_gets_a_live_line(tmp_path: Path) -> None:
    out = _run_in_pty([sys.executable, str(SCRIPT)], _env(tmp_path))
    assert "\r" in out  # the line is rewritten in place
    final = [seg for seg in re.split(r"[\r\n]+", out) if seg.startswith("epoch 2 step 3/3")]
    assert final and "samples/s" in final[-1] and "loss" in final[-1]
    assert "?" not in out and "efficiency" not in out


def test_adaptive_job_shows_batch_and_replicas(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "adaptive"], capture_output=True,
                         text=True, env=_env(tmp_path), timeout=120, check=True).stdout
    progress = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert progress and all(re.search(r"batch \d+ \(1 x \d+\)", ln) for ln in progress)
    assert "?" not in out


def test_a_resumed_epoch_shows_its_position_and_length(tmp_path: Path) -> None:
    """Issue 49: after a resume one step into an epoch of 3, the line said "step 2/2" (the
    remaining steps as the total); it says where in the whole epoch the job is."""
    out = subprocess.run([sys.executable, str(SCRIPT), "resume"], capture_output=True,
                         text=True, env=_env(tmp_path), timeout=120, check=True).stdout
    lines = out.splitlines()
    first = lines[lines.index("script epoch 0 done") - 1]
    assert first.startswith("epoch 1 step 3/3 "), out
    second = lines[lines.index("script epoch 1 done") - 1]
    assert second.startswith("epoch 2 step 3/3 "), out


@pytest.mark.parametrize("mode", ["plain", "live"])
def test_display_modes(mode: str) -> None:
    stream = io.StringIO()
    display = ProgressDisplay(mode, stream)
    fields = ProgressFields(epoch=2, step=5, steps=10, samples_per_s=123.0, loss=0.5)
    display.update(fields)
    display.update(fields)  # too soon: nothing new
    display.message("stratagem: hello")
    display.end_epoch(ProgressFields(epoch=2, step=10, steps=10, samples_per_s=120.0))
    text = stream.getvalue()
    if mode == "plain":
        assert text.splitlines() == [
            "epoch 3 step 5/10 | 123 samples/s | loss 0.5", "stratagem: hello",
            "epoch 3 step 10/10 | 120 samples/s"]
    else:
        assert text.count("epoch 3 step 5/10") == 1 and text.endswith("120 samples/s\n")
        assert "\rstratagem: hello\n" in text  # the live line is cleared first
