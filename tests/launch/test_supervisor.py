"""The failure summary: which rank and node the launcher blames (no processes started)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stratagem.launch.agent import (
    FAILURE_MARKER,
    TORCH_PCONTEXT_LOGGER,
    StoppedPids,
    _shutdown_timeout,
    bound_failure_shutdown,
    read_key,
    tolerate_torn_error_files,
    untraced_failures,
)
from stratagem.launch.job import AgentLaunch, LaunchPlan
from stratagem.launch.supervisor import Supervisor, _Agent
from stratagem.resource import Node


def _supervisor(*failures: list[dict[str, Any]], code: int = 1) -> tuple[Supervisor, list]:
    agents = []
    for i, records in enumerate(failures):
        launch = AgentLaunch(i, Node(address=f"10.0.0.{i + 1}"), ("true",), {}, "ssh", i == 0)
        agent = _Agent(launch, proc=None, code=code)  # type: ignore[arg-type]
        agent.failures = records
        agent.tail.extend(["ssh: connect to host 10.0.0.2 port 22: No route to host"])
        agents.append(agent)
    plan = LaunchPlan("j", "10.0.0.1:1", tuple(a.launch for a in agents))
    sup = Supervisor(plan)
    sup.agents = agents
    return sup, agents


def _exc(rank: int, t: float, msg: str) -> dict[str, Any]:
    return {"kind": "exception", "rank": str(rank), "time": t, "message": msg,
            "traceback": f"Traceback (most recent call last):\n{msg}\n"}


def _sig(rank: int, t: float, sig: str, kind: str = "signal") -> dict[str, Any]:
    return {"kind": kind, "signal": sig, "rank": str(rank), "time": t,
            "message": f"killed by {sig}", "traceback": ""}


def test_earliest_exception_across_nodes_wins() -> None:
    victim = _exc(0, 2.5, "RuntimeError: Connection closed by peer")
    culprit = _exc(3, 2.1, "ValueError: bad batch")
    stopped = _sig(1, 2.0, "SIGKILL", kind="stopped")  # torchrun's own shutdown
    sup, agents = _supervisor([victim, stopped], [culprit])
    text = sup.failure_summary(agents[0])  # node 0's agent happened to exit first
    assert "job j failed and stopped the other nodes" in text
    assert "first failure: rank 3 on node 1 (10.0.0.2): ValueError: bad batch" in text
    assert "Connection closed" not in text


def test_crash_signal_beats_the_exceptions_it_causes() -> None:
    sup, agents = _supervisor([_exc(0, 1.0, "RuntimeError: Connection closed by peer"),
                               _sig(1, 3.0, "SIGSEGV")])
    text = sup.failure_summary(agents[0])
    assert "first failure: rank 1 on node 0 (10.0.0.1): killed by SIGSEGV" in text
    assert "no Python traceback; see the [node 0] output above" in text


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGSEGV"])
def test_any_signal_death_torchrun_did_not_send_is_the_cause(sig: str) -> None:
    peer = _exc(0, 1.0, "RuntimeError: Connection reset by peer")  # recorded earlier
    sup, agents = _supervisor([peer, _sig(1, 5.0, sig)])
    assert f"first failure: rank 1 on node 0 (10.0.0.1): killed by {sig}" in \
        sup.failure_summary(agents[0])


def test_records_need_the_jobs_key() -> None:
    sup, _ = _supervisor([])
    record = '{"kind": "signal", "rank": "7", "time": 0}'
    assert sup._record(f"{sup._key} {record}") == json.loads(record)
    assert sup._record(record) is None  # no key: a worker's line
    assert sup._record(f"{'0' * len(sup._key)} {record}") is None
    assert sup._record(f"{sup._key} not json") is None
    other, _ = _supervisor([])
    assert other._key != sup._key  # fresh per launcher


def test_forged_record_lines_are_shown_as_output() -> None:
    sup, agents = _supervisor([])
    agents[0].failures = []
    err = io.StringIO()
    sup.err = err
    genuine = f'{FAILURE_MARKER}{sup._key} {{"kind": "exit", "rank": "1"}}\n'
    forged = f'{FAILURE_MARKER}deadbeef {{"kind": "signal", "rank": "7"}}\n'
    sup._pump(agents[0], io.BytesIO((forged + genuine).encode()), err, True)
    assert agents[0].failures == [{"kind": "exit", "rank": "1"}]
    assert err.getvalue() == "[node 0] " + forged


def test_agent_tells_stopped_workers_from_killed_ones() -> None:
    stopped = StoppedPids().install()
    try:
        logging.getLogger(TORCH_PCONTEXT_LOGGER).warning(
            "Sending process %s closing signal %s", 4242, "SIGTERM")
    finally:
        logging.getLogger(TORCH_PCONTEXT_LOGGER).removeHandler(stopped)
    assert stopped.pids == {4242}

    def failure(pid: int, rank: int, code: int) -> SimpleNamespace:
        return SimpleNamespace(error_file="", exitcode=code, pid=pid, timestamp=7,
                               local_rank=rank, signal_name=lambda: signal.Signals(-code).name)

    exc = SimpleNamespace(failures={0: failure(4242, 0, -signal.SIGKILL),
                                    1: failure(5151, 1, -signal.SIGKILL),
                                    2: failure(6161, 2, 3),
                                    3: failure(7373, 3, 143)})  # handled SIGTERM, exited
    records = untraced_failures(exc, stopped.pids | {7373})
    assert [(r["rank"], r["kind"]) for r in records] == [
        ("0", "stopped"), ("1", "signal"), ("2", "exit"), ("3", "stopped")]
    assert records[1]["message"] == "killed by SIGKILL"


def test_no_records_names_the_agent_and_shows_its_output() -> None:
    sup, agents = _supervisor([], [], code=255)
    text = sup.failure_summary(agents[1])
    assert "first failure: node 1 (10.0.0.2): agent exited with code 255" in text
    assert "No route to host" in text


def test_agent_reads_only_the_key_line_from_stdin() -> None:
    read, write = os.pipe()
    os.write(write, b"abc123\nrest of stdin")
    os.close(write)
    try:
        assert read_key(read) == "abc123"
        assert os.read(read, 100) == b"rest of stdin"  # left for the stdin watcher
    finally:
        os.close(read)
    for raw in (b"", b"not a key!\n", b"x" * 300):
        read, write = os.pipe()
        os.write(write, raw)
        os.close(write)
        try:
            assert read_key(read) == ""
        finally:
            os.close(read)


def test_workers_that_saved_on_our_stop_are_not_a_stop_request() -> None:
    """Node 1's agent was SIGKILLed (no records); node 0's worker, stopped by the launcher,
    saved and exited 143: the failure is the agent, and it is restarted (not a user stop)."""
    saved = _exc(0, 1.0, "SystemExit: 143")
    sup, agents = _supervisor([saved], [], code=-9)
    agents[0].quiet = True  # stopped by the launcher after node 1's agent died
    failure = sup.describe_failure(agents[1])
    assert failure.line == "node 1 (10.0.0.2): agent exited with signal SIGKILL"
    assert not failure.stop_request
    agents[0].quiet = False  # a SIGTERM from elsewhere: the workers' own stop
    assert sup.describe_failure(agents[0]).stop_request


def test_a_failed_workers_peers_are_stopped_within_the_agent_shutdown_timeout(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch elastic's own process context (real processes): when one worker fails, it
    closes the others with close()'s 30 s default; the agent makes that its own shutdown
    timeout, so a peer that ignores SIGTERM cannot hold the job for 30 s."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

    waits: list[float] = []
    real_close = SubprocessContext._close

    def recording_close(self: Any, death_sig: signal.Signals, timeout: float = 30) -> None:
        waits.append(timeout)
        real_close(self, death_sig, timeout)

    monkeypatch.setattr(SubprocessContext, "_close", recording_close)
    monkeypatch.setattr(PContext, "close", PContext.close)  # undone after the test
    bound_failure_shutdown(3)
    pc = start_processes(name="t", entrypoint="/bin/sh",
                         args={0: ("-c", "exit 1"), 1: ("-c", "sleep 30")},
                         envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(str(tmp_path)))
    result = pc.wait(60, period=0.05)
    assert result is not None and result.is_failed() and 0 in result.failures
    assert waits and waits[0] == 3, waits  # the failure's close, not torch's default 30
    pc.close(timeout=7)
    assert waits[-1] == 7  # a caller's own timeout is kept


def test_shutdown_timeout_takes_a_users_whole_seconds_and_replaces_a_bad_value(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert _shutdown_timeout() == 12
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "2.5")  # torch's int() would raise
    assert _shutdown_timeout() == 3
    assert os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "3"
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='2.5' is not a whole number" in capsys.readouterr().err
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert _shutdown_timeout() == 3


def test_a_torn_error_file_is_a_worker_without_one_not_an_agent_crash(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch elastic's own process context (real processes): worker 1 fails; worker 0 had
    begun its error file (empty, as when stopped between open and write) and is stopped.
    torch re-reads the failures after the stop and re-raised the JSON error, ending the agent
    with a traceback instead of the summary; now worker 0 counts as one without a file."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    monkeypatch.setattr(PContext, "close", PContext.close)  # undone after the test
    monkeypatch.setattr(ProcessFailure, "__post_init__", ProcessFailure.__post_init__)
    bound_failure_shutdown(3)
    tolerate_torn_error_files()
    torn = ': > "$TORCHELASTIC_ERROR_FILE"; echo begun; exec sleep 30'
    pc = start_processes(name="t", entrypoint="/bin/sh",
                         args={0: ("-c", torn), 1: ("-c", "sleep 1; exit 1")},
                         envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(str(tmp_path)))
    result = pc.wait(60, period=0.05)
    assert result is not None and sorted(result.failures) == [0, 1]
    assert result.failures[0].exitcode == -signal.SIGTERM
    exc = SimpleNamespace(failures=result.failures)
    records = untraced_failures(exc, {result.failures[0].pid})
    assert sorted((r["rank"], r["kind"]) for r in records) == [("0", "stopped"), ("1", "exit")]


def test_a_worker_error_file_is_whole_or_absent(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """torch elastic reads the file as soon as it exists: a write cut short leaves none."""
    from stratagem.launch import worker

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert worker._write_error_file(ValueError("boom"), None)
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: boom"
    path.unlink()

    def cut_short(obj: Any, fp: Any) -> None:
        fp.write('{"message": {"mess')
        fp.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(worker.json, "dump", cut_short)
    assert not worker._write_error_file(ValueError("boom"), None)
    assert list(tmp_path.iterdir()) == []
