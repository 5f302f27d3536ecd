"""A stop (SIGTERM to ``stratagem run``) during a periodic save waits for that save and for
the stop save, up to the stop grace, and says what was saved where (issue 47 item 8).

Before: the agent's torch elastic killed the workers 3 s after the stop and the launcher
6 s after it, so a save taking longer lost both the save in flight and the stop save; a
stop cut short left a ``ckpt-N.tmp`` directory behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from _load import patience
from launch_helpers import job_processes, stratagem_cmd

from stratagem import checkpoint, env
from stratagem.errors import StratagemError
from stratagem.launch import grace

Script = Callable[[str, str], Path]

# One replica; a State whose save takes SAVE_S seconds (and drops a marker file when it
# starts); a periodic checkpoint every 20 steps, written synchronously.
SLOW_SAVE = """
import json, os, time, torch
import stratagem.adaptdl.torch as adl
from stratagem.adaptdl.checkpoint import State, load_state

class Slow(State):
    def __init__(self):
        super().__init__("slow")
        self.n = 0
    def save(self, f):
        open(os.path.join(os.environ["MARKS"], f"saving-{self.n}"), "w").close()
        time.sleep(float(os.environ["SAVE_S"]))
        f.write(json.dumps(self.n).encode())
    def load(self, f):
        self.n = json.loads(f.read())

adl.init_process_group("gloo")
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = adl.AdaptiveDataLoader(data, batch_size=8)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
net = adl.AdaptiveDataParallel(net, opt)
slow = Slow()
load_state(slow)
for epoch in adl.remaining_epochs_until(10_000):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        slow.n += 1
        time.sleep(0.02)
"""


def _stop_during_save(script: Script, tmp_path: Path, save_s: float,
                      extra: tuple[str, ...] = ()) -> tuple[int, str, Path]:
    ckpt, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    job = f"t-{uuid.uuid4().hex[:8]}"
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("STRATAGEM_", "ADAPTDL_", "TORCH_ELASTIC"))}
    environ.update(MARKS=str(marks), SAVE_S=str(save_s), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="")
    log = tmp_path / "out.log"
    cmd = stratagem_cmd("run", "--nproc", "1", "--job-id", job, "--checkpoint-dir", str(ckpt),
                        "--checkpoint-steps", "20", "--checkpoint-sync", *extra,
                        str(script("slow.py", SLOW_SAVE)))
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env=environ)
        try:
            deadline = time.monotonic() + patience(90)
            while not any(marks.iterdir()):  # the periodic save has started
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=patience(90))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    deadline = time.monotonic() + 5
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(job) == []
    return code, log.read_text(), ckpt


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stop_waits_for_the_save_in_flight_and_the_stop_save(script: Script,
                                                             tmp_path: Path) -> None:
    save_s = 4.0  # longer than the agent's (3 s) and the launcher's (6 s) old limits together
    code, text, ckpt = _stop_during_save(script, tmp_path, save_s)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    saved = checkpoint.CheckpointDir(ckpt).checkpoints()
    assert [p.name for p in saved] == ["ckpt-00000001", "ckpt-00000002"], text[-3000:]
    periodic, stop = (json.loads((p / "slow.pt").read_bytes()) for p in saved)
    assert periodic == 20 and stop > periodic  # the stop saved after the save in flight
    assert checkpoint.read_meta(saved[-1])["save_seconds"] >= save_s
    assert f"stratagem: the job state was saved to {saved[-1]}" in text, text[-3000:]
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stop_cut_short_by_the_grace_says_so_and_leaves_no_tmp(script: Script,
                                                                  tmp_path: Path) -> None:
    code, text, ckpt = _stop_during_save(script, tmp_path, 30.0, ("--stop-grace", "2"))
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert checkpoint.CheckpointDir(ckpt).checkpoints() == []
    assert "did not finish within the stop grace of 2 s" in text, text[-3000:]
    assert f"no new checkpoint was saved in {ckpt}" in text, text[-3000:]
    assert "removed the unfinished ckpt-00000001.tmp" in text, text[-3000:]
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]


def _meta(root: Path, seq: int, seconds: float | None) -> None:
    path = root / f"ckpt-{seq:08d}"
    path.mkdir(parents=True)
    meta = {"sha256": {}, "world_size": 1}
    if seconds is not None:
        meta["save_seconds"] = seconds
    (path / "meta.json").write_text(json.dumps(meta))


def test_grace_comes_from_the_setting_else_the_last_save(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delenv(env.STOP_GRACE, raising=False)
    monkeypatch.delenv(grace.TORCH_SHUTDOWN, raising=False)
    assert grace.stop_grace_s(None) == grace.DEFAULT_S
    assert grace.stop_grace_s(tmp_path) == grace.DEFAULT_S  # no checkpoint yet
    _meta(tmp_path, 1, 3.0)
    assert grace.stop_grace_s(tmp_path) == grace.DEFAULT_S  # 2 * 3 + 10 < 30
    _meta(tmp_path, 2, 40.0)
    (tmp_path / "ckpt-00000003.tmp").mkdir()  # unfinished: not the newest checkpoint
    assert grace.last_save_seconds(tmp_path) == 40.0
    assert grace.stop_grace_s(tmp_path) == 2 * 40.0 + grace.MARGIN_S
    monkeypatch.setenv(grace.TORCH_SHUTDOWN, "45")  # torch elastic's own setting counts
    assert grace.stop_grace_s(tmp_path) == 45.0
    monkeypatch.setenv(env.STOP_GRACE, "12.5")
    assert grace.stop_grace_s(tmp_path) == 12.5
    assert grace.stop_grace_s(tmp_path, explicit=7.0) == 7.0
    assert grace.remove_unfinished(tmp_path) == ["ckpt-00000003.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001", "ckpt-00000002"]


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf", "1e309", "soon", "86401"])
def test_a_bad_grace_setting_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.STOP_GRACE, value)
    with pytest.raises(StratagemError, match="STRATAGEM_STOP_GRACE_S") as exc:
        grace.stop_grace_s(None)
    assert "86400" in str(exc.value)


def test_a_save_records_how_long_it_took(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from stratagem.elastic import drop_job
    from stratagem.elastic.state import State, register, save_all_states

    class Slow(State):
        def state_dict(self) -> dict:
            time.sleep(0.2)
            return {"n": 1}

        def load_state_dict(self, state: dict) -> None:
            pass

    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path))
    try:
        register(Slow("slow"))
        path = save_all_states()
    finally:
        drop_job()
    assert path is not None
    assert checkpoint.read_meta(path)["save_seconds"] >= 0.2
    assert grace.last_save_seconds(tmp_path) == checkpoint.read_meta(path)["save_seconds"]


def test_a_stop_signals_the_training_process_not_its_loader_workers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch elastic's real process context: SIGTERM reaches the worker process alone (its
    children, e.g. DataLoader workers, keep running until it has saved); SIGKILL still
    reaches the whole process group."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handlers,
    )

    from stratagem.launch.agent import signal_training_process_only

    monkeypatch.setattr(handlers.SubprocessHandler, "close",
                        handlers.SubprocessHandler.close)  # undone after the test
    signal_training_process_only()
    child = tmp_path / "child.pid"
    # the "training process" (a shell) starts a "loader worker" (sleep) in its own group
    script = f"sleep 30 & echo $! > {child}; wait"
    pc = start_processes(name="t", entrypoint="/bin/sh", args={0: ("-c", script)},
                         envs={0: {}}, logs_specs=DefaultLogsSpecs(str(tmp_path / "logs")))
    try:
        deadline = time.monotonic() + 10
        while not (child.exists() and child.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        kid = int(child.read_text())
        pc.close(signal.SIGTERM, timeout=5)  # the shell ends on SIGTERM
        time.sleep(0.3)
        stat = Path(f"/proc/{kid}/stat").read_text()  # not a zombie (nothing may reap it)
        assert stat[stat.rfind(")") + 2] in "SR", stat  # not signalled: still running
    finally:
        with contextlib.suppress(OSError):
            os.kill(int(child.read_text()), signal.SIGKILL)
