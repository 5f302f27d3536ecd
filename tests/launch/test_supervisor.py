"""The failure summary: which rank and node the launcher blames (no processes started)."""

from __future__ import annotations

from typing import Any

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


def _sig(rank: int, t: float, sig: str) -> dict[str, Any]:
    return {"kind": "signal", "signal": sig, "rank": str(rank), "time": t,
            "message": f"killed by {sig}", "traceback": ""}


def test_earliest_exception_across_nodes_wins() -> None:
    victim = _exc(0, 2.5, "RuntimeError: Connection closed by peer")
    culprit = _exc(3, 2.1, "ValueError: bad batch")
    sup, agents = _supervisor([victim, _sig(1, 2.0, "SIGTERM")], [culprit])
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


def test_no_records_names_the_agent_and_shows_its_output() -> None:
    sup, agents = _supervisor([], [], code=255)
    text = sup.failure_summary(agents[1])
    assert "first failure: node 1 (10.0.0.2): agent exited with code 255" in text
    assert "No route to host" in text
