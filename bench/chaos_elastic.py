"""Chaos on the virtual cluster: an *adaptive* job under ``stratagem run --nnodes 1:2``
receives SIGKILLs of random workers and of a node agent, and loses a node (its link taken
down, then brought back).

    python bench/chaos_elastic.py [--kills 10] [--agent-kills 1] [--node-losses 1] [--seed 0]
                                  [--out bench/results/chaos_elastic.json]

Needs root (tools/vcluster.py: 2 network namespaces, subnet 10.93.0.0/24, prefix sgce).
The job is ``bench/chaos_job.py --adaptive`` (base batch 8, up to 32, at most 4 samples per
replica and micro-batch; 8 epochs of 96 samples) with one worker per node. A worker or
agent kill is followed by an ordinary restart on both nodes; a node loss by a *shrink* to
the survivor and, once the link is back, a *grow* to two nodes. Measured per event: the
time from the kill (or link down) to the first training step of the next attempt, and the
steps trained again; for node losses also link up -> training on two nodes. Checked: the
job completes; every sample of every epoch is trained exactly once along the checkpoints'
lineage (``chaos.per_epoch_counts``). The final parameters are not compared with an
undisturbed run: the adaptive batch size (and with it the learning-rate scaling and the
accumulation) depends on the world sizes the job ran at and on measured step times, so
they legitimately differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOOL = HERE.parent / "tools" / "vcluster.py"
sys.path[:0] = [str(HERE), str(TOOL.parent)]

import chaos  # noqa: E402 - helpers next to this file
from vcluster import VirtualCluster  # noqa: E402

PREFIX, SUBNET = "sgce", "10.93.0.0/24"


def _wait(predicate: Any, proc: subprocess.Popen[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _trains(logs: Path, attempt: int) -> bool:
    return any(r["attempt"] == attempt for r in chaos.read_steps(logs))


def run(work: Path, *, kills: int, agent_kills: int, node_losses: int, seed: int,
        checkpoint_steps: int, step_sleep: float, backoff: float, max_delay: float,
        peer_timeout: float, timeout: float, epochs: int) -> dict[str, Any]:
    rng = random.Random(seed)
    targets = ["worker"] * kills + ["agent"] * agent_kills + ["node"] * node_losses
    rng.shuffle(targets)
    logs, ckpt = work / "logs", work / "ckpt"
    logs.mkdir(parents=True)
    job_id = f"chaos-el-{seed}-{os.getpid()}"
    events: list[dict[str, Any]] = []
    output: list[tuple[float, str]] = []
    with VirtualCluster(2, prefix=PREFIX, subnet=SUBNET, delay=None) as vc:
        spec = vc.write_resource_spec(work / "spec.yml")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "STRATAGEM_PEER_TIMEOUT_S": f"{peer_timeout:g}",
               "STRATAGEM_REMOTE_SHELL":
                   f"{sys.executable} {TOOL} exec --prefix {vc.prefix} {{address}} --"}
        for var in ("STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", "RANK",
                    "WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
            env.pop(var, None)
        proc = vc.run(0, [sys.executable, "-m", "stratagem", "run", "--resource-spec",
                          str(spec), "--nnodes", "1:2", "--node-probe-seconds", "1",
                          "--job-id", job_id, "--checkpoint-dir", str(ckpt),
                          "--checkpoint-steps", str(checkpoint_steps),
                          "--max-restarts", str(kills + agent_kills + 1),
                          "--restart-backoff", str(backoff), "--run-dir", str(work / "run"),
                          str(chaos.JOB), "--out", str(logs), "--step-sleep",
                          str(step_sleep), "--adaptive", "--epochs", str(epochs)],
                      env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)

        def pump() -> None:
            for line in proc.stdout or ():
                output.append((time.time(), line))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        started = time.monotonic()
        attempt = 0
        link = vc.host_ifname(1)
        try:
            for target in targets:
                if not _wait(lambda a=attempt: _trains(logs, a), proc, timeout):
                    break
                time.sleep(rng.uniform(0.0, max_delay))
                event: dict[str, Any] = {"target": target, "attempt": attempt}
                if target == "node":
                    subprocess.run(["ip", "link", "set", link, "down"], check=True)
                    event["time"] = time.time()
                    ok = _wait(lambda a=attempt: _trains(logs, a + 1), proc, timeout)
                    subprocess.run(["ip", "link", "set", link, "up"], check=True)
                    event["up_time"] = time.time()
                    events.append(event)
                    if not ok:
                        break
                    attempt += 2  # the shrink, then the grow
                    continue
                if target == "worker":
                    mine = [r for r in chaos.read_steps(logs) if r["attempt"] == attempt]
                    rank = rng.choice(sorted({r["rank"] for r in mine}))
                    pid = [r for r in mine if r["rank"] == rank][-1]["pid"]
                    event["rank"] = rank
                else:
                    pids = chaos.agent_pids(job_id)
                    if not pids:
                        break
                    pid = rng.choice(sorted(pids))
                event.update(pid=pid, time=time.time())
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                events.append(event)
                attempt += 1
                print(f"chaos: event {len(events)}: {target} (attempt {event['attempt']})",
                      file=sys.stderr, flush=True)
            proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            pass
        finally:
            subprocess.run(["ip", "link", "set", link, "up"], check=False)
            timed_out = proc.poll() is None
            if timed_out:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            reader.join(timeout=5)
        wall = time.monotonic() - started
    return {"returncode": None if timed_out else proc.returncode, "events": events,
            "output": "".join(line for _, line in output), "steps": chaos.read_steps(logs),
            "wall_s": wall}


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    steps = raw["steps"]
    per_event = []
    for e in raw["events"]:
        a = e["attempt"]
        before = [r for r in steps if r["attempt"] == a and r["time"] <= e["time"]]
        after = [r for r in steps if r["attempt"] == a + 1]
        if not before or not after:
            per_event.append({**e, "resumed": False})
            continue
        resumed_at = min(r["step"] for r in after)
        row = {"target": e["target"], "resumed": True,
               "time_to_resume_s": min(r["time"] for r in after) - e["time"],
               # >= 0: a killed agent's workers may train (and checkpoint) on until the
               # launcher stops them, so the next attempt can resume past the kill's step
               "steps_lost": max(0, max(r["step"] for r in before) - resumed_at + 1),
               "world_after": max(r["world"] for r in after)}
        if e["target"] == "node":
            grown = [r for r in steps if r["attempt"] == a + 2]
            row["grown"] = bool(grown)
            if grown:
                row["time_to_grow_s"] = min(r["time"] for r in grown) - e["up_time"]
                row["world_after_grow"] = max(r["world"] for r in grown)
        per_event.append(row)
    counts = chaos.per_epoch_counts(steps)
    want = set(range(chaos.chaos_job.N))
    lost = sum(len(want - set(seen)) for seen in counts.values())
    repeated = sum(n - 1 for seen in counts.values() for n in seen.values() if n > 1)
    configs = sorted({(r["world"], r["batch"], r["accum"]) for r in chaos.lineage(steps)})
    return {"per_event": per_event, "epochs": sorted(counts), "samples_lost": lost,
            "samples_repeated": repeated, "configs": configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    chaos.add_chaos_options(parser, HERE / "results" / "chaos_elastic.json")
    parser.add_argument("--node-losses", type=int, default=1)
    parser.add_argument("--max-delay", type=float, default=1.5)
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=8,
                        help="epochs of 12 base steps: enough training for every event")
    args = parser.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stratagem-chaos-el-") as tmp:
        raw = run(Path(tmp), kills=args.kills, agent_kills=args.agent_kills,
                  node_losses=args.node_losses, seed=args.seed,
                  checkpoint_steps=args.checkpoint_steps, step_sleep=args.step_sleep,
                  backoff=args.backoff, max_delay=args.max_delay,
                  peer_timeout=args.peer_timeout, timeout=args.timeout, epochs=args.epochs)
    result = analyse(raw)
    events = result["per_event"]
    survived = [e for e in events if e["resumed"]]
    out = {
        "bench": "chaos_elastic", "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg_before": load, "loadavg_after": os.getloadavg(),
        "config": vars(args) | {"out": str(args.out), "nodes": 2, "nnodes": "1:2",
                                "adaptive": True},
        "completed": raw["returncode"] == 0, "wall_s": raw["wall_s"],
        "events": len(events), "survived": len(survived),
        "restarts_reported": raw["output"].count("stratagem: restart "),
        "shrinks_reported": raw["output"].count("stratagem: shrink "),
        "grows_reported": raw["output"].count("stratagem: grow "),
        "time_to_resume_s": chaos.summarize([e["time_to_resume_s"] for e in survived]),
        "steps_lost": chaos.summarize([float(e["steps_lost"]) for e in survived]),
        "time_to_grow_s": chaos.summarize([e["time_to_grow_s"] for e in survived
                                           if "time_to_grow_s" in e]),
        "epochs_completed": result["epochs"],
        "samples_lost": result["samples_lost"], "samples_repeated": result["samples_repeated"],
        "batch_configs_trained": result["configs"],
        "per_event": events,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_event"}, indent=2))
    if not out["completed"]:
        print(raw["output"][-4000:], file=sys.stderr)


if __name__ == "__main__":
    main()
