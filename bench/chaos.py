"""Chaos run: SIGKILL random workers (and an agent) of a `stratagem run` job at random times.

    python bench/chaos.py [--kills 10] [--agent-kills 1] [--seed 0] [--checkpoint-steps 4]
                          [--out bench/results/chaos.json]

The job (``bench/chaos_job.py``: 2 workers, 48 steps, Adam, a checkpoint every
``--checkpoint-steps`` steps) runs under ``stratagem run --max-restarts``. After each
(re)start, once the job trains again, a seeded random delay later a seeded random worker (or,
for an agent kill, the node's torch elastic agent) gets SIGKILL. Measured per kill:

* **time to resume**: from the kill to the first training step of the restarted job
  (detection, tear-down, backoff, relaunch, imports, restore);
* **work lost**: the steps begun before the kill that the restarted job trained again
  (those after the checkpoint it resumed from), and the seconds of training they took.

Checked at the end: the job completed; every global step's samples are those of an
undisturbed run (``reference_batches``: no sample lost or trained twice relative to the
restored checkpoint, and each replayed step saw the same samples); the final parameters
equal an undisturbed ``stratagem run`` of the same job bit for bit (``--baseline``) and the
plain-torch single-process reference within float tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "chaos_job.py"
sys.path.insert(0, str(HERE))

import chaos_job  # noqa: E402 - the job's reference, next to this file


def read_steps(logs: Path) -> list[dict[str, Any]]:
    """Every step line every rank wrote (a line cut by a kill is skipped)."""
    out = []
    for path in sorted(logs.glob("steps-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def agent_pids(job_id: str) -> list[int]:
    """Pids of this job's node agents (``python -m stratagem.launch.agent``)."""
    needle = f"STRATAGEM_JOB_ID={job_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"stratagem.launch.agent" in cmd and needle in environ:
            pids.append(int(entry))
    return pids


def _wait(predicate: Any, proc: subprocess.Popen[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def launch(logs: Path, ckpt: Path, job_id: str, *, nproc: int, checkpoint_steps: int,
           step_sleep: float, max_restarts: int, backoff: float,
           job_args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "stratagem", "run", "--nproc", str(nproc), "--job-id", job_id,
           "--checkpoint-dir", str(ckpt), "--checkpoint-steps", str(checkpoint_steps),
           "--max-restarts", str(max_restarts), "--restart-backoff", str(backoff),
           "--run-dir", str(logs / "run"), str(JOB), "--out", str(logs),
           "--step-sleep", str(step_sleep), *job_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def run_chaos(work: Path, *, nproc: int = 2, kills: int = 3, agent_kills: int = 0,
              seed: int = 0, checkpoint_steps: int = 3, step_sleep: float = 0.05,
              backoff: float = 0.5, max_delay: float = 1.0, timeout: float = 300.0,
              verbose: bool = False) -> dict[str, Any]:
    """Run the job, SIGKILL as planned, wait for the end; returns the raw measurements."""
    rng = random.Random(seed)
    targets = ["worker"] * kills + ["agent"] * agent_kills
    rng.shuffle(targets)
    logs, ckpt = work / "logs", work / "ckpt"
    job_id = f"chaos-{seed}-{os.getpid()}"
    proc = launch(logs, ckpt, job_id, nproc=nproc, checkpoint_steps=checkpoint_steps,
                  step_sleep=step_sleep, max_restarts=len(targets) + 1, backoff=backoff)
    output: list[tuple[float, str]] = []  # (arrival time, line) of the launcher's output

    def pump() -> None:
        for line in proc.stdout or ():
            output.append((time.time(), line))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    kills_done: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for target in targets:
            attempt = len(kills_done)
            if not _wait(lambda a=attempt: any(r["attempt"] == a for r in read_steps(logs)),
                         proc, timeout):
                break
            time.sleep(rng.uniform(0.0, max_delay))
            if target == "worker":
                rank = rng.randrange(nproc)
                mine = [r for r in read_steps(logs) if r["attempt"] == attempt
                        and r["rank"] == rank]
                pid = mine[-1]["pid"]
            else:
                rank, pids = None, agent_pids(job_id)
                if not pids:
                    break
                pid = pids[0]
            now = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                break  # the job finished first
            kills_done.append({"target": target, "rank": rank, "pid": pid, "time": now,
                               "attempt": attempt})
            if verbose:
                print(f"chaos: kill {len(kills_done)}: SIGKILL to the {target} "
                      f"{'' if rank is None else f'of rank {rank} '}(pid {pid})",
                      file=sys.stderr, flush=True)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass  # reported: returncode None
    finally:
        timed_out = proc.poll() is None
        if timed_out:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher stops its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
    reports = [t for t, line in output if line.startswith("stratagem: failure ")]
    for kill, seen in zip(kills_done, reports, strict=False):
        kill["detected_s"] = seen - kill["time"]  # the kill to the supervisor's report
    return {"returncode": None if timed_out else proc.returncode,
            "output": "".join(line for _, line in output), "kills": kills_done,
            "steps": read_steps(logs), "final": logs / "final.pt",
            "wall_s": time.monotonic() - started}


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-kill time to resume and work lost; samples lost/repeated; the attempts' steps."""
    steps = raw["steps"]
    per_kill = []
    for kill in raw["kills"]:
        a = kill["attempt"]
        before = [r for r in steps if r["attempt"] == a and r["time"] <= kill["time"]]
        after = [r for r in steps if r["attempt"] == a + 1]
        if not before or not after:
            per_kill.append({**kill, "resumed": False})
            continue
        at_kill = max(r["step"] for r in before)
        resumed_at = min(r["step"] for r in after)  # the first step after the checkpoint
        redo = [r["time"] for r in before if r["step"] >= resumed_at]
        per_kill.append({
            "target": kill["target"], "rank": kill["rank"], "resumed": True,
            "step_at_kill": at_kill, "resumed_at_step": resumed_at,
            "steps_lost": at_kill - resumed_at + 1,
            "detected_s": kill.get("detected_s"),
            "work_lost_s": kill["time"] - min(redo) if redo else 0.0,
            "time_to_resume_s": min(r["time"] for r in after) - kill["time"],
        })
    return {"per_kill": per_kill, **sample_accounting(steps)}


def sample_accounting(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples lost and repeated relative to the checkpoints: the global batch of each step
    (union over ranks, whatever the world size) from the last attempt that trained it, against
    an undisturbed run's; and how many replayed steps saw other samples than before."""
    batches: dict[tuple[int, int], list[int]] = {}
    for r in steps:
        batches.setdefault((r["attempt"], r["step"]), []).extend(r["ids"])
    by_step: dict[int, dict[int, list[int]]] = {}
    for (attempt, step), ids in batches.items():
        by_step.setdefault(step, {})[attempt] = sorted(ids)
    replay_mismatch = sum(len({tuple(v) for v in seen.values()}) > 1
                          for seen in by_step.values())
    effective = [seen[max(seen)] for _, seen in sorted(by_step.items())]
    want = chaos_job.reference_batches()
    flat_got = [i for b in effective for i in b]
    flat_want = [i for b in want for i in b]
    lost = sum(max(0, flat_want.count(i) - flat_got.count(i)) for i in set(flat_want))
    repeated = sum(max(0, flat_got.count(i) - flat_want.count(i)) for i in set(flat_got))
    return {"samples_lost": lost, "samples_repeated": repeated,
            "batches_match_reference": effective == want,
            "replayed_steps_differ": replay_mismatch}


def lineage(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps the final state descends from, whatever the batch sizes: attempts in order,
    each discarding the earlier attempts' steps from its first step on (it resumed from a
    checkpoint taken before them)."""
    kept: list[dict[str, Any]] = []
    for attempt in sorted({r["attempt"] for r in steps}):
        mine = [r for r in steps if r["attempt"] == attempt]
        first = min(r["step"] for r in mine)
        kept = [r for r in kept if r["step"] < first] + mine
    return kept


def per_epoch_counts(steps: list[dict[str, Any]]) -> dict[int, dict[int, int]]:
    """Epoch -> sample id -> times trained, over :func:`lineage` (exactly once: all 1)."""
    counts: dict[int, dict[int, int]] = {}
    for r in lineage(steps):
        epoch = counts.setdefault(r["epoch"], {})
        for i in r["ids"]:
            epoch[i] = epoch.get(i, 0) + 1
    return counts


def compare_params(final: Path, other: dict[str, Any]) -> tuple[bool, float]:
    """(bit-identical, max abs difference) of the final model state against ``other``."""
    import torch

    got = torch.load(final, map_location="cpu", weights_only=True)["model"]
    want = other["model"]
    exact = all(torch.equal(got[k], want[k]) for k in want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    return exact, diff


def summarize(values: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(values) if values else None,
            "worst": max(values) if values else None}


def add_chaos_options(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options both chaos benchmarks take (chaos.py, chaos_elastic.py)."""
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--agent-kills", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-steps", type=int, default=4)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--backoff", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    parser.add_argument("--out", type=Path, default=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_chaos_options(parser, HERE / "results" / "chaos.json")
    args = parser.parse_args()
    import torch

    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stratagem-chaos-") as tmp:
        work = Path(tmp)
        calm = run_chaos(work / "calm", kills=0, seed=args.seed, timeout=args.timeout,
                         checkpoint_steps=args.checkpoint_steps, step_sleep=args.step_sleep)
        print(f"chaos: undisturbed run: {calm['wall_s']:.1f} s", file=sys.stderr, flush=True)
        calm_state = torch.load(calm["final"], map_location="cpu", weights_only=True)
        raw = run_chaos(work / "chaos", kills=args.kills, agent_kills=args.agent_kills,
                        seed=args.seed, checkpoint_steps=args.checkpoint_steps,
                        step_sleep=args.step_sleep, backoff=args.backoff,
                        timeout=args.timeout, verbose=True)
        result = analyse(raw)
        done = raw["returncode"] == 0 and raw["final"].is_file()
        exact, diff_calm = compare_params(raw["final"], calm_state) if done else (False, -1.0)
        _, diff_ref = compare_params(raw["final"], chaos_job.reference()) if done else (0, -1.0)
    kills = [k for k in result["per_kill"]]
    survived = [k for k in kills if k["resumed"]]
    out = {
        "bench": "chaos", "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg_before": load, "loadavg_after": os.getloadavg(),
        "config": vars(args) | {"out": str(args.out), "workers": 2, "steps": 48},
        "completed": done, "restarts_reported": raw["output"].count("stratagem: restart "),
        "kills": len(kills), "survived": len(survived),
        "time_to_resume_s": summarize([k["time_to_resume_s"] for k in survived]),
        "failure_detected_s": summarize([k["detected_s"] for k in survived
                                         if k["detected_s"] is not None]),
        "steps_lost": summarize([float(k["steps_lost"]) for k in survived]),
        "work_lost_s": summarize([k["work_lost_s"] for k in survived]),
        "samples_lost": result["samples_lost"], "samples_repeated": result["samples_repeated"],
        "batches_match_reference": result["batches_match_reference"],
        "final_params_equal_undisturbed_run": exact,
        "max_abs_diff_vs_undisturbed_run": diff_calm,
        "max_abs_diff_vs_single_process_reference": diff_ref,
        "undisturbed_wall_s": calm["wall_s"], "chaos_wall_s": raw["wall_s"],
        "per_kill": kills,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_kill"}, indent=2))
    if not done:
        print(raw["output"][-4000:], file=sys.stderr)


if __name__ == "__main__":
    main()
