"""``stratagem run --nnodes MIN:MAX``: option checks, the plan's node subset, the workers'
view of it, and the supervisor's shrink/grow decisions (fake agents and a scripted probe;
the virtual-cluster test in test_elastic_vcluster.py takes a real link down)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from _load import patience

from stratagem import env
from stratagem.errors import LaunchError, ResourceSpecError
from stratagem.launch import JobOptions, multinode, plan_job
from stratagem.launch.env import active_nodes
from stratagem.launch.job import AgentLaunch, LaunchPlan, RestartPolicy
from stratagem.launch.launcher import parse_nnodes
from stratagem.launch.probe import NodePool
from stratagem.launch.supervisor import Supervisor
from stratagem.resource import ResourceSpec

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
SPEC = "".join(f"  - address: {a}\n    workers: 1\n" + ("    chief: true\n" if a == A else "")
               for a in (A, B, C))


def test_nnodes_format_and_bounds() -> None:
    assert parse_nnodes("2:3", 3, "spec.yml") == (2, 3)
    assert parse_nnodes("2", 3, "spec.yml") == (2, 2)
    for bad, message in (("2-3", "is not MIN:MAX"), ("0:2", "1 <= MIN <= MAX"),
                         ("3:2", "1 <= MIN <= MAX"), ("1:4", "MAX is 4 but spec.yml lists 3")):
        with pytest.raises(LaunchError, match=message) as info:
            parse_nnodes(bad, 3, "spec.yml")
        assert info.value.fix


def test_subset_keeps_file_order_and_moves_the_chief() -> None:
    spec = ResourceSpec.from_yaml("nodes:\n" + SPEC)
    sub = spec.subset([C, B])
    assert [n.address for n in sub.nodes] == [B, C] and sub.chief.address == B
    assert spec.subset([A, C]).chief.address == A
    with pytest.raises(ResourceSpecError, match="no node with address '10.0.0.9'"):
        spec.subset([A, "10.0.0.9"])
    assert active_nodes({"STRATAGEM_NODES": f"{A},{C}"}) == [A, C]
    assert active_nodes({}) is None


def test_plan_on_a_node_subset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text("nodes:\n" + SPEC)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(multinode, "is_local_address", lambda a: a == A)
    monkeypatch.setattr(multinode, "free_port", lambda host: 41000)
    monkeypatch.setenv("STRATAGEM_REMOTE_SHELL", "ip netns exec {address}")
    monkeypatch.chdir(tmp_path)
    opts = JobOptions(script="train.py", resource_spec=str(spec), job_id="j", nnodes="1:3")
    plan = plan_job(opts, nodes=(B, C))  # the chief (A) is lost: B hosts the rendezvous
    assert plan.addresses == (B, C) and [i for i, _ in plan.unused] == [0]
    assert plan.endpoint.startswith(f"{B}:") and plan.agents[0].is_host
    assert f"STRATAGEM_NODES={B},{C}" in plan.agents[0].argv[-1]
    assert "--nnodes 2 " in plan.agents[1].argv[-1]
    assert "not used" in plan.describe()
    assert plan_job(opts).addresses == (A, B, C)  # no subset: every node, no STRATAGEM_NODES
    assert env.NODES not in plan_job(opts).agents[0].env
    with pytest.raises(LaunchError, match="MAX is 5"):
        plan_job(JobOptions(script="train.py", resource_spec=str(spec), nnodes="1:5"))
    with pytest.raises(LaunchError, match="needs a resource spec"):
        plan_job(JobOptions(script="train.py", nnodes="1:2"))


# A fake agent: prints its attempt and node; on attempt 0 node C fails and the others wait
# to be stopped; on fewer than 3 nodes it waits for the grow; on 3 nodes it finishes.
AGENT = """
import os, signal, sys, time
attempt, me = int(os.environ["STRATAGEM_RESTART_COUNT"]), sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
print(f"attempt {attempt} on {me} of {sys.argv[2]}", flush=True)
if attempt == 0 and me == sys.argv[3]:
    sys.exit(3)
if attempt == 0 or sys.argv[2].count(",") < 2:  # stopped by the failure, or until grown
    time.sleep(60)
"""


class ScriptedPool(NodePool):
    """A NodePool whose probe answers from ``self.up`` (and records what it was asked)."""

    def __init__(self, spec_path: str, min_nodes: int, c_up: bool = False) -> None:
        super().__init__(spec_path, None, min_nodes, 3)
        self.up = {A: True, B: True, C: c_up}
        self.asked: list[tuple[str, ...]] = []

    def reachable(self, addresses: Sequence[str]) -> dict[str, bool]:
        self.asked.append(tuple(addresses))
        answer = {a: self.up[a] for a in addresses}
        if len(self.asked) == 1:
            self.up[C] = True  # C comes back after the failure's probe
        return answer


class FlappingPool(ScriptedPool):
    """C is lost at the failure, then answers the grow probes as ``script`` says (and
    stays up once the script is used up)."""

    def __init__(self, spec_path: str, script: Sequence[bool]) -> None:
        super().__init__(spec_path, 2)
        self.script = list(script)

    def reachable(self, addresses: Sequence[str]) -> dict[str, bool]:
        self.asked.append(tuple(addresses))
        if len(self.asked) > 1 and self.script:
            self.up[C] = self.script.pop(0)
        return {a: self.up[a] for a in addresses}


def _plan(nodes: Sequence[str], attempt: int) -> LaunchPlan:
    agents = []
    for i, a in enumerate((A, B, C)):
        if a in nodes:
            argv = (sys.executable, "-c", AGENT, a, ",".join(nodes), C)
            environ = {**os.environ, env.RESTART_COUNT: str(attempt)}
            node = ResourceSpec.from_yaml("nodes:\n" + SPEC).node(a)
            agents.append(AgentLaunch(i, node, argv, environ, "local", i == 0))
    return LaunchPlan("job-e", f"{nodes[0]}:1", tuple(agents))


def _supervise(tmp: Path, min_nodes: int, c_up: bool = False, max_restarts: int = 0,
               flaps: Sequence[bool] | None = None) -> tuple[int, str, str, ScriptedPool]:
    spec = tmp / "spec.yml"
    spec.write_text("nodes:\n" + SPEC)
    pool = (ScriptedPool(str(spec), min_nodes, c_up) if flaps is None
            else FlappingPool(str(spec), flaps))
    out, err = io.StringIO(), io.StringIO()
    policy = RestartPolicy(max_restarts=max_restarts, backoff_s=0.01, min_nodes=min_nodes,
                           max_nodes=3, probe_interval_s=0.2)
    sup = Supervisor(_plan((A, B, C), 0), out=out, err=err, grace=2.0, policy=policy,
                     pool=pool, replan=lambda n, nodes=(A, B, C): _plan(nodes, n))
    return sup.run(), out.getvalue(), err.getvalue(), pool


def test_lost_node_shrinks_the_job_and_its_return_grows_it(tmp_path: Path) -> None:
    code, out, err, pool = _supervise(tmp_path, min_nodes=2)
    assert code == 0, err
    attempts = sorted(set(re.findall(r"attempt (\d) on \S+ of (\S+)", out)))
    assert attempts == [("0", f"{A},{B},{C}"), ("1", f"{A},{B}"), ("2", f"{A},{B},{C}")]
    assert pool.asked[0] == (A, B, C)  # the failure's probe: every node of the job
    assert (C,) in pool.asked[1:]  # then, below MAX, only the missing node
    assert f"shrink 1: node {C} lost (node 2 ({C}): agent exited with code 3); restarting " \
           f"on 2 of 3 nodes" in err
    assert f"grow 1: node {C} reachable; stopped the workers" in err
    assert re.search(r"job job-e finished: 3 workers, [\d.]+ s \(1 shrink, 1 grow\)", err)


def test_a_flapping_node_must_stay_reachable_before_the_job_grows_onto_it(
        tmp_path: Path) -> None:
    """Lost once, C must answer two probes a probe period apart: an answer followed by a
    miss does not count, so the job grows at the 4th probe after the shrink, not the 1st."""
    code, out, err, pool = _supervise(tmp_path, min_nodes=2, flaps=[True, False, True, True])
    assert code == 0, err
    grow_probes = pool.asked[1:]
    assert grow_probes == [(C,)] * 4, grow_probes  # no grow before the 4th probe
    assert err.count(f"node {C} answers again (lost 1 time); growing onto it once it has "
                     "stayed reachable for 0.2 s") == 1
    assert f"grow 1: node {C} reachable" in err and "(1 shrink, 1 grow)" in err
    assert f"attempt 2 on {C} of {A},{B},{C}" in out


def test_node_pool_damping_doubles_with_each_loss(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yml"
    spec.write_text("nodes:\n" + SPEC)
    pool = NodePool(str(spec), None, 1, 3)
    assert pool.settled({C: True}, 0.0, 1.0, 5.0) == ([C], {})  # never lost: at once
    pool.mark_lost([C])
    assert pool.settled({C: True}, 10.0, 1.0, 5.0) == ([], {C: 1.0})
    assert pool.settled({C: True}, 11.0, 1.0, 5.0) == ([C], {})
    pool.mark_lost([C])  # lost again: two periods
    assert pool.settled({C: True}, 20.0, 1.0, 5.0) == ([], {C: 2.0})
    assert pool.settled({C: False}, 21.0, 1.0, 5.0) == ([], {})  # a miss starts over
    assert pool.settled({C: True}, 22.0, 1.0, 5.0) == ([], {C: 2.0})
    assert pool.settled({C: True}, 24.0, 1.0, 5.0) == ([C], {})
    for _ in range(5):
        pool.mark_lost([C])
    assert pool.settle_s(C, 1.0, 5.0) == 5.0  # capped


def test_failure_on_nodes_that_all_answer_is_an_ordinary_restart(tmp_path: Path) -> None:
    """C's agent fails but C answers the probe (a SIGKILLed worker on a healthy node): the
    job restarts on every node, using the restart budget."""
    code, out, err, pool = _supervise(tmp_path, min_nodes=2, c_up=True, max_restarts=1)
    assert pool.asked[0] == (A, B, C)
    assert "shrink 1" not in err and "grow 1" not in err
    assert f"failure 1: node 2 ({C}): agent exited with code 3; restarting" in err
    assert f"attempt 1 on {C} of {A},{B},{C}" in out
    assert code == 0 and "(1 restart, 0 shrinks, 0 grows)" in err


def test_fewer_than_min_nodes_left_fails_naming_the_node(tmp_path: Path) -> None:
    code, _, err, _ = _supervise(tmp_path, min_nodes=3)
    assert code == 1
    assert (f"stopped: node {C} lost (node 2 ({C}): agent exited with code 3); 2 nodes "
            "left, --nnodes needs at least 3. Fix: bring 10.0.0.3 back") in err
    assert "shrink" not in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_adaptive_job_restarted_on_fewer_workers_follows_the_new_size(tmp_path: Path) -> None:
    """What a shrink does to an adaptive job: stopped (SIGTERM: it saves) on 2 workers and
    started again on 1 from the checkpoint, it re-decides its batch configuration for one
    replica (the per-replica limit of 4 makes the base batch of 8 two accumulated
    micro-batches there, one micro-batch per replica on two) and trains every sample of every
    epoch exactly once over the two runs."""
    import signal
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import chaos
    finally:
        sys.path.pop(0)
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"

    def run(nproc: int) -> subprocess.Popen[str]:
        return chaos.launch(logs, ckpt, f"ad-{nproc}-{os.getpid()}", nproc=nproc,
                            checkpoint_steps=3, step_sleep=0.02, max_restarts=0,
                            backoff=0.2, job_args=("--adaptive", "--epochs", "2"))

    first = run(2)
    deadline = time.monotonic() + patience(120)
    while sum(r["rank"] == 0 for r in chaos.read_steps(logs)) < 6:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)  # the launcher stops the workers: they save and exit
    first.communicate(timeout=patience(60))
    ended = time.time()
    second = run(1)
    out, _ = second.communicate(timeout=patience(180))
    assert second.returncode == 0, out[-3000:]
    steps = [{**r, "attempt": int(r["time"] > ended)} for r in chaos.read_steps(logs)]
    before = [r for r in steps if r["attempt"] == 0]
    after = [r for r in steps if r["attempt"] == 1]
    assert before and after
    assert {r["world"] for r in before} == {2} and {r["world"] for r in after} == {1}
    for r in steps:  # the micro-batch limit holds at each size
        assert len(r["ids"]) <= chaos.chaos_job.ADAPTIVE_LOCAL
        assert r["batch"] <= r["world"] * chaos.chaos_job.ADAPTIVE_LOCAL * (r["accum"] + 1)
    # the base batch: one micro-batch per replica on two, two accumulated on one
    assert {r["accum"] for r in before if r["batch"] == 8} <= {0}
    assert {r["accum"] for r in after if r["batch"] == 8} <= {1}
    assert any(r["batch"] == 8 for r in after)
    counts = chaos.per_epoch_counts(steps)
    assert sorted(counts) == [0, 1]
    for epoch, seen in counts.items():
        assert seen == {i: 1 for i in range(chaos.chaos_job.N)}, epoch
