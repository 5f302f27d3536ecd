"""Gradient statistics of the AdaptDL drop-in against AdaptDL's own, step by step.

The same AdaptDL program (``AdaptiveDataLoader`` without shuffling, ``AdaptiveDataParallel``,
plain SGD, no autoscaling so both train at the same batch and learning rate) runs on
2 replicas (AdaptDL's standalone rendezvous, ``ADAPTDL_*`` variables) once with
``import adaptdl`` in a virtual environment where ``adaptdl==0.2.11`` is installed and once
with ``from stratagem import adaptdl``, from the same initial weights and data. After every
optimizer step rank 0 records ``model.gns.sqr_avg()``, ``model.gns.var_avg()`` (the
smoothed statistics both expose in AdaptDL's units) and their ratio, the noise scale; and a
probe, the same code on both systems: each replica's local squared gradient norm from a
private copy of the model, the squared norm of their average, a weight checksum, and the
(S, T) pair each system's estimator was fed that step. Each model also runs on AdaptDL with
its first step made like the others ("controlled": AdaptDL marks its loader as the
training loader only after the job's first backward, so that step runs at
``accum_scale = num_replicas``); against it the two systems should be identical.

Models: a small CNN on 3x8x8 images, an MLP, and an embedding-bag model (sparse
inputs), with SGD; and the embedding-bag model with Adam (both systems then measure
Adam-preconditioned statistics, as for AdaptDL's NCF example). Writes
bench/results/adaptdl_gns_compare.json: per model the per-step series of
both systems, the relative differences after a warm-up (median and at the last step), and
whether they agree within 10%.

    python bench/adaptdl_gns_compare.py --adaptdl-python /work/adaptdl-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODELS = ("cnn", "mlp", "embedding", "embedding-adam")
N_SAMPLES = 1536
BATCH = 32  # total batch: 16 per replica
EPOCHS = 2
LR = {"cnn": 0.05, "mlp": 0.05, "embedding": 0.5, "embedding-adam": 0.01}
WARMUP = 0.25  # the first quarter of the steps is not compared (both start from priors)


# -- worker (runs in either environment) ------------------------------------------------------
def _data(model: str):  # noqa: ANN202 - torch types differ per environment
    import torch

    g = torch.Generator().manual_seed(1)
    if model == "cnn":
        x = torch.randn(N_SAMPLES, 3, 8, 8, generator=g)
        w = torch.randn(3 * 8 * 8, 4, generator=torch.Generator().manual_seed(2))
        y = (x.flatten(1) @ w).argmax(1)
    elif model == "mlp":
        x = torch.randn(N_SAMPLES, 32, generator=g)
        w = torch.randn(32, 6, generator=torch.Generator().manual_seed(2))
        y = (torch.tanh(x @ w) + 0.3 * torch.randn(N_SAMPLES, 6, generator=g)).argmax(1)
    else:  # embedding, embedding-adam
        x = torch.randint(0, 500, (N_SAMPLES, 8), generator=g)
        weights = torch.randn(500, generator=torch.Generator().manual_seed(2))
        y = (weights[x].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _model(model: str):  # noqa: ANN202
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model.startswith("embedding"):
        return nn.Sequential(nn.EmbeddingBag(500, 16, mode="mean"), nn.Linear(16, 2))
    if model == "cnn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    if model == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 6))
    return nn.Sequential(nn.EmbeddingBag(500, 16, mode="mean"), nn.Linear(16, 2))


def _probe(ref, net, x, y, rank: int) -> dict:  # noqa: ANN001 - torch types per environment
    """Independent per-step reference, the same code on both systems: this replica's
    local gradient from a private copy of the model (no hooks of either system), each
    replica's |g_local|^2, the squared norm of the replicas' averaged local gradients,
    and a checksum of the weights (the same trajectory on both systems?)."""
    import torch
    import torch.distributed as dist

    ref.load_state_dict(net.module.state_dict())
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    flat = torch.cat([g.reshape(-1).double() for g in grads])
    world = dist.get_world_size()
    local = torch.zeros(world, dtype=torch.float64)
    local[rank] = flat.pow(2).sum()
    dist.all_reduce(local)
    dist.all_reduce(flat)
    wsum = float(sum(p.double().pow(2).sum() for p in ref.parameters()))
    return {"ref_local": local.tolist(), "ref_T": float((flat / world).pow(2).sum()),
            "weights_sqr": wsum}


def worker(system: str, model_name: str, out: str) -> None:
    import torch

    if system == "adaptdl":
        import adaptdl
        import adaptdl.torch as adl
    else:
        import stratagem.adaptdl.torch as adl
        from stratagem import adaptdl
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    loader = adl.AdaptiveDataLoader(_data(model_name), batch_size=BATCH, shuffle=False,
                                    drop_last=True)
    net = _model(model_name)
    opt = (torch.optim.Adam(net.parameters(), lr=LR[model_name])  # preconditioned stats
           if model_name.endswith("-adam") else
           torch.optim.SGD(net.parameters(), lr=LR[model_name]))
    net = adl.AdaptiveDataParallel(net, opt)
    if system == "adaptdl" and os.environ.get("GNS_ADAPTDL_FIRST_STEP") == "fixed":
        # AdaptDL marks its loader as the training loader only in the first backward's
        # callback, so the job's very first forward keeps accum_scale = num_replicas: that
        # step's variance is measured x replicas and its LR is scaled by gain(replicas).
        # Marking it first makes step 1 like every other step (controlled runs only).
        loader._elastic.train()
    rank = adaptdl.env.replica_rank()
    ref = _model(model_name)
    raw: list = []  # what each system's estimator was fed this step: (S, T)
    if system == "adaptdl":
        gns = net.gns
        orig = gns._update_avg

        def record(name, value, factor):  # noqa: ANN001, ANN202
            if name == "sqr_avg":
                raw.append(["sqr", float(sum(value))])
            else:  # var = (S - T) * scale with scale = log(factor) / log(smoothing)
                scale = float(torch.tensor(factor).log() / torch.tensor(0.999).log())
                raw.append(["var", float(sum(value)) / scale])
            return orig(name, value, factor)
        gns._update_avg = record
    else:
        from stratagem.adapt.noise_scale import GradientNoiseScale  # (made lazily)
        orig = GradientNoiseScale.update

        def record(self, local, mean, size, **kw):  # noqa: ANN001, ANN003, ANN202
            import numpy as np
            loc = np.asarray(local, dtype=float).reshape(len(local), -1).sum(1)
            raw.append(["ST", float(loc.mean()), float(np.sum(mean))])
            return orig(self, local, mean, size, **kw)
        GradientNoiseScale.update = record
    rows = []
    step = 0
    for _epoch in adl.remaining_epochs_until(EPOCHS):
        for x, y in loader:
            probe = _probe(ref, net, x, y, rank)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            probe["grad_T"] = float(sum(p.grad.double().pow(2).sum()
                                        for p in net.module.parameters()
                                        if p.grad is not None))
            opt.step()
            step += 1
            sqr, var = float(net.gns.sqr_avg()), float(net.gns.var_avg())
            raw_sqr = float(sum(float(v) for v in net.gns.raw_sqr_avg))  # unclipped
            fed = {}
            for entry in raw:
                if entry[0] == "ST":
                    fed = {"fed_S": entry[1], "fed_T": entry[2]}
                elif entry[0] == "sqr":
                    fed["fed_sqr"] = entry[1]
                else:
                    fed["fed_var"] = entry[1]
            if "fed_sqr" in fed:  # AdaptDL, two replicas: sqr = 2T - S, var = S - T
                fed["fed_T"] = fed["fed_sqr"] + fed["fed_var"]
                fed["fed_S"] = fed["fed_T"] + fed["fed_var"]
            raw.clear()
            rows.append({"step": step, "loss": float(loss), "sqr": sqr, "var": var,
                         "sqr_raw": raw_sqr, **probe, **fed})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


# -- driver -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_system(python: str, system: str, model: str, out: Path, ckpt: Path) -> list[dict]:
    port = _free_port()
    (ckpt / f"{system}-{model}").mkdir(parents=True, exist_ok=True)  # AdaptDL lists it
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ADAPTDL_", "STRATAGEM_", "RANK", "WORLD_SIZE",
                                    "MASTER_", "LOCAL_"))}
        env.update(ADAPTDL_MASTER_ADDR="127.0.0.1", ADAPTDL_MASTER_PORT=str(port),
                   ADAPTDL_NUM_REPLICAS="2", ADAPTDL_REPLICA_RANK=str(rank),
                   ADAPTDL_CHECKPOINT_PATH=str(ckpt / f"{system}-{model}"),
                   ADAPTDL_JOB_ID=f"gns-{system}-{model}", STRATAGEM_VERBOSE="0",
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=str(HERE.parents[1] / "src") if system == "stratagem" else "")
        procs.append(subprocess.Popen(
            [python, str(HERE), "--worker", system, model, str(out)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{system} {model} failed:\n" + "\n".join(t[-3000:] for t in logs))
    return json.loads(out.read_text())


def _rel(a: float, b: float) -> float:
    if a == b:  # also both 0 or both infinite (a squared norm estimated at <= 0)
        return 0.0
    return abs(a - b) / max(abs(b), 1e-30)


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    steps = min(len(ours), len(theirs))
    start = int(steps * WARMUP)
    out: dict = {"steps": steps, "compared_from_step": start + 1}
    for key in ("sqr", "sqr_raw", "var", "noise_scale"):
        def val(row: dict, key: str = key) -> float:
            if key != "noise_scale":
                return row[key]
            return row["var"] / row["sqr"] if row["sqr"] > 0 else float("inf")
        diffs = sorted(_rel(val(ours[i]), val(theirs[i])) for i in range(start, steps))
        out[key] = {"median_rel_diff": diffs[len(diffs) // 2],
                    "max_rel_diff": diffs[-1],
                    "last_rel_diff": _rel(val(ours[steps - 1]), val(theirs[steps - 1])),
                    "last": {"stratagem": val(ours[steps - 1]),
                             "adaptdl": val(theirs[steps - 1])}}
    # after smoothing: the smoothed statistics at the end of the run (the per-step series
    # differ more: Stratagem samples every k-th step to bound the cost, AdaptDL every step)
    out["within_10pct"] = all(out[k]["last_rel_diff"] <= 0.10
                              for k in ("sqr", "var", "noise_scale"))
    return out


def noise(ours: list[dict], theirs: list[dict]) -> dict:
    """How well a run resolves |G|^2: mean and standard error of the one-step estimates
    ``2T - S`` (two replicas) after the warm-up, per system."""
    out = {}
    for name, rows in (("stratagem", ours), ("adaptdl", theirs)):
        vals = [2 * r["fed_T"] - r["fed_S"] for r in rows[int(len(rows) * WARMUP):]
                if "fed_T" in r]
        mean = sum(vals) / len(vals)
        sd = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
        out[name] = {"one_step_sqr_mean": mean, "one_step_sqr_sd": sd,
                     "standard_error": sd / len(vals) ** 0.5, "steps": len(vals)}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adaptdl-python", default="/work/adaptdl-venv/bin/python")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=str(HERE.parent / "results" /
                                             "adaptdl_gns_compare.json"))
    args = parser.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gns-compare-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"load_before": os.getloadavg(), "started": time.time(),
                    "setup": {"replicas": 2, "batch": BATCH, "samples": N_SAMPLES,
                              "epochs": EPOCHS, "lr": LR, "warmup_fraction": WARMUP},
                    "models": {}}
    for model in args.models.split(","):
        series = {}
        for system, python in (("adaptdl", args.adaptdl_python),
                               ("stratagem", sys.executable)):
            series[system] = run_system(python, system, model,
                                        work / f"{system}-{model}.json", work / "ckpt")
        # the controlled run: AdaptDL's first step made like the others (see worker)
        os.environ["GNS_ADAPTDL_FIRST_STEP"] = "fixed"
        try:
            series["adaptdl_first_step_fixed"] = run_system(
                args.adaptdl_python, "adaptdl", model, work / f"adaptdl-fixed-{model}.json",
                work / "ckpt-fixed")
        finally:
            os.environ.pop("GNS_ADAPTDL_FIRST_STEP")
        cmp = compare(series["stratagem"], series["adaptdl"])
        controlled = compare(series["stratagem"], series["adaptdl_first_step_fixed"])
        result["models"][model] = {**cmp, "controlled": controlled,
                                   "noise": noise(series["stratagem"], series["adaptdl"]),
                                   "series": series}
        print(f"{model}: " + ", ".join(
            f"{k} median {cmp[k]['median_rel_diff']:.1%} last {cmp[k]['last_rel_diff']:.1%} "
            f"({cmp[k]['last']['stratagem']:.4g} vs {cmp[k]['last']['adaptdl']:.4g})"
            for k in ("sqr", "var", "noise_scale")) + f"; within 10%: {cmp['within_10pct']}"
            + "; controlled: " + ", ".join(f"{k} max {controlled[k]['max_rel_diff']:.1e}"
                                           for k in ("sqr", "var")), flush=True)
    result["load_after"] = os.getloadavg()
    result["summary"] = {m: r["within_10pct"] for m, r in result["models"].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
