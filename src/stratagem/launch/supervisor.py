"""Run a LaunchPlan: start every agent in its own session, stream its output with a
``[node i]`` prefix, and stop the whole job at the first failure or on SIGINT/SIGTERM.

With a :class:`RestartPolicy` allowing restarts (``stratagem run --max-restarts N``), a
failed job is stopped everywhere and started again -- every agent, from a fresh plan -- after
an exponential backoff; the workers resume from the newest good checkpoint. Each failure and
each restart gets one line; the final summary counts the restarts. When the restarts are used
up, the job fails with the *first* failure's cause (later ones are often its echoes).

With ``--nnodes MIN:MAX`` (a :class:`~stratagem.launch.probe.NodePool`), every failure is
followed by a probe of the job's nodes: when some cannot be reached, the job *shrinks* --
it restarts from the checkpoint on the survivors if at least MIN remain (else it fails,
naming the lost nodes). A failure on nodes that all answer is an ordinary restart. While the
job runs on fewer than MAX nodes, the missing ones (and nodes newly added to the spec file)
are probed every ``probe_interval_s``; when one answers, the job *grows*: the workers are
stopped with SIGTERM (they save and exit), and the job restarts on the larger set. Shrinks
and grows do not count against ``--max-restarts`` (a lost node is not the job failing the
same way again; MIN bounds how far it shrinks); each gets one line, and the final summary
counts them.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stratagem.errors import LaunchError
from stratagem.launch import grace as stop_grace
from stratagem.launch.agent import FAILURE_MARKER
from stratagem.launch.env import ENV_JOB_ID
from stratagem.launch.job import AgentLaunch, LaunchPlan, RestartPolicy
from stratagem.launch.probe import NodePool

CKPT_NAME = re.compile(r"ckpt-(\d+)")
STOP_CODE = 143  # a worker that saved and exited on SIGTERM (stratagem.elastic.EXIT_CODE)
GRACE_S = 6.0  # after SIGTERM, before SIGKILL, when the job is not being stopped
TAIL_LINES = 25
POLL_S = 0.05


@dataclass(frozen=True)
class Failure:
    """One failure of the job, as reported: a one-line cause and the full summary."""

    line: str  # "rank 1 on node 0 (127.0.0.1): killed by SIGKILL"
    summary: str  # failure_summary(): the cause with its traceback
    signature: str  # what "failing the same way" compares
    at: float  # time.monotonic() when the supervisor saw it
    stop_request: bool = False  # the workers saved and exited on SIGTERM: never restarted


def newest_checkpoint(root: str | None) -> str | None:
    """The name of the newest complete ``ckpt-N`` directory under ``root`` (None when there
    is none or the launcher cannot see the directory)."""
    if not root:
        return None
    try:
        names = [p.name for p in Path(root).iterdir() if CKPT_NAME.fullmatch(p.name)]
    except OSError:
        return None
    return max(names, key=lambda n: int(n[5:])) if names else None


@dataclass
class _Agent:
    launch: AgentLaunch
    proc: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    failures: list[dict[str, Any]] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)
    code: int | None = None
    quiet: bool = False  # stopped by us: its shutdown chatter is kept, not shown
    hidden: int = 0

    @property
    def label(self) -> str:
        return f"node {self.launch.index} ({self.launch.node.address})"


def job_processes(job_id: str, exclude: int | None = None) -> list[int]:
    """Pids on this machine whose environment has ``STRATAGEM_JOB_ID=<job_id>``."""
    needle = f"{ENV_JOB_ID}={job_id}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) in (os.getpid(), exclude):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fp:
                if needle in fp.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


class Supervisor:
    """Starts the plan's agents and watches them until the job ends; :meth:`run` returns
    the launcher's exit code (0 ok, 1 failed, 128+N stopped by signal N)."""

    def __init__(self, plan: LaunchPlan, out: IO[str] | None = None,
                 err: IO[str] | None = None, grace: float | None = None,
                 policy: RestartPolicy | None = None,
                 replan: Callable[..., LaunchPlan] | None = None,
                 pool: NodePool | None = None) -> None:
        self.plan = plan
        self.policy = policy or RestartPolicy()
        # (attempt number[, node addresses]) -> the plan to start (default: the same)
        self.replan = replan
        self.pool = pool  # --nnodes MIN:MAX: the nodes the job may shrink to and grow on
        self.failures: list[Failure] = []
        self.restarts = 0
        self.shrinks = 0
        self.grows = 0
        self._grow_to: tuple[str, ...] | None = None  # set by the probe thread
        self._probing: threading.Thread | None = None
        self._lost_error: str | None = None  # fewer than MIN nodes left
        self._failure_probe: dict[tuple[str, ...], dict[str, bool]] = {}
        self._failure_probe_thread: threading.Thread | None = None
        self._told_waiting: set[tuple[str, int]] = set()  # (node, losses) announced
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.grace = grace  # None: GRACE_S, or for a stop the stop grace (launch.grace)
        self.stop_report: str | None = None  # what a stop saved (the final message)
        self.agents: list[_Agent] = []
        self._lock = threading.Lock()
        self._signal: int | None = None
        self._hurry = False
        # Authenticates the agents' failure records (see stratagem.launch.agent): sent on
        # each agent's stdin, never in an environment, argv or file a worker could read.
        self._key = secrets.token_hex(16)

    # -- output -----------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            for line in text.splitlines():
                self.err.write(f"stratagem: {line}\n")
            self.err.flush()

    def _pump(self, agent: _Agent, stream: IO[bytes], sink: IO[str], is_err: bool) -> None:
        prefix = f"[node {agent.launch.index}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if is_err and line.startswith(FAILURE_MARKER):
                record = self._record(line[len(FAILURE_MARKER):])
                if record is not None:
                    agent.failures.append(record)
                    continue  # else: a worker's look-alike line, shown as output
            agent.tail.append(line)
            if agent.quiet:
                agent.hidden += 1
                continue
            with self._lock, contextlib.suppress(OSError, ValueError):
                sink.write(prefix + line + "\n")
                sink.flush()
        stream.close()

    def _record(self, text: str) -> dict[str, Any] | None:
        """The failure record in ``KEY JSON``, or None unless KEY is this job's key."""
        key, _, payload = text.partition(" ")
        if not hmac.compare_digest(key.encode(), self._key.encode()):
            return None
        try:
            record = json.loads(payload)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    # -- lifecycle --------------------------------------------------------------------
    def _start(self, launch: AgentLaunch) -> None:
        try:
            proc = subprocess.Popen(launch.argv, env=dict(launch.env), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start the agent of node {launch.index} "
                              f"({launch.node.address}): {exc}",
                              fix="check the remote shell command: "
                                  f"{launch.command_line()[:200]}") from None
        agent = _Agent(launch, proc)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with contextlib.suppress(OSError):  # the agent's first stdin line: the record key
            proc.stdin.write(f"{self._key}\n".encode())
            proc.stdin.flush()
        for stream, sink, is_err in ((proc.stdout, self.out, False),
                                     (proc.stderr, self.err, True)):
            t = threading.Thread(target=self._pump, args=(agent, stream, sink, is_err),
                                 daemon=True)
            t.start()
            agent.pumps.append(t)
        self.agents.append(agent)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is None:
            self._signal = signum
        else:
            self._hurry = True

    def _run_once(self) -> _Agent | None:
        """Start the plan's agents and watch them until all finished (None), one failed
        (it is returned) or a signal arrived; every agent is stopped on the way out."""
        self.agents = []
        self._grow_to = None
        first_failure: _Agent | None = None
        next_probe = time.monotonic() + self.policy.probe_interval_s
        try:
            for launch in self.plan.agents:
                if self._signal is None:
                    self._start(launch)
            while self._signal is None:
                if self._grow_to is not None:
                    break
                if self._can_grow() and time.monotonic() >= next_probe and (
                        self._probing is None or not self._probing.is_alive()):
                    now = time.monotonic()
                    next_probe = now + self.policy.probe_interval_s
                    self._probing = threading.Thread(target=self._look_for_nodes,
                                                     args=(self.plan.addresses, now),
                                                     daemon=True)
                    self._probing.start()
                running = False
                for agent in self.agents:
                    if agent.code is None:
                        agent.code = agent.proc.poll()
                        running |= agent.code is None
                        if agent.code not in (None, 0) and first_failure is None:
                            first_failure = agent
                if first_failure is not None and self.pool is not None:
                    self._start_failure_probe()  # runs while the agents are stopped
                if first_failure is not None or not running:
                    break
                time.sleep(POLL_S)
        finally:
            self.stop_all()
        hidden = sum(a.hidden for a in self.agents)
        if hidden:
            self.say(f"({hidden} lines of shutdown output from stopped agents not shown)")
        return first_failure

    def _can_grow(self) -> bool:
        pool = self.pool
        return pool is not None and len(self.plan.agents) < pool.max_nodes

    def _look_for_nodes(self, running: tuple[str, ...], now: float) -> None:
        """(Probe thread, started at ``now``, at least one probe period after the previous
        one) When a node the job does not run on answers, and a node it lost has answered
        long enough, ask to grow."""
        assert self.pool is not None
        missing = [n.address for n in self.pool.listed().nodes if n.address not in running]
        state = self.pool.reachable(missing)
        damping = (self.policy.probe_interval_s, self.policy.max_backoff_s)
        back, waiting = self.pool.settled({a: bool(state.get(a)) for a in missing}, now,
                                          *damping)
        for a in waiting:
            losses = self.pool.losses.get(a, 0)
            if (a, losses) not in self._told_waiting:  # once per node and loss
                self._told_waiting.add((a, losses))
                self.say(f"node {a} answers again (lost {losses} time"
                         f"{'s' * (losses != 1)}); growing onto it once it has stayed "
                         f"reachable for {self.pool.settle_s(a, *damping):.3g} s")
        if back and self.plan.addresses == running:
            self._grow_to = self.pool.choose(running, back)

    def _start_failure_probe(self) -> None:
        """Probe the job's nodes in the background, at once after a failure (a lost node's
        probe timeout then overlaps the agents' grace period)."""
        assert self.pool is not None
        pool, addresses, box = self.pool, self.plan.addresses, self._failure_probe

        def probe() -> None:
            box[addresses] = pool.reachable(addresses)

        box.clear()
        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        self._failure_probe_thread = thread

    def _probed_lost(self) -> set[str]:
        """The nodes the failure's probe, once finished, found unreachable (else none)."""
        thread = self._failure_probe_thread
        if thread is None or thread.is_alive():
            return set()
        state = self._failure_probe.get(self.plan.addresses, {})
        return {a for a, up in state.items() if not up}

    def _lost_nodes(self) -> list[str]:
        """The job's nodes that do not answer the failure's probe (none without a pool)."""
        if self.pool is None:
            return []
        thread = self._failure_probe_thread
        if thread is not None:
            thread.join()
            self._failure_probe_thread = None
        state = self._failure_probe.pop(self.plan.addresses, None)
        if state is None:
            state = self.pool.reachable(self.plan.addresses)
        return [a for a in self.plan.addresses if not state.get(a, True)]

    def _attempt(self) -> int:
        """How many times the job was started before (the workers' restart count)."""
        return self.restarts + self.shrinks + self.grows

    def _wait(self, seconds: float) -> None:
        """Sleep, but return at once when a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while self._signal is None and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def run(self) -> int:
        started = time.monotonic()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        policy = self.policy
        delay = policy.backoff_s
        failed: _Agent | None = None
        try:
            while True:
                mark = newest_checkpoint(policy.checkpoint_dir)
                failed = self._run_once()
                if self._signal is not None:
                    break
                if failed is None and self._grow_to is not None:
                    self._grow(self._grow_to)
                    continue
                if failed is None:
                    break
                self.failures.append(self.describe_failure(failed))
                if self.failures[-1].stop_request:
                    break
                lost = self._lost_nodes()
                if lost:
                    if not self._shrink(lost):
                        break
                    continue
                if self.restarts >= policy.max_restarts:
                    break
                resume = newest_checkpoint(policy.checkpoint_dir)
                if self.restarts and (resume is None or resume == mark):
                    delay = min(delay * 2, policy.max_backoff_s)  # no progress since
                else:
                    delay = policy.backoff_s
                self.restarts += 1
                source = f"from {resume}" if resume else (
                    "from the newest checkpoint" if policy.checkpoint_dir
                    else "from the start (no checkpoint directory)")
                self.say(f"failure {len(self.failures)}: {self.failures[-1].line}; "
                         f"restarting in {delay:.3g} s {source} "
                         f"(restart {self.restarts} of {policy.max_restarts})")
                self._wait(delay)
                if self._signal is not None:
                    break
                if self.replan is not None:
                    self.plan = (self.replan(self._attempt()) if self.pool is None
                                 else self.replan(self._attempt(), self.plan.addresses))
                self.say(f"restart {self.restarts}: starting job {self.plan.job_id} again "
                         f"({self.plan.num_workers} workers)")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        counts = [f"{self.restarts} restart{'s' * (self.restarts != 1)}"] \
            if policy.max_restarts else []
        if self.pool is not None:
            counts += [f"{self.shrinks} shrink{'s' * (self.shrinks != 1)}",
                       f"{self.grows} grow{'s' * (self.grows != 1)}"]
        again = f" ({', '.join(counts)})" if counts else ""
        if self._signal is not None:
            name = signal.Signals(self._signal).name
            self.say(f"job {self.plan.job_id}: {name} received; stopped every worker "
                     f"on {len(self.agents)} node{'s' * (len(self.agents) != 1)}{again}")
            if self.stop_report:
                self.say(self.stop_report)
            return 128 + self._signal
        if self._lost_error is not None:
            self.say(self.failures[-1].summary)
            self.say(self._lost_error)
            return 1
        if failed is not None:
            first = self.failures[0]
            self.say(first.summary)
            if self.restarts:
                same = len({f.signature for f in self.failures}) == 1
                self.say(f"job {self.plan.job_id} gave up after {self.restarts} restart"
                         f"{'s' * (self.restarts != 1)}: it failed {len(self.failures)} times"
                         + (", the same way each time" if same
                            else f"; the first cause is shown above, the last was: "
                                 f"{self.failures[-1].line}"))
            return 1
        self.say(f"job {self.plan.job_id} finished: {self.plan.num_workers} workers, "
                 f"{time.monotonic() - started:.1f} s{again}")
        return 0

    def _shrink(self, lost: list[str]) -> bool:
        """Restart on the nodes that still answer (after the backoff); False when fewer than
        MIN remain (the reason is kept for the summary) or a signal arrived."""
        assert self.pool is not None and self.replan is not None
        left = [a for a in self.plan.addresses if a not in lost]
        names = ", ".join(lost)
        if len(left) < self.pool.min_nodes:
            self._lost_error = (
                f"job {self.plan.job_id} stopped: node{'s' * (len(lost) != 1)} {names} "
                f"lost ({self.failures[-1].line}); {len(left)} node"
                f"{'s' * (len(left) != 1)} left, --nnodes needs at least "
                f"{self.pool.min_nodes}. Fix: bring {names} back, or restart with a lower "
                f"MIN; the job resumes from its newest checkpoint")
            return False
        self.shrinks += 1
        self.pool.mark_lost(lost)
        resume = newest_checkpoint(self.policy.checkpoint_dir) or "the start"
        self.say(f"shrink {self.shrinks}: node{'s' * (len(lost) != 1)} {names} lost "
                 f"({self.failures[-1].line}); restarting on {len(left)} of "
                 f"{self.pool.max_nodes} nodes from {resume} in "
                 f"{self.policy.backoff_s:.3g} s")
        self._wait(self.policy.backoff_s)
        if self._signal is not None:
            return False
        self.plan = self.replan(self._attempt(), tuple(left))
        return True

    def _grow(self, nodes: tuple[str, ...]) -> None:
        """The job was stopped (the workers saved on SIGTERM): start it on ``nodes``."""
        assert self.replan is not None
        back = [a for a in nodes if a not in self.plan.addresses]
        self.grows += 1
        before = len(self.plan.agents)
        self.plan = self.replan(self._attempt(), nodes)
        self.say(f"grow {self.grows}: node{'s' * (len(back) != 1)} {', '.join(back)} "
                 f"reachable; stopped the workers at a checkpoint and restarting on "
                 f"{len(nodes)} nodes (was {before})")

    def stop_all(self) -> None:
        """SIGTERM every running agent's process group, SIGKILL after the grace; then sweep
        this machine for processes still carrying the job id. On a stop signal the grace is
        the stop grace (:mod:`stratagem.launch.grace`: the workers finish the save in flight
        and save the job state) and :attr:`stop_report` says what was saved where."""
        live = [a for a in self.agents if a.proc.poll() is None]
        root = self.policy.checkpoint_dir
        before = stop_grace.newest_checkpoint(root)
        stopping = self._signal is not None
        saving = stopping or self._grow_to is not None  # the workers save before they exit
        allowed = stop_grace.stop_grace_s(root, self.policy.stop_grace_s) if saving else GRACE_S
        wait = self.grace if self.grace is not None else (
            allowed + stop_grace.AGENT_MARGIN_S if saving else GRACE_S)
        started = time.monotonic()
        killed = False
        for agent in live:
            agent.quiet = True
            with contextlib.suppress(OSError):
                assert agent.proc.stdin is not None
                agent.proc.stdin.close()  # remote agents stop on end-of-file
            self._killpg(agent, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while any(a.proc.poll() is None for a in live):
            if self._hurry or time.monotonic() > deadline:
                for agent in live:
                    self._killpg(agent, signal.SIGKILL)
                killed = True
                break
            for agent in live:  # a lost node's agent cannot stop its workers: no grace
                if agent.launch.node.address in self._probed_lost():
                    self._killpg(agent, signal.SIGKILL)
            time.sleep(POLL_S)
        for agent in self.agents:
            with contextlib.suppress(OSError, ValueError):
                if agent.proc.stdin:
                    agent.proc.stdin.close()
            agent.code = agent.proc.wait() if agent.code is None else agent.code
            self._killpg(agent, signal.SIGKILL)  # anything left in the agent's session
        for pid in job_processes(self.plan.job_id):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            for t in agent.pumps:
                t.join(timeout=1.0)
        removed = stop_grace.remove_unfinished(root)  # writes the stop cut short
        if stopping:  # killed by us, or by the agents when their grace ran out
            killed = killed or time.monotonic() - started >= allowed
            self.stop_report = self._describe_stop(root, before, allowed, killed, removed)

    def _describe_stop(self, root: str | None, before: Path | None, wait: float,
                       killed: bool, removed: list[str]) -> str:
        """One line for the final message: whether the stop saved the job state, and where."""
        after = stop_grace.newest_checkpoint(root)
        cut = (f"; the workers did not finish within the stop grace of {wait:.3g} s and were "
               "killed (raise it with --stop-grace or STRATAGEM_STOP_GRACE_S)") if killed \
            else ""
        dropped = f"; removed the unfinished {', '.join(removed)}" if removed else ""
        if root is None:
            return ("no checkpoint directory: the job state was not saved (pass "
                    "--checkpoint-dir to save it on a stop)")
        if after is not None and after != before and not killed:
            return f"the job state was saved to {after}{dropped}"
        if after is not None and after != before:
            return (f"the newest checkpoint is {after}, written during the stop (it may hold "
                    f"the state of a periodic save, not of the stop){cut}{dropped}")
        last = f"the newest checkpoint is still {after}" if after else "there is no checkpoint"
        return (f"no new checkpoint was saved in {root} during the stop ({last}){cut}"
                f"{dropped}")

    @staticmethod
    def _killpg(agent: _Agent, sig: int) -> None:
        with contextlib.suppress(OSError):
            os.killpg(agent.proc.pid, sig)

    # -- reporting --------------------------------------------------------------------
    def _lead(self) -> tuple[dict[str, Any], _Agent] | None:
        """The failure record that names the cause (see :meth:`failure_summary`)."""
        # Workers of the agents we stopped that saved and exited on our SIGTERM (exit 143)
        # are neither the cause nor a stop request (e.g. after another node's agent died).
        records = [(r, a) for a in self.agents for r in a.failures
                   if not (a.quiet and str(r.get("message")) == f"SystemExit: {STOP_CODE}")]

        def pick(ok: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], _Agent] | None:
            found = [(r, a) for r, a in records if ok(r)]
            return min(found, key=lambda ra: ra[0].get("time") or 0) if found else None

        return (pick(lambda r: r.get("kind") == "signal")
                or pick(lambda r: r.get("kind", "exception") == "exception")
                or pick(lambda r: r.get("kind") == "exit"))

    def describe_failure(self, first: _Agent) -> Failure:
        """The failure of the attempt just stopped, as one line plus the full summary."""
        lead = self._lead()
        if lead is None:
            cause = f"agent exited with {_describe_code(first.code)}"
            line, signature = f"{first.label}: {cause}", f"agent {cause}"
        else:
            record, agent = lead
            rank = record.get("rank")
            who = f"rank {rank}" if rank is not None else "a worker"
            message = str(record.get("message"))
            line = f"{who} on {agent.label}: {message}"
            signature = f"{record.get('kind')}: {message.splitlines()[0] if message else ''}"
        # SIGTERM sent to the workers themselves (a scheduler, a node drain): they saved the
        # job state and exited 143 (stratagem.elastic.EXIT_CODE) -- a stop, not a crash.
        stop = lead is not None and str(lead[0].get("message")) == f"SystemExit: {STOP_CODE}"
        return Failure(line=line, summary=self.failure_summary(first), signature=signature,
                       at=time.monotonic(), stop_request=stop)

    def failure_summary(self, first: _Agent) -> str:
        """Name the failing rank and node and show its error.

        The culprit is, in order: the earliest worker killed by a signal that its torchrun
        did not send (``kill -9``, the OOM killer, SIGSEGV: its peers' connection errors
        are consequences); else the earliest Python exception across all nodes (the ranks
        that only lost their peer fail later); else a worker that exited non-zero; else the
        first agent to fail. Workers that torchrun stopped (``kind: stopped``) are never it.
        """
        others = " and stopped the other nodes" if len(self.agents) > 1 else ""
        lines = [f"job {self.plan.job_id} failed{others}"]
        lead = self._lead()
        if lead is None:
            lines.append(f"first failure: {first.label}: agent exited with "
                         f"{_describe_code(first.code)}; its last output:")
            lines += ["  " + line for line in first.tail]
            return "\n".join(lines)
        record, agent = lead
        rank = record.get("rank")
        who = f"rank {rank}" if rank is not None else "a worker"
        lines.append(f"first failure: {who} on {agent.label}: {record.get('message')}")
        tb = (record.get("traceback") or "").rstrip().splitlines()[-TAIL_LINES:]
        lines += ["  " + line for line in tb]
        if not tb:
            lines.append(f"  (no Python traceback; see the [node {agent.launch.index}] "
                         "output above)")
        return "\n".join(lines)


def _describe_code(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    if code == 255:
        return "code 255 (the remote shell could not reach the node?)"
    return f"code {code}"
