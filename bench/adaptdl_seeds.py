"""Final accuracy of an AdaptDL program over seeds: AdaptDL itself against the drop-in.

A LeNet on CIFAR-shaped synthetic images (3x32x32, 10 classes: a fixed random prototype
per class plus noise; the same samples in every run) at AdaptDL's CIFAR example learning
rate (SGD 0.1, momentum 0.9, weight decay 5e-4, AdaScale), trained for a few epochs, with
``import adaptdl`` (in a virtual environment where ``adaptdl==0.2.11`` is installed) and
with ``from stratagem import adaptdl``; 1 and 2 replicas (AdaptDL's standalone
rendezvous), without and with ``autoscale_batch_size``. The seed sets the initial weights
and the training order (the dataset is permuted by it: neither system's sampler takes the
script's seed, so without that each system would train every run in one fixed order of its
own). Each configuration runs ``--seeds`` seeds per system, interleaved; the final test
accuracies of the two systems are compared with an exact two-sided Mann-Whitney U test,
and the counts of diverged runs (a non-finite loss) with Fisher's exact test, both at 5%.
Each run also records, per epoch, what the system decided: batch sizes, accumulation,
gain, LR factor, scale-invariant progress, gradient statistics.

AdaptDL rescales only after rank 0 has fitted its throughput model, 30 s of training after
the first profiled step (a constant in its code), and only when a pass starts; runs must be
long enough for that: ``--train``, ``--epochs``, ``--lr`` and ``--label-noise`` (a fraction
of training labels made random, which keeps the gradient noise scale large) set up such a
sweep, recorded under its own configuration keys beside the first sweep's.

Writes bench/results/adaptdl_seeds.json (every run, per-configuration tests, the machine's
load). Run it under ``nice``: it is 8 runs per configuration and system by default.
``--work DIR`` keeps each finished run there, so an interrupted sweep resumes, and a second
sweep with ``--reverse`` on the same directory shares the work.

    nice python bench/adaptdl_seeds.py --adaptdl-python /work/adaptdl-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve()
TRAIN, TEST = 512, 256
BATCH = 32
LR = 0.1  # AdaptDL's pytorch-cifar example


# -- statistics (no scipy here) ---------------------------------------------------------------
def _midranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Exact two-sided Mann-Whitney U test (midranks for ties, the permutation distribution
    of the rank sum counted exactly): returns (U of ``a``, p-value).

    Doubled midranks are integers, so the number of ways ``len(a)`` of the pooled values
    reach each rank sum is counted by dynamic programming (exact for any sample size)."""
    if not a or not b:
        raise ValueError("both samples need at least one value")
    doubled = [round(2 * r) for r in _midranks([*a, *b])]
    n = len(a)
    observed = sum(doubled[:n]) / 2 - n * (n + 1) / 2
    mean = n * len(b) / 2
    extreme = abs(observed - mean)
    ways: list[dict[int, int]] = [{} for _ in range(n + 1)]  # ways[k][sum of k doubled ranks]
    ways[0][0] = 1
    for r in doubled:
        for k in range(n, 0, -1):
            for total, count in ways[k - 1].items():
                ways[k][total + r] = ways[k].get(total + r, 0) + count
    hits = sum(c for t, c in ways[n].items()
               if abs(t / 2 - n * (n + 1) / 2 - mean) >= extreme - 1e-9)
    return observed, hits / math.comb(len(doubled), n)


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher's exact test of k1 of n1 against k2 of n2 (sum of the tables no
    more likely than the observed one)."""
    k, n = k1 + k2, n1 + n2

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(n, k)

    observed = prob(k1)
    return min(1.0, sum(prob(x) for x in range(max(0, k - n2), min(k, n1) + 1)
                        if prob(x) <= observed * (1 + 1e-9)))


# -- worker -----------------------------------------------------------------------------------
def _data(n: int, seed: int, order_seed: int | None = None,  # noqa: ANN202
          label_noise: float = 0.0):
    """``n`` images; ``order_seed`` permutes them (the same permutation on both systems);
    a ``label_noise`` fraction of them gets a random label (the same ones on both)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(99))
    y = torch.randint(0, 10, (n,), generator=g)
    x = 0.5 * prototypes[y] + torch.randn(n, 3, 32, 32, generator=g)
    if label_noise:
        # Keeps the gradient noise scale large all run (without it 3072 images are learnt
        # to ~99% and AdaptDL's goodput model keeps 1 replica at batch 32: there a larger
        # batch needs accumulation and gains it too little throughput).
        noisy = torch.rand(n, generator=g) < label_noise
        y = torch.where(noisy, torch.randint(0, 10, (n,), generator=g), y)
    if order_seed is not None:
        # Neither system's sampler takes the run's seed (AdaptDL's order is a function of
        # the epoch only, the drop-in's of its job seed), so each would see one fixed order
        # in every run; permuting the dataset by the seed makes the order vary with the
        # seed on both alike.
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(10_000 + order_seed))
        x, y = x[perm], y[perm]
    return torch.utils.data.TensorDataset(x, y)


def _lenet():  # noqa: ANN202
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 5 * 5, 120),
                         nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def _throughput_model_fitted(system: str) -> bool | None:
    """Whether AdaptDL has fitted its throughput model (``perf_params``; rank 0 only: the
    others get its decisions by broadcast); None on the drop-in, which has its own."""
    if system != "adaptdl":
        return None
    from adaptdl.torch._metrics import _metrics_state

    return _metrics_state().perf_params is not None


def worker(system: str, seed: int, epochs: int, autoscale: bool, out: str,
           train: int = TRAIN, lr: float = LR, label_noise: float = 0.0) -> None:
    """One replica of one run on ``train`` training images at learning rate ``lr``; rank 0
    writes {"accuracy", "diverged", "losses", "decisions"} to ``out``."""
    import torch

    if system == "adaptdl":
        import adaptdl
        import adaptdl.torch as adl
        from adaptdl.torch.scaling_rules import AdaScale
    else:
        import stratagem.adaptdl.torch as adl
        from stratagem import adaptdl
        from stratagem.adaptdl.torch.scaling_rules import AdaScale
    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    shuffle = os.environ.get("SEEDS_SHUFFLE", "1") == "1"  # 0: the same order on both
    loader = adl.AdaptiveDataLoader(_data(train, 1, seed, label_noise), batch_size=BATCH,
                                    shuffle=shuffle, drop_last=True)
    if autoscale:
        loader.autoscale_batch_size(256, local_bsz_bounds=(16, 256),
                                    gradient_accumulation=True)
    test = adl.AdaptiveDataLoader(_data(TEST, 2), batch_size=128)
    torch.manual_seed(seed)  # here: the same initial weights on both systems
    net = _lenet()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    net = adl.AdaptiveDataParallel(net, opt, scaling_rule=AdaScale())
    losses: list[float] = []
    decisions: list[dict] = []  # per epoch: what each system decided (batch size, LR, ...)
    started = time.monotonic()
    for _epoch in adl.remaining_epochs_until(epochs):
        stats = adl.Accumulator()
        batches: list[int] = []
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            stats["loss"] += float(loss) * len(y)
            stats["n"] += len(y)
            batches.append(int(loader.current_batch_size))
        with stats.synchronized():
            losses.append(stats["loss"] / max(stats["n"], 1))
            samples = int(stats["n"])
        decisions.append({
            "samples": samples, "micro_batches": len(batches),
            "batch_sizes": sorted(set(batches)),
            "accumulation_steps": int(loader.accumulation_steps),
            "gain": float(net.gain), "lr_factor": float(net._state.lr_factor),
            "progress": float(net.gns.get_progress()),
            "sqr": float(net.gns.sqr_avg()), "var": float(net.gns.var_avg()),
            # wall seconds since training began (AdaptDL fits its throughput model, which
            # its batch-size decisions need, once 30 s have passed since the first step)
            "seconds": round(time.monotonic() - started, 2),
            "throughput_model": _throughput_model_fitted(system)})
    net.eval()
    stats = adl.Accumulator()
    with torch.no_grad():
        for x, y in test:
            stats["correct"] += int((net(x).argmax(1) == y).sum())
            stats["n"] += len(y)
    with stats.synchronized():
        accuracy = stats["correct"] / stats["n"]
    if adaptdl.env.replica_rank() == 0:
        Path(out).write_text(json.dumps({
            "accuracy": accuracy, "losses": losses, "decisions": decisions,
            "diverged": not all(math.isfinite(v) for v in losses)}))


# -- driver -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def variant(train: int, epochs: int, lr: float = LR, label_noise: float = 0.0) -> str:
    """Suffix of a run's tag and configuration key for data sizes, lengths, learning
    rates or label noise other than the first sweep's (512 images, 4 epochs, 0.1, none),
    so sweeps of several setups share files."""
    if (train, epochs, lr, label_noise) == (TRAIN, 4, LR, 0.0):
        return ""
    return (f"-n{train}-e{epochs}" + ("" if lr == LR else f"-lr{lr:g}")
            + (f"-ln{label_noise:g}" if label_noise else ""))


def run_once(python: str, system: str, replicas: int, seed: int, epochs: int,
             autoscale: bool, work: Path, timeout: float = 900, train: int = TRAIN,
             lr: float = LR, label_noise: float = 0.0) -> dict:
    """One run on ``replicas`` processes (AdaptDL's standalone rendezvous)."""
    tag = (f"{system}-r{replicas}-a{int(autoscale)}-s{seed}"
           + variant(train, epochs, lr, label_noise))
    # per process: two sweeps sharing --work may run the same run at once
    out, ckpt = work / f"{tag}.{os.getpid()}.json", work / "ckpt" / f"{tag}.{os.getpid()}"
    done = work / f"{tag}.done.json"
    if done.exists():  # finished in an earlier, interrupted sweep (--work)
        return json.loads(done.read_text())
    ckpt.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(replicas):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ADAPTDL_", "STRATAGEM_", "RANK", "WORLD_SIZE",
                                    "MASTER_", "LOCAL_"))}
        env.update(ADAPTDL_MASTER_ADDR="127.0.0.1", ADAPTDL_MASTER_PORT=str(port),
                   ADAPTDL_NUM_REPLICAS=str(replicas), ADAPTDL_REPLICA_RANK=str(rank),
                   ADAPTDL_CHECKPOINT_PATH=str(ckpt), ADAPTDL_JOB_ID=tag,
                   STRATAGEM_VERBOSE="0", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=str(HERE.parents[1] / "src") if system == "stratagem" else "")
        procs.append(subprocess.Popen(
            [python, str(HERE), "--worker", system, str(seed), str(epochs),
             str(int(autoscale)), str(out), str(train), str(lr), str(label_noise)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        return {"error": "\n".join(t[-2000:] for t in logs), "seconds":
                time.monotonic() - started}
    result = {**json.loads(out.read_text()), "seconds": time.monotonic() - started}
    done.write_text(json.dumps(result))
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    """The tests of one configuration: ``runs`` maps system -> its runs."""
    acc = {s: [r["accuracy"] for r in rs if "accuracy" in r] for s, rs in runs.items()}
    div = {s: sum(bool(r.get("diverged")) for r in rs) for s, rs in runs.items()}
    n = {s: len(rs) for s, rs in runs.items()}
    u, p = mann_whitney(acc["stratagem"], acc["adaptdl"])
    p_div = fisher_exact(div["stratagem"], n["stratagem"], div["adaptdl"], n["adaptdl"])
    return {"accuracy": acc, "diverged": div, "runs": n,
            "median": {s: statistics.median(v) for s, v in acc.items() if v},
            "mean": {s: statistics.fmean(v) for s, v in acc.items() if v},
            "std": {s: statistics.stdev(v) if len(v) > 1 else 0.0 for s, v in acc.items()},
            "mann_whitney_u": u, "p_accuracy": p, "p_diverged": p_div,
            "same_at_5pct": p >= 0.05 and p_div >= 0.05}


def batch_growth(runs: dict[str, list[dict]]) -> dict:
    """Per system: how many runs grew the batch past the initial one, the largest batch
    each reached, and the first epoch each trained at a larger batch (None: never)."""
    out = {}
    for system, rs in runs.items():
        largest, first = [], []
        for r in rs:
            # current_batch_size: a step's total over replicas and micro-batches
            sizes = [max(d["batch_sizes"]) for d in r.get("decisions", [])]
            largest.append(max(sizes, default=BATCH))
            first.append(next((i for i, b in enumerate(sizes) if b > BATCH), None))
        out[system] = {"grew": sum(b > BATCH for b in largest), "runs": len(rs),
                       "largest_batch": largest, "first_epoch_grown": first}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        system, seed, epochs, autoscale, out, train, lr, noise = sys.argv[2:10]
        worker(system, int(seed), int(epochs), autoscale == "1", out, int(train), float(lr),
               float(noise))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adaptdl-python", default="/work/adaptdl-venv/bin/python")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train", type=int, default=TRAIN, help="training images")
    parser.add_argument("--lr", type=float, default=LR, help="SGD learning rate")
    parser.add_argument("--label-noise", type=float, default=0.0,
                        help="fraction of training images with a random label")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--autoscale", default="0,1", help="0: without, 1: with")
    parser.add_argument("--out", default=str(HERE.parent / "results" / "adaptdl_seeds.json"))
    parser.add_argument("--work", default=None,
                        help="run directory; runs finished there before are reused")
    parser.add_argument("--reverse", action="store_true",
                        help="seeds from the last down (a second sweep on the same --work)")
    args = parser.parse_args()
    work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"seeds-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    suffix = variant(args.train, args.epochs, args.lr, args.label_noise)
    setup = {"train": args.train, "test": TEST, "batch": BATCH, "lr": args.lr,
             "label_noise": args.label_noise,
             "epochs": args.epochs, "seeds": args.seeds,
             "order": "training set permuted by the seed on both systems",
             "shuffle": os.environ.get("SEEDS_SHUFFLE", "1") == "1"}
    out = Path(args.out)
    # Configurations of other setups already in --out stay (each under its own key, with
    # its setup); those of this setup are replaced.
    result: dict = json.loads(out.read_text()) if out.exists() else {}
    if suffix:
        result.setdefault("configs", {})
        result.setdefault("sweeps", {})[suffix[1:]] = {
            **setup, "load_before": os.getloadavg()}
    else:
        result = {**{k: v for k, v in result.items() if k == "configs"},
                  "load_before": os.getloadavg(), "setup": setup}
        result.setdefault("configs", {})
    for replicas in (int(r) for r in args.replicas.split(",")):
        for autoscale in (a == "1" for a in args.autoscale.split(",")):
            runs: dict[str, list[dict]] = {"adaptdl": [], "stratagem": []}
            order = range(args.seeds)[::-1] if args.reverse else range(args.seeds)
            for seed in order:  # interleaved: the load drifts for both alike
                for system, python in (("adaptdl", args.adaptdl_python),
                                       ("stratagem", sys.executable)):
                    runs[system].append(run_once(python, system, replicas, seed,
                                                 args.epochs, autoscale, work,
                                                 train=args.train, lr=args.lr,
                                                 label_noise=args.label_noise))
                    last = runs[system][-1]
                    print(f"  r{replicas} a{int(autoscale)} seed {seed} {system}: "
                          f"accuracy {last.get('accuracy')}, {last['seconds']:.0f} s",
                          flush=True)
                    errors = [r["error"] for r in runs[system] if "error" in r]
                    if errors:
                        raise SystemExit(f"{system} failed:\n{errors[0]}")
            key = (f"replicas={replicas},autoscale={autoscale}"
                   + suffix.replace("-", ","))
            summary = summarize(runs)
            result["configs"][key] = {**summary, "setup": setup,
                                      "load_after": os.getloadavg(), "runs_detail": runs}
            if autoscale:
                result["configs"][key]["batch_growth"] = batch_growth(runs)
            print(f"{key}: median accuracy stratagem {summary['median']['stratagem']:.3f} "
                  f"adaptdl {summary['median']['adaptdl']:.3f}, p={summary['p_accuracy']:.3f}; "
                  f"diverged {summary['diverged']}, p={summary['p_diverged']:.3f}",
                  flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
    result["load_after"] = os.getloadavg()
    result["summary"] = {k: v["same_at_5pct"] for k, v in result["configs"].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
