"""``stratagem run --max-restarts``: the supervisor restarts a failed job (fake agents: small
Python commands, no torch) and the launcher's restart options."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
from pathlib import Path

import pytest

from stratagem import env
from stratagem.errors import LaunchError
from stratagem.launch.job import AgentLaunch, JobOptions, LaunchPlan, RestartPolicy
from stratagem.launch.launcher import plan_job, restart_policy
from stratagem.launch.supervisor import Supervisor, newest_checkpoint
from stratagem.resource import Node

# Fails (exit 3) while the counter file holds fewer than FAILS runs; with CKPT, each run
# first makes a new checkpoint directory (progress).
AGENT = """
import os, sys
counter, fails, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(runs + 1))
if ckpt:
    os.makedirs(os.path.join(ckpt, f"ckpt-{runs:08d}"))
print(f"run {runs} restart={os.environ.get('STRATAGEM_RESTART_COUNT')}", flush=True)
sys.exit(3 if runs < fails else 0)
"""


def _plan(tmp: Path, fails: int, ckpt: Path | None = None, restart: int = 0) -> LaunchPlan:
    argv = (sys.executable, "-c", AGENT, str(tmp / "runs"), str(fails), str(ckpt or ""))
    environ = {**os.environ, env.RESTART_COUNT: str(restart)}
    agent = AgentLaunch(0, Node(address="127.0.0.1"), argv, environ, "local", True)
    return LaunchPlan("job-r", "127.0.0.1:1", (agent,))


def _run(tmp: Path, fails: int, policy: RestartPolicy, ckpt: Path | None = None
         ) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    sup = Supervisor(_plan(tmp, fails, ckpt), out=out, err=err, grace=1.0, policy=policy,
                     replan=lambda n: _plan(tmp, fails, ckpt, restart=n))
    code = sup.run()
    return code, out.getvalue(), err.getvalue()


def test_failed_job_is_restarted_and_the_count_reported(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, 2, RestartPolicy(max_restarts=3, backoff_s=0.01))
    assert code == 0
    assert re.findall(r"run (\d) restart=(\d)", out) == [("0", "0"), ("1", "1"), ("2", "2")]
    failures = [line for line in err.splitlines() if line.startswith("stratagem: failure")]
    assert failures == [
        "stratagem: failure 1: node 0 (127.0.0.1): agent exited with code 3; restarting in "
        "0.01 s from the start (no checkpoint directory) (restart 1 of 3)",
        "stratagem: failure 2: node 0 (127.0.0.1): agent exited with code 3; restarting in "
        "0.02 s from the start (no checkpoint directory) (restart 2 of 3)"]
    assert err.count("stratagem: restart ") == 2
    assert re.search(r"job job-r finished: 1 workers, [\d.]+ s \(2 restarts\)", err)


def test_zero_restarts_fails_on_the_first_failure(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, 1, RestartPolicy(max_restarts=0))
    assert code == 1
    assert out.count("run ") == 1
    assert "failure 1:" not in err and "stratagem: restart" not in err
    assert "job job-r failed" in err and "agent exited with code 3" in err


def test_a_job_failing_every_time_stops_with_the_first_cause(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, 99, RestartPolicy(max_restarts=2, backoff_s=0.01))
    assert code == 1
    assert out.count("run ") == 3  # the first run and two restarts
    assert "first failure: node 0 (127.0.0.1): agent exited with code 3" in err
    assert "gave up after 2 restarts: it failed 3 times, the same way each time" in err


def test_backoff_doubles_without_progress_and_resets_with_a_new_checkpoint(
        tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _, _, err = _run(tmp_path / "a", 3, RestartPolicy(max_restarts=3, backoff_s=0.05,
                                                      max_backoff_s=0.15))
    assert re.findall(r"restarting in ([\d.]+) s", err) == ["0.05", "0.1", "0.15"]
    (tmp_path / "b").mkdir()
    ckpt = tmp_path / "ckpt"
    _, _, err = _run(tmp_path / "b", 3, RestartPolicy(max_restarts=3, backoff_s=0.05,
                                                      checkpoint_dir=str(ckpt)), ckpt)
    assert re.findall(r"restarting in ([\d.]+) s", err) == ["0.05", "0.05", "0.05"]
    assert re.findall(r"from (ckpt-\d+)", err) == ["ckpt-00000000", "ckpt-00000001",
                                                   "ckpt-00000002"]


def test_newest_checkpoint_ignores_temporary_and_corrupt_directories(tmp_path: Path) -> None:
    for name in ("ckpt-00000002", "ckpt-00000010", "ckpt-00000011.tmp", "ckpt-9.corrupt"):
        (tmp_path / name).mkdir()
    assert newest_checkpoint(str(tmp_path)) == "ckpt-00000010"
    assert newest_checkpoint(str(tmp_path / "missing")) is None
    assert newest_checkpoint(None) is None


def test_restart_policy_defaults_to_three_with_a_checkpoint_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CHECKPOINT_DIR, raising=False)
    monkeypatch.delenv(env.ADAPTDL_CHECKPOINT_PATH, raising=False)
    script = str(tmp_path / "t.py")
    assert restart_policy(JobOptions(script)).max_restarts == 0
    with_dir = restart_policy(JobOptions(script, checkpoint_dir=str(tmp_path)))
    assert (with_dir.max_restarts, with_dir.checkpoint_dir) == (3, str(tmp_path))
    assert restart_policy(JobOptions(script, checkpoint_dir="x", max_restarts=0)
                          ).max_restarts == 0
    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path))
    assert restart_policy(JobOptions(script)).max_restarts == 3


def test_plan_gives_workers_the_checkpoint_settings_and_restart_count(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    opts = JobOptions(str(script), nproc=2, checkpoint_dir=str(tmp_path / "ck"),
                      checkpoint_steps=5, checkpoint_seconds=30)
    agent_env = plan_job(opts, restart=2).agents[0].env
    assert agent_env[env.CHECKPOINT_DIR] == str((tmp_path / "ck").resolve())
    assert agent_env[env.CHECKPOINT_STEPS] == "5"
    assert agent_env[env.CHECKPOINT_SECONDS] == "30.0"
    assert agent_env[env.RESTART_COUNT] == "2"
    assert env.CHECKPOINT_ASYNC not in agent_env  # background writes: the workers' default
    sync_env = plan_job(dataclasses.replace(opts, checkpoint_sync=True)).agents[0].env
    assert sync_env[env.CHECKPOINT_ASYNC] == "0"


@pytest.mark.parametrize(("field", "value", "where"), [
    ("max_restarts", -1, "--max-restarts"),
    ("restart_backoff", -1.0, "--restart-backoff"),
    ("checkpoint_steps", -3, "--checkpoint-steps"),
    ("checkpoint_seconds", float("nan"), "--checkpoint-seconds"),
])
def test_bad_restart_options_are_named(tmp_path: Path, field: str, value: float,
                                       where: str) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    opts = JobOptions(str(script), checkpoint_dir=str(tmp_path), **{field: value})
    with pytest.raises(LaunchError) as err:
        plan_job(opts)
    assert err.value.where == where and err.value.fix


def test_periodic_checkpoints_need_a_checkpoint_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CHECKPOINT_DIR, raising=False)
    monkeypatch.delenv(env.ADAPTDL_CHECKPOINT_PATH, raising=False)
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(LaunchError, match="need a checkpoint directory"):
        plan_job(JobOptions(str(script), checkpoint_steps=10))


@pytest.mark.parametrize(("message", "stop"), [("SystemExit: 143", True),
                                               ("killed by SIGKILL", False),
                                               ("SystemExit: 1", False)])
def test_workers_that_saved_on_sigterm_are_a_stop_not_a_crash(message: str,
                                                               stop: bool) -> None:
    from stratagem.launch.supervisor import _Agent

    launch = AgentLaunch(0, Node(address="127.0.0.1"), ("true",), {}, "local", True)
    agent = _Agent(launch, proc=None, code=1)  # type: ignore[arg-type]
    agent.failures = [{"kind": "exception", "rank": "0", "time": 1.0, "message": message,
                       "traceback": ""}]
    sup = Supervisor(LaunchPlan("j", "127.0.0.1:1", (launch,)), err=io.StringIO(),
                     policy=RestartPolicy(max_restarts=3))
    sup.agents = [agent]
    assert sup.describe_failure(agent).stop_request is stop
