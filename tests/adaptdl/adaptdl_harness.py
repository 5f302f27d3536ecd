"""Launch cifar_style.py the ways AdaptDL jobs start, stop it mid-epoch, read its logs
(on the CPU; on the machine's GPU with ``gpu=True``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _jobs import job_free_env, torchrun_agent
from _spawn import free_port

SCRIPTS = Path(__file__).with_name("scripts")
SCRIPT = SCRIPTS / "cifar_style.py"


def base_env(ckpt: Path, gpu: bool = False) -> dict[str, str]:
    """The parent's environment without job variables (``_jobs.job_free_env``: on the CPU
    unless ``gpu``) and the job's AdaptDL checkpoint directory."""
    return {**job_free_env(gpu), "ADAPTDL_CHECKPOINT_PATH": str(ckpt)}


def standalone(nproc: int, ckpt: Path, args: list[str], log: Path, *, gpu: bool = False,
               nodes: int | None = None, extra: dict[str, str] | None = None
               ) -> list[subprocess.Popen]:
    """``nproc`` replicas rendezvousing through the ADAPTDL_* variables (AdaptDL standalone);
    ``nodes``: AdaptDL's ``ADAPTDL_NUM_NODES`` (the replicas spread over that many);
    ``extra``: more environment variables."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**base_env(ckpt, gpu), **(extra or {})}
        env.update(ADAPTDL_MASTER_ADDR="127.0.0.1", ADAPTDL_MASTER_PORT=str(port),
                   ADAPTDL_NUM_REPLICAS=str(nproc), ADAPTDL_REPLICA_RANK=str(rank))
        if nodes is not None:
            env["ADAPTDL_NUM_NODES"] = str(nodes)
        out = (log.parent / f"{log.name}.rank{rank}").open("w")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env,
                                      stdout=out, stderr=subprocess.STDOUT, cwd=SCRIPTS))
    return procs


def launcher(kind: str, nproc: int, ckpt: Path, args: list[str], log: Path, *,
             gpu: bool = False) -> list[subprocess.Popen]:
    """One ``stratagem run`` (kind "stratagem") or ``torchrun --standalone`` job."""
    if kind == "stratagem":
        cmd = [sys.executable, "-m", "stratagem", "run", "--nproc", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "--monitor-interval", "0.05"]
    out = log.open("w")
    return [subprocess.Popen([*cmd, str(SCRIPT), *args], env=base_env(ckpt, gpu), stdout=out,
                             stderr=subprocess.STDOUT, cwd=SCRIPTS)]


def torchrun_nodes(nnodes: int, ckpt: Path, args: list[str], log: Path, *,
                   gpu: bool = False) -> list[subprocess.Popen]:
    """``torchrun --nnodes N --nproc-per-node 1`` on this machine: N agents, each a node of
    one worker (c10d rendezvous, the first agent its host), no resource spec."""
    port = free_port()
    procs = []
    for node in range(nnodes):
        out = (log.parent / f"{log.name}.node{node}").open("w")
        procs.append(subprocess.Popen(
            [*torchrun_agent(nnodes, node, port, f"nodes-{port}"), str(SCRIPT), *args],
            env=base_env(ckpt, gpu), stdout=out, stderr=subprocess.STDOUT, cwd=SCRIPTS))
    return procs


def finish(procs: list[subprocess.Popen], out: Path, *, stop: int = 0,
           timeout: float = 80.0) -> list[int]:
    """Wait for the job; with ``stop`` replicas parked (files ready-<rank> holding their
    pids), SIGTERM them and every launched process, then release the replicas (file
    ``go``). Returns the exit codes."""
    deadline = time.monotonic() + timeout
    try:
        if stop:
            ready = [out / f"ready-{r}" for r in range(stop)]
            while not all(p.exists() and p.read_text() for p in ready):
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise AssertionError("the job did not reach its stop step")
                time.sleep(0.01)
            for f in ready:  # the workers first: signalled before they can see "go"
                os.kill(int(f.read_text()), signal.SIGTERM)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            (out / "go").touch()
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in [*out.glob("ready-*"), out / "go"]:
            f.unlink(missing_ok=True)


def logs(log: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(log.parent.glob(log.name + "*")))


def steps(out: Path) -> dict[int, list[dict]]:
    """step -> every replica's record of it."""
    found: dict[int, list[dict]] = {}
    for f in sorted(out.glob("ids-*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            found.setdefault(rec["step"], []).append(rec)
    return found


def stats(out: Path) -> list[dict]:
    path = out / "stats.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
