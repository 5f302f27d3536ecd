"""Gloo's I/O threads yield the CPU while the main thread waits on their group
(stratagem.distributed.gloo_threads):
the policy switch itself, on real groups, and when it must stay
off. Timing is the benchmarks' business (bench/README.md); this checks the mechanism."""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import yield_workers
from rt_common import spawn

from stratagem.distributed import gloo_threads
from stratagem.errors import StratagemError

pytestmark = pytest.mark.timeout(120)
IDLE, OTHER = getattr(os, "SCHED_IDLE", 5), getattr(os, "SCHED_OTHER", 0)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test decides ``enabled()`` anew."""
    monkeypatch.setattr(gloo_threads, "_enabled", None)
    monkeypatch.setattr(gloo_threads, "_depth", 0)


def _allowed() -> bool:
    return gloo_threads._can_leave_idle()


def test_a_new_group_claims_its_io_thread(fresh: None) -> None:
    pg, mine = gloo_threads.new_loops(lambda: dist.ProcessGroupGloo(
        dist.HashStore(), 0, 1, timedelta(seconds=30)))
    assert len(mine) == 1 and mine <= gloo_threads.loop_threads()
    assert not mine & gloo_threads.unclaimed_loops()  # the default group's are the rest
    del pg


def test_a_thread_named_late_is_still_claimed(fresh: None) -> None:
    """A group's I/O thread names itself once it runs, which on a busy core is after the
    group's constructor has returned: the claim waits for the name (it once missed 197 of
    200 groups with two spinning processes on this machine's two cores)."""
    release, done = threading.Event(), threading.Event()

    def io_thread() -> None:
        release.wait(5)  # named only after create() has returned
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fp:
            fp.write(gloo_threads.LOOP_NAME)
        done.wait(5)

    def create() -> threading.Thread:
        t = threading.Thread(target=io_thread, daemon=True)
        t.start()
        threading.Timer(0.05, release.set).start()
        return t

    t, mine = gloo_threads.new_loops(create)
    try:
        assert mine == {t.native_id}
        assert not mine & gloo_threads.unclaimed_loops()
    finally:
        done.set()
        t.join(5)


def test_the_main_threads_wait_idles_the_threads_and_restores_them(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _allowed():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    monkeypatch.setenv("STRATAGEM_GLOO_YIELD", "on")
    ready = threading.Event()
    done = threading.Event()
    stand_in = threading.Thread(target=lambda: (ready.set(), done.wait()), daemon=True)
    stand_in.start()
    ready.wait()
    tid = stand_in.native_id
    outer, inner = gloo_threads.Yielding([tid]), gloo_threads.Yielding([tid])
    try:
        with outer:
            assert os.sched_getscheduler(tid) == IDLE
            with inner:
                assert os.sched_getscheduler(tid) == IDLE
            assert os.sched_getscheduler(tid) == IDLE  # the inner wait did not restore
        assert os.sched_getscheduler(tid) == OTHER
        seen = []
        other = threading.Thread(target=lambda: [outer.__enter__(), seen.append(
            os.sched_getscheduler(tid)), outer.__exit__()])
        other.start()
        other.join()
        assert seen == [OTHER]  # a background thread's wait changes nothing
    finally:
        done.set()
        stand_in.join()


@pytest.mark.parametrize(("mode", "one_cpu"), [(None, True), ("off", True), ("auto", False)])
def test_off_by_default_or_on_several_cpus_nothing_changes(
        fresh: None, mode: str | None, one_cpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode is None:
        monkeypatch.delenv("STRATAGEM_GLOO_YIELD", raising=False)
    else:
        monkeypatch.setenv("STRATAGEM_GLOO_YIELD", mode)
    monkeypatch.setattr(gloo_threads, "one_cpu", lambda: one_cpu)
    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: calls.append(a))
    with gloo_threads.Yielding([os.getpid()]):
        pass
    assert calls == []


def test_auto_yields_where_the_process_has_one_cpu(fresh: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if not _allowed():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    monkeypatch.setenv("STRATAGEM_GLOO_YIELD", "auto")
    monkeypatch.setattr(gloo_threads, "one_cpu", lambda: True)
    assert gloo_threads.enabled()


def test_without_the_right_to_leave_idle_it_stays_off_and_says_so(
        fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("STRATAGEM_GLOO_YIELD", "on")
    real = os.sched_setscheduler

    def unprivileged(tid: int, policy: int, param: os.sched_param) -> None:
        if policy != IDLE:
            raise PermissionError(1, "Operation not permitted")
        real(tid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", unprivileged)
    with caplog.at_level(logging.WARNING, logger="stratagem.distributed.gloo_threads"):
        assert not gloo_threads.enabled()
    assert "CAP_SYS_NICE" in caplog.text


def test_a_bad_mode_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from stratagem import env
    monkeypatch.setenv("STRATAGEM_GLOO_YIELD", "yes")
    with pytest.raises(StratagemError, match="STRATAGEM_GLOO_YIELD"):
        env.gloo_yield()


@pytest.mark.parametrize(("mode", "waiter", "during"), [
    ("on", "main", {IDLE}), ("off", "main", {OTHER}), ("on", "background", {OTHER})])
def test_a_real_wait_on_a_two_process_group(tmp_path: Path, mode: str, waiter: str,
                                            during: set[int]) -> None:
    if mode == "on" and not _allowed():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    seen = spawn(yield_workers.policies_during_a_wait, 2, tmp_path, mode=mode,
                 waiter=waiter)[0]
    assert seen["threads"] == {1}  # the default group's I/O thread
    assert seen["before"] == {OTHER} and seen["after"] == {OTHER}
    assert seen["during"] == during


def test_a_parameter_server_groups_wait_idles_its_own_thread(tmp_path: Path) -> None:
    if not _allowed():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    seen = spawn(yield_workers.policies_during_a_wait, 2, tmp_path, mode="on",
                 waiter="main", through="ps")[0]
    assert seen["threads"] == {1}
    assert seen["before"] == {OTHER} and seen["after"] == {OTHER}
    assert seen["during"] == {IDLE}
