"""Owner-side pacing of dense pushes (runtime/ps/pacing.py), with stand-in receives.

The multi-process path (owners pacing real gloo receives, training equal to one process)
runs in test_ps.py's paced configurations."""

from __future__ import annotations

import threading

import pytest

from stratagem import env
from stratagem.errors import StratagemError
from stratagem.runtime.ps.pacing import ReceivePacer, pace_order, paced_buckets
from stratagem.runtime.ps.plan import PSBucket

WAIT_S = 10.0


class FakeRecv:
    """A receive that completes (or fails) when the test says so."""

    def __init__(self, log: list[str], name: str) -> None:
        self.name = name
        self.arrived = threading.Event()
        self.error: BaseException | None = None
        log.append(f"post {name}")

    def wait(self) -> bool:
        assert self.arrived.wait(WAIT_S), f"{self.name} never completed"
        if self.error is not None:
            raise self.error
        return True


def _poster(log: list[str], made: dict[str, FakeRecv], name: str):  # noqa: ANN202
    def post() -> FakeRecv:
        made[name] = FakeRecv(log, name)
        return made[name]
    return post


def _until(cond, what: str) -> None:  # noqa: ANN001
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if cond():
            return
        done.wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_receives_are_posted_one_at_a_time_in_order() -> None:
    log: list[str] = []
    made: dict[str, FakeRecv] = {}
    pacer = ReceivePacer("test-pace")
    handles = [pacer.recv(_poster(log, made, n)) for n in ("a", "b", "c")]
    assert log == ["post a"]  # the first by the caller, at once; the others wait
    made["a"].arrived.set()
    _until(lambda: "b" in made, "b to be posted")
    assert handles[0].wait() and not handles[2].is_completed()
    assert log == ["post a", "post b"]
    made["b"].arrived.set()
    _until(lambda: "c" in made, "c to be posted")
    made["c"].arrived.set()
    assert all(h.wait() for h in handles)
    assert log == ["post a", "post b", "post c"]
    _until(lambda: pacer.idle, "the pacer to be idle")
    # idle again: the next receive is posted by its caller at once
    later = pacer.recv(_poster(log, made, "d"))
    assert log[-1] == "post d"
    made["d"].arrived.set()
    assert later.wait()
    pacer.stop()


def test_a_failed_receive_fails_the_queued_and_later_ones() -> None:
    log: list[str] = []
    made: dict[str, FakeRecv] = {}
    pacer = ReceivePacer("test-pace-fail")
    first, second = (pacer.recv(_poster(log, made, n)) for n in ("a", "b"))
    made["a"].error = RuntimeError("Connection closed by peer [10.0.0.2]:1234")
    made["a"].arrived.set()
    for h in (first, second):
        with pytest.raises(RuntimeError, match="Connection closed"):
            h.wait()
    assert log == ["post a"]  # b was never posted
    with pytest.raises(RuntimeError, match="Connection closed"):
        pacer.recv(_poster(log, made, "c")).wait()
    assert "c" not in made
    pacer.stop()


def test_a_receive_that_cannot_start_fails_its_handle() -> None:
    pacer = ReceivePacer("test-pace-start")

    def broken() -> FakeRecv:
        raise RuntimeError("group released")
    with pytest.raises(RuntimeError, match="group released"):
        pacer.recv(broken).wait()


def test_owners_pacing_together_take_different_senders_each_turn() -> None:
    workers = 4
    orders = {o: pace_order([s for s in range(workers) if s != o], o, workers)
              for o in range(workers)}
    assert orders[1] == [2, 3, 0]
    for turn in range(workers - 1):
        senders = [orders[o][turn] for o in range(workers)]
        assert sorted(senders) == list(range(workers))  # a permutation: one push per link
    # a dedicated server (rank >= workers) takes the workers from 0 up, shifted by it
    assert sorted(pace_order([0, 1, 2], 5, 3)) == [0, 1, 2]


def bucket(bid: int, owner: int, nbytes: int) -> PSBucket:
    """A float32 bucket of one piece whose pushed buffer is ``nbytes`` (presence included)."""
    return PSBucket(id=bid, owner=owner, dtype="float32", pieces=(bid,), numel=nbytes // 4 - 1)


@pytest.mark.parametrize(("nbytes", "workers", "owner", "threshold", "want"), [
    (2**20, 4, 0, 2**20, True), (2**20 - 4, 4, 0, 2**20, False),
    (2**30, 2, 0, 2**20, False),  # one sender: a worker owner of two workers
    (2**30, 2, 2, 2**20, True),  # two: a dedicated server's
    (2**30, 4, 0, 0, False), (8, 3, 0, 1, True)])
def test_which_pushes_are_paced(nbytes: int, workers: int, owner: int, threshold: int,
                                want: bool) -> None:
    b = bucket(0, owner, nbytes)
    assert b.nbytes == nbytes
    assert (paced_buckets([b], workers, threshold) == {0}) is want


def test_an_owner_that_pushes_a_large_bucket_itself_does_not_pace() -> None:
    mib = 2**20
    # each of two worker owners pushes its large bucket to the other: neither paces
    assert paced_buckets([bucket(0, 0, 2 * mib), bucket(1, 1, 2 * mib)], 4, mib) == set()
    # owner 0 pushes only a small one: it paces; owner 1's own bucket is small
    assert paced_buckets([bucket(0, 0, 2 * mib), bucket(1, 1, 4096)], 4, mib) == {0}
    # a dedicated server pushes nothing: it paces beside large worker-owned buckets
    assert paced_buckets([bucket(0, 0, 2 * mib), bucket(1, 4, 2 * mib)], 4, mib) == {1}


def test_pace_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.PS_PACE_BYTES, raising=False)
    assert env.ps_pace_bytes() == env.DEFAULT_PS_PACE_BYTES == 2**20
    monkeypatch.setenv(env.PS_PACE_BYTES, "0")
    assert env.ps_pace_bytes() == 0
    for bad in ("-5", "lots"):
        monkeypatch.setenv(env.PS_PACE_BYTES, bad)
        with pytest.raises(StratagemError, match=env.PS_PACE_BYTES) as info:
            env.ps_pace_bytes()
        assert info.value.fix
