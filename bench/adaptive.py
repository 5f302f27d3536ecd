"""Adaptive batch size: overhead and time to a target accuracy, 2 workers (local gloo).

(a) ``overhead``: the same model, strategy and batch size with and without adaptivity
    (step profiling, gradient statistics, decisions, hints). Both run in the same two worker
    processes, in alternating blocks of steps (A/B interleaved), and the ratio of the median
    step times is reported (target <= 1.05).
(b) ``tta``: wall time of training until the validation accuracy reaches a target on
    scikit-learn's digits (augmented with shifts and pixel noise), for several fixed batch
    sizes and for the autoscaled batch. Every run uses SGD with momentum and AdaScale from the
    same base batch and LR, so only the batch-size policy differs. Evaluation time is not
    counted. Target: autoscaled no worse than the best fixed batch, better than the median.

Results: bench/results/adaptive.json (merged per section).

    python bench/adaptive.py [overhead|tta|all] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "adaptive.json"
WORLD = 2


# -- processes ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn_name: str, kwargs: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    for var in ("STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", "STRATAGEM_STRATEGY",
                "STRATAGEM_RESOURCE_SPEC", "STRATAGEM_HINTS_PORT"):
        os.environ.pop(var, None)
    import torch

    torch.set_num_threads(1)
    result = globals()[fn_name](rank, **kwargs)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_workers(fn_name: str, **kwargs: Any) -> list[dict]:
    """Run ``fn_name(rank, **kwargs)`` in 2 spawned processes; their JSON results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(_free_port(), fn_name, kwargs, out), nprocs=WORLD,
                           start_method="spawn", join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


# -- (a) overhead ---------------------------------------------------------------------------
def _mlp(width: int, layers: int, inputs: int = 64, classes: int = 10):  # noqa: ANN202
    from torch import nn

    mods: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, classes))


def overhead_worker(rank: int, *, blocks: int, steps: int, batch: int, width: int,
                    layers: int, optimizer: str) -> dict:
    """Alternate plain and adaptive blocks of ``steps`` steps; per-step times of rank 0."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import stratagem as sg

    torch.manual_seed(0)
    n = batch * steps * 4
    data = torch.utils.data.TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    ad = sg.AutoDist(verbose=False)
    model = _mlp(width, layers)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    model, opt = ad.distribute(model, opt)
    trainer = ad.adaptive
    wrapped = {"step": opt.step, "zero_grad": opt.zero_grad}
    plain = ad.data_loader(data, batch_size=batch, shuffle=True)
    adaptive = ad.data_loader(data, batch_size=batch, shuffle=True)
    # Adaptive at a batch it may not change (max = base, fixed micro-batch): everything runs
    # (profiling, statistics, decisions, hints) but the work per step stays the same.
    adaptive.autoscale_batch_size(batch, (batch // WORLD, batch // WORLD))
    trainer.hints.path = Path(tempfile.gettempdir()) / f"stratagem-bench-hints-{os.getpid()}"

    def set_mode(mode: str) -> Any:
        """Plain: no loader hooks, the optimizer's own step/zero_grad, no observer."""
        stats = trainer.stats
        if mode == "plain":
            for name in wrapped:
                opt.__dict__.pop(name, None)
            stats.close()
            return plain
        for name, fn in wrapped.items():
            setattr(opt, name, fn)
        if stats._handle is None:
            stats._handle = model.add_grad_observer(stats._observe)
        return adaptive

    plain.hooks = None
    loss_fn = nn.CrossEntropyLoss()
    times: dict[str, list[float]] = {"plain": [], "adaptive": []}
    its: dict[str, Any] = {}
    for block in range(2 * blocks + 2):
        mode = ("plain", "adaptive")[block % 2]
        loader = set_mode(mode)
        it = its.get(mode)
        if it is None:
            it = its[mode] = iter(_forever(loader))
        dist.barrier()
        last = time.perf_counter()
        for _ in range(steps):
            x, y = next(it)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            now = time.perf_counter()
            if block >= 2:  # the first pair warms up
                times[mode].append(now - last)
            last = now
    gns = trainer.gns
    return {"times": times, "decisions": trainer.last_decision_step, "steps": trainer.steps,
            "gns_updates": gns.updates if gns else 0,
            "noise_scale": gns.noise_scale if gns and gns.ready else None,
            "fit_seconds": trainer.profiler.fit_seconds,
            "decision_seconds": trainer.decision_seconds}


def _forever(loader: Any):  # noqa: ANN202
    while True:
        yield from loader


OVERHEAD_CONFIGS = [
    {"name": "mlp-1024x3-sgd", "width": 1024, "layers": 3, "batch": 128, "optimizer": "sgd"},
    {"name": "mlp-1024x3-adamw", "width": 1024, "layers": 3, "batch": 128,
     "optimizer": "adamw"},
    {"name": "mlp-256x2-sgd-small-steps", "width": 256, "layers": 2, "batch": 64,
     "optimizer": "sgd"},
]


def overhead(quick: bool, configs: list[dict] | None = None, blocks: int | None = None,
             steps: int | None = None) -> dict:
    """Ratio of median step times, adaptive / plain, per configuration."""
    configs = OVERHEAD_CONFIGS if configs is None else configs
    blocks = blocks or (3 if quick else 10)
    steps = steps or (20 if quick else 40)
    out = {}
    for cfg in configs:
        kwargs = {k: v for k, v in cfg.items() if k != "name"}
        res = run_workers("overhead_worker", blocks=blocks, steps=steps, **kwargs)[0]
        plain = statistics.median(res["times"]["plain"])
        adaptive = statistics.median(res["times"]["adaptive"])
        out[cfg["name"]] = {
            **cfg, "world_size": WORLD, "steps_per_mode": len(res["times"]["plain"]),
            "plain_median_step_s": plain, "adaptive_median_step_s": adaptive,
            "ratio": adaptive / plain, "gns_updates": res["gns_updates"],
            "noise_scale": res["noise_scale"], "fit_seconds": res["fit_seconds"],
            "decision_seconds": res["decision_seconds"]}
        print(f"overhead {cfg['name']}: plain {plain * 1e3:.2f} ms, adaptive "
              f"{adaptive * 1e3:.2f} ms, ratio {adaptive / plain:.3f}", flush=True)
    return out


# -- (b) time to target accuracy --------------------------------------------------------------
def digits_data(copies: int, seed: int = 0):  # noqa: ANN201
    """Digits (8x8, 10 classes): 80% for training, augmented ``copies`` times with random
    one-pixel shifts and Gaussian pixel noise; the other 20% (clean) for validation."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8)
    split = int(0.8 * len(x))
    tr, va = order[:split], order[split:]
    xs, ys = [], []
    for _ in range(copies):
        img = x[tr].copy()
        shifts = rng.integers(-1, 2, size=(len(tr), 2))  # per image, one pixel at most
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                sel = (shifts[:, 0] == dx) & (shifts[:, 1] == dy)
                img[sel] = np.roll(np.roll(img[sel], dx, axis=2), dy, axis=1)
        img = img + rng.normal(0, 0.2, img.shape).astype(np.float32)
        xs.append(img)
        ys.append(y[tr])
    train = torch.utils.data.TensorDataset(torch.from_numpy(np.concatenate(xs)).reshape(-1, 64),
                                           torch.from_numpy(np.concatenate(ys)).long())
    val = (torch.from_numpy(x[va]).reshape(-1, 64), torch.from_numpy(y[va]).long())
    return train, val


def tta_worker(rank: int, *, mode: str, batch: int, target: float, max_seconds: float,
               copies: int, base_batch: int, lr: float, max_batch: int, seed: int,
               eval_every_samples: int) -> dict:
    """Train until the validation accuracy reaches ``target``; seconds of training."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import stratagem as sg

    torch.manual_seed(seed)
    train, (vx, vy) = digits_data(copies)
    ad = sg.AutoDist(verbose=False, seed=seed)
    model = _mlp(128, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = ad.distribute(model, opt, scaling_rule=sg.adapt.AdaScale())
    loader = ad.data_loader(train, batch_size=base_batch, shuffle=True)
    if mode == "auto":
        loader.autoscale_batch_size(max_batch, (8, max_batch // WORLD),
                                    gradient_accumulation=False)
    else:
        loader.batch_size = batch
        ad.adaptive.collect_stats = True  # AdaScale needs the gain at batch != base
    loss_fn = nn.CrossEntropyLoss()
    flag = torch.zeros(1)
    trained, cpu, samples, next_eval, acc = 0.0, 0.0, 0, eval_every_samples, 0.0
    curve, batches = [], []
    for _epoch in ad.remaining_epochs_until(10_000):
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            samples += len(y) * WORLD
            if samples < next_eval:
                continue
            trained += time.perf_counter() - t0
            cpu += time.process_time() - c0
            next_eval += eval_every_samples
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    acc = (model.module(vx).argmax(1) == vy).float().mean().item()
                model.train()
                flag[0] = float(acc >= target or trained > max_seconds)
            dist.broadcast(flag, src=0)
            curve.append((trained, samples, acc, cpu))
            batches.append(loader.batch_size)
            if flag.item():
                break
            t0, c0 = time.perf_counter(), time.process_time()
        else:
            trained += time.perf_counter() - t0
            cpu += time.process_time() - c0
            continue
        break
    reached = acc >= target
    return {"mode": mode, "batch": batch, "seconds": trained if reached else None,
            "cpu_seconds": cpu if reached else None,
            "trained_seconds": trained, "samples": samples, "accuracy": acc,
            "reached": reached, "final_batch": loader.batch_size, "curve": curve,
            "batches": batches, "progress": ad.adaptive.tracker.progress}


def tta(quick: bool, target: float = 0.96) -> dict:
    fixed = [32, 64, 128, 256, 512]
    seeds = [0] if quick else [0, 1, 2]
    common = {"target": target, "max_seconds": 90.0, "copies": 4 if quick else 8,
              "base_batch": 32, "lr": 0.02, "max_batch": 1024, "eval_every_samples": 2048}
    runs = []
    for seed in seeds:  # interleaved: every policy once per seed
        for mode, batch in [("auto", 32)] + [("fixed", b) for b in fixed]:
            res = run_workers("tta_worker", mode=mode, batch=batch, seed=seed, **common)[0]
            res["seed"] = seed
            runs.append(res)
            label = "auto" if mode == "auto" else f"fixed {batch}"
            print(f"tta seed {seed} {label}: "
                  + (f"{res['seconds']:.2f} s" if res["reached"] else "not reached")
                  + f", final batch {res['final_batch']}, accuracy {res['accuracy']:.3f}",
                  flush=True)
    summary = {}
    for label in ["auto"] + [f"fixed-{b}" for b in fixed]:
        mine = [r for r in runs if (r["mode"] == "auto") == (label == "auto")
                and (label == "auto" or f"fixed-{r['batch']}" == label)]
        wall = [r["seconds"] if r["reached"] else float("inf") for r in mine]
        cpu = [r["cpu_seconds"] if r["reached"] else float("inf") for r in mine]
        summary[label] = {"median_seconds": statistics.median(wall),
                          "median_cpu_seconds": statistics.median(cpu),
                          "median_samples": statistics.median(r["samples"] for r in mine),
                          "all_reached": all(r["reached"] for r in mine),
                          "final_batches": [r["final_batch"] for r in mine]}
    verdict = {}
    for key in ("median_seconds", "median_cpu_seconds"):
        times = sorted(summary[f"fixed-{b}"][key] for b in fixed)
        best, median, auto = times[0], statistics.median(times), summary["auto"][key]
        verdict[key] = {"auto": auto, "best_fixed": best, "median_fixed": median,
                        "auto_vs_best": auto / best, "auto_vs_median": auto / median,
                        "no_worse_than_best": auto <= best * 1.05,
                        "better_than_median": auto < median}
        print(f"tta ({key}): auto {auto:.2f} s, best fixed {best:.2f} s, median fixed "
              f"{median:.2f} s", flush=True)
    return {"config": {**common, "fixed": fixed, "seeds": seeds, "world_size": WORLD},
            "summary": summary, "verdict": verdict, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="all", choices=["overhead", "tta", "all"])
    parser.add_argument("--quick", action="store_true", help="fewer steps and seeds")
    parser.add_argument("--target", type=float, default=0.96,
                        help="validation accuracy to reach (tta)")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if args.what in ("overhead", "all"):
        results["overhead"] = overhead(args.quick)
    if args.what in ("tta", "all"):
        results.setdefault("time_to_accuracy", {})[f"target-{args.target}"] = tta(
            args.quick, args.target)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
