"""The scheduler's decisions against a scripted backend (no Ray): backoff, failure, deletion,
restart without needless restarts, preemption and the policy's rescale."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

from _ray_service import JOB_SCRIPT

from stratagem.errors import StratagemError
from stratagem.service import store as st
from stratagem.service.jobfile import parse_job
from stratagem.service.ray_backend import LOST, Launched
from stratagem.service.scheduler import Scheduler, SchedulerOptions


class FakeBackend:
    """Replicas whose exit codes the test sets; records launches and stops."""

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.codes: dict[str, list[int | None]] = {}
        self.launches: list[tuple[str, int]] = []
        self.stops: list[str] = []
        self.resizes: list[tuple[str, int]] = []
        self.in_process: set[str] = set()
        self.grow_fits = True  # whether added replicas fit on the job's machine

    def nodes(self, exclude=frozenset()):
        return [] if "n0" in exclude else [("n0", float(self.gpus))]

    def launch(self, spec, replicas, generation, env, log_dir, exclude=frozenset(),
               in_process=False):
        assert "n0" not in exclude
        group = f"{spec.name}.g{generation}"
        self.launches.append((spec.name, replicas))
        self.codes[group] = [None] * replicas
        if in_process:
            self.in_process.add(group)
        assert env["STRATAGEM_CHECKPOINT_DIR"] and env["STRATAGEM_JOB_ID"] == spec.name
        return Launched(group, tuple(f"{group}.r{i}" for i in range(replicas)))

    def resize(self, spec, launched, replicas, env, log_dir, exclude=frozenset()):
        group = launched.group_name
        if group not in self.in_process or (replicas > len(launched.actors)
                                            and not self.grow_fits):
            return None
        self.resizes.append((spec.name, replicas))
        self.codes[group] = [None] * replicas
        return Launched(group, tuple(f"{group}.r{i}" for i in range(replicas)))

    def poll(self, launched):
        return list(self.codes[launched.group_name])

    def stop(self, launched, grace=None):
        self.stops.append(launched.group_name)
        return [143] * len(launched.actors)

    def actor_nodes(self, launched):
        return {"n0"}


def spec(name: str, low: int = 1, high: int = 2, **kw):
    return parse_job({"name": name, "script": str(JOB_SCRIPT), "min_replicas": low,
                      "max_replicas": high, **kw})


def make(tmp: Path, backend: FakeBackend, **opts) -> Scheduler:
    base = {"policy": "pollux", "restart_delay": 1.0, "backoff": 10.0, "max_failures": 3,
            "min_runtime": 0.0}  # these tests resize right after a start
    return Scheduler(tmp, SchedulerOptions(**{**base, **opts}), backend=backend)


def group(sched: Scheduler, name: str) -> str:
    return sched.store.allocations()[name].group_name


def test_crashes_back_off_doubling_then_fail_and_spare_the_other_job(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("bad", high=1), now=0.0)
    s.store.add_job(spec("ok", high=1), now=0.0)
    s.step(now=100.0)
    assert sorted(be.launches) == [("bad", 1), ("ok", 1)]  # started side by side
    retry_waits = []
    for attempt in range(3):
        be.codes[group(s, "bad")] = [1]
        now = 200.0 + 100 * attempt
        s.step(now=now)
        job = s.store.job("bad")
        if attempt < 2:
            assert job.state == st.BACKOFF and job.failures == attempt + 1
            retry_waits.append(job.retry_at - now)
            s.step(now=job.retry_at - 0.1)
            assert s.store.job("bad").state == st.BACKOFF  # not before its time
            s.step(now=job.retry_at)
            assert s.store.job("bad").state == st.RUNNING
    assert retry_waits == [10.0, 20.0]
    assert s.store.job("bad").state == st.FAILED and s.store.job("bad").failures == 3
    assert s.store.job("ok").state == st.RUNNING and s.store.job("ok").restarts == 0
    be.codes[group(s, "ok")] = [0]
    s.step(now=600.0)
    assert s.store.job("ok").state == st.SUCCEEDED


def test_a_new_scheduler_reattaches_without_restarting(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a"), now=0.0)
    s.step(now=10.0)
    assert be.launches == [("a", 2)]
    s2 = make(tmp_path, be)  # the restarted service: only the database carries over
    for t in (11.0, 12.0, 13.0):
        s2.step(now=t)
    assert be.launches == [("a", 2)] and be.stops == []
    assert s2.store.job("a").state == st.RUNNING and s2.store.job("a").restarts == 0


def test_a_second_job_shrinks_the_first_by_checkpoint_restart(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a", rescale="restart"), now=0.0)
    s.step(now=1.0)
    s.store.add_job(spec("b"), now=20.0)
    s.step(now=30.0)
    assert be.stops == ["a.g0"] and be.launches[0] == ("a", 2)
    assert sorted(be.launches[1:]) == [("a", 1), ("b", 1)]  # started side by side
    assert s.store.job("a").restarts == 1
    assert s.decisions[-1] == (30.0, {"a": 1, "b": 1})
    assert [n for _, n in s.store.allocation_history("a")] == [2, 1]
    assert sorted(r[1:] for r in s.resizes) == [("a", 0, 2, "start"), ("a", 2, 1, "restart"),
                                                 ("b", 0, 1, "start")]


def test_zero_jobs_resize_in_process_and_parameter_servers_by_restart():
    # ZeRO at any stage reshards in-process (stage 3: units gathered whole, sharded again)
    assert spec("z", strategy="ZeRO").in_process_rescale
    assert spec("a", strategy="AllReduce").in_process_rescale
    assert not spec("p", strategy="PS").in_process_rescale
    assert not spec("z", strategy="ZeRO", rescale="restart").in_process_rescale


def test_a_second_job_shrinks_the_first_in_process_which_grows_back_after(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a"), now=0.0)
    s.step(now=1.0)
    assert be.in_process == {"a.g0"}
    s.store.add_job(spec("b", high=1), now=20.0)
    s.step(now=30.0)
    assert be.stops == [] and be.resizes == [("a", 1)]  # a kept running: no restart
    assert be.launches == [("a", 2), ("b", 1)] and s.store.job("a").restarts == 0
    assert s.store.allocations()["a"].actors == ("a.g0.r0",)
    assert "(in-process)" in s.store.events("a")[-1][2]
    be.codes[group(s, "b")] = [0]  # b finishes: a grows back in-process
    s.step(now=40.0)
    assert be.resizes == [("a", 1), ("a", 2)] and be.stops == ["b.g0"]
    assert [r[1:] for r in s.resizes if r[1] == "a"] == [
        ("a", 0, 2, "start"), ("a", 2, 1, "in-process"), ("a", 1, 2, "in-process")]


def test_a_grow_that_does_not_fit_in_process_falls_back_to_checkpoint_restart(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("b", high=1), now=0.0)
    s.store.add_job(spec("a"), now=0.0)
    s.step(now=1.0)
    assert sorted(be.launches) == [("a", 1), ("b", 1)]
    be.grow_fits = False
    be.codes[group(s, "b")] = [0]
    s.step(now=10.0)
    assert be.resizes == [] and be.stops == ["b.g0", "a.g0"]
    assert be.launches[-1] == ("a", 2) and s.store.job("a").restarts == 1


def test_non_preemptible_jobs_keep_their_replicas(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a", preemptible=False), now=0.0)
    s.step(now=1.0)
    s.store.add_job(spec("b"), now=20.0)
    s.step(now=30.0)
    assert be.stops == [] and s.store.job("b").state == st.PENDING


def test_lost_workers_restart_without_counting_a_crash_and_delete_stops(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a", high=1), now=0.0)
    s.step(now=1.0)
    be.codes[group(s, "a")] = [LOST]
    s.step(now=2.0)
    job = s.store.job("a")
    assert job.state == st.RUNNING and job.failures == 0 and job.restarts == 1
    assert s.store.request_delete("a") == st.RUNNING
    s.step(now=3.0)
    assert s.store.job("a").state == st.DELETED and s.store.allocations() == {}


def test_drain_moves_jobs_off_the_node(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a", high=1), now=0.0)
    s.step(now=1.0)
    assert s.drain("n0") == ["a"]
    s.step(now=2.0)
    assert s.store.job("a").state == st.PENDING and len(be.launches) == 1
    s.undrain("n0")
    s.step(now=3.0)
    assert s.store.job("a").state == st.RUNNING and len(be.launches) == 2


def test_three_jobs_on_two_gpus_do_not_take_turns_every_interval(tmp_path):
    """Three equal jobs on two GPUs (one must wait): a job just started keeps its GPU for
    min_runtime, and restarting a preempted job costs the policy a restart."""
    be = FakeBackend(gpus=2)
    s = make(tmp_path, be, restart_delay=30.0, min_runtime=60.0)
    for name in "abc":
        s.store.add_job(spec(name, high=1), now=0.0)
    for t in range(1, 242, 5):  # four minutes at a 5 s interval
        s.step(now=float(t))
    restarts = {n: s.store.job(n).restarts for n in "abc"}
    assert sum(restarts.values()) <= 2 and max(restarts.values()) <= 1, restarts
    assert len(be.launches) <= 4, be.launches
    for name in "abc":  # never changed again within min_runtime of being given a GPU
        times = [(t, c[name]) for t, c in s.decisions if name in c]
        for (t0, n0), (t1, _) in itertools.pairwise(times):
            assert n0 == 0 or t1 - t0 >= 60.0, (name, times)
    assert sum(len(a.replicas) for a in s.store.allocations().values()) == 2  # no idle GPU


class BlockingBackend(FakeBackend):
    """Launches of the jobs in ``slow`` block until ``release`` is set (a start on a loaded
    cluster: placement, actors' worker processes, imports); others return at once. Records
    which launches happened while a slow one was blocked. ``fail`` makes launches raise."""

    def __init__(self, slow: set[str]) -> None:
        super().__init__()
        self.slow = slow
        self.release = threading.Event()
        self.blocked = threading.Event()  # a slow launch is waiting now
        self.slow_done = threading.Event()  # a slow launch returned
        self.during_block: list[str] = []  # launched before a slow launch returned
        self.fail: str | None = None

    def launch(self, spec, replicas, generation, env, log_dir, exclude=frozenset(),
               in_process=False):
        if spec.name in self.slow:
            self.blocked.set()
            try:
                # bounded: before the fix this held the scheduler's step for all of it
                self.release.wait(timeout=15.0)
            finally:
                self.blocked.clear()
                self.slow_done.set()
        elif not self.slow_done.is_set():
            self.during_block.append(spec.name)
        if self.fail:
            raise StratagemError(self.fail, where=spec.name, fix="-")
        return super().launch(spec, replicas, generation, env, log_dir, exclude, in_process)


def test_a_slow_start_holds_up_no_other_job(tmp_path):
    """One job's start blocks (issue 47: Ray-service jobs took minutes to start on a loaded
    machine): meanwhile the scheduler still starts and polls the other jobs, and the slow
    job shows as starting, its replicas counted as taken."""
    be = BlockingBackend(slow={"slow"})
    s = make(tmp_path, be, interval=0.05)
    s.store.add_job(spec("slow", high=1), now=0.0)
    s.store.add_job(spec("fast", high=1), now=1.0)
    try:
        s.step(now=10.0)
        assert be.blocked.wait(timeout=30.0), "the slow start never began"
        deadline = time.monotonic() + 30.0  # (a bound, not a timing: the thread may lag)
        while ("fast", 1) not in be.launches:
            assert time.monotonic() < deadline, "fast was not started"
            time.sleep(0.01)
        s.step(now=10.5)  # records fast's start
        assert s.store.job("slow").state == st.STARTING and s.starting() == ["slow"]
        assert "fast" in be.during_block and s.store.job("fast").state == st.RUNNING
        be.codes[group(s, "fast")] = [0]  # fast ends while slow is still starting
        assert s.step(now=11.0) == {"slow": 1}  # slow keeps the GPU it is started on
        assert s.store.job("fast").state == st.SUCCEEDED
        assert s.store.job("slow").state == st.STARTING and "slow.g0" not in be.codes
    finally:
        be.release.set()
    s.finish_starts(timeout=30.0)
    assert s.store.job("slow").state == st.RUNNING
    assert s.store.allocations()["slow"].group_name == "slow.g0"
    texts = [t for _, _, t in s.store.events("slow")]
    assert texts[-2:] == ["starting 1 replicas", "started with 1 replicas"], texts


def test_a_failed_start_backs_off_with_the_reason_and_is_retried(tmp_path):
    be = BlockingBackend(slow=set())
    be.fail = "Ray could not place 1 replicas: timed out"
    s = make(tmp_path, be, backoff=10.0, interval=60.0)  # each step waits for its start
    s.store.add_job(spec("a", high=1), now=0.0)
    s.step(now=1.0)
    job = s.store.job("a")
    assert job.state == st.BACKOFF and job.retry_at == 11.0 and job.failures == 0
    assert s.store.events("a")[-1][2] == ("start failed: Ray could not place 1 replicas: "
                                          "timed out; retry in 10 s")
    s.step(now=5.0)
    assert len(be.launches) == 0 and s.store.job("a").state == st.BACKOFF
    s.step(now=11.0)  # retried, fails again: twice the wait
    assert s.store.job("a").retry_at == 31.0
    be.fail = None
    s.step(now=31.0)
    assert s.store.job("a").state == st.RUNNING and be.launches == [("a", 1)]


def test_a_job_deleted_while_starting_is_stopped_once_started(tmp_path):
    be = BlockingBackend(slow={"a"})
    s = make(tmp_path, be, interval=0.05)
    s.store.add_job(spec("a", high=1), now=0.0)
    try:
        s.step(now=1.0)
        assert s.store.request_delete("a") == st.STARTING
        s.step(now=2.0)  # the deletion waits for the start
        assert s.store.job("a").state == st.STOPPING and be.stops == []
    finally:
        be.release.set()
    s.finish_starts(timeout=30.0)
    s.step(now=3.0)
    assert s.store.job("a").state == st.DELETED and be.stops == ["a.g0"]
    assert s.store.allocations() == {}


def test_a_start_that_lands_on_a_drained_node_is_moved(tmp_path):
    be = BlockingBackend(slow={"a"})
    s = make(tmp_path, be, interval=0.05)
    s.store.add_job(spec("a", high=1), now=0.0)
    try:
        s.step(now=1.0)
        assert be.blocked.wait(timeout=30.0)
        assert s.drain("n0") == []  # nothing runs there yet
    finally:
        be.release.set()
    s.finish_starts(timeout=30.0)
    assert s.store.job("a").state == st.PENDING and be.stops == ["a.g0"]
    assert "node drained" in s.store.events("a")[-1][2]


def test_a_start_left_unfinished_by_a_dead_scheduler_is_cleaned_up_and_redone(tmp_path):
    be = FakeBackend()
    s = make(tmp_path, be)
    s.store.add_job(spec("a"), now=0.0)
    s.store.update("a", "starting 2 replicas", state=st.STARTING)  # then the scheduler died
    s.step(now=1.0)
    assert be.stops == ["a.g0"]  # whatever that start had created, under its names
    assert s.store.job("a").state == st.RUNNING and be.launches == [("a", 2)]
    assert any("start interrupted" in t for _, _, t in s.store.events("a"))
