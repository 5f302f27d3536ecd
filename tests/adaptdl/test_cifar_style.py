"""An AdaptDL script, with only its imports changed, trains on Stratagem.

The chain: 2 replicas started AdaptDL-standalone (ADAPTDL_* variables) and stopped by SIGTERM
inside step 3 (epoch 0); 1 replica under ``stratagem run``, stopped inside step 10 (epoch 1);
2 replicas under ``torchrun`` to the end. Every sample is trained exactly once per epoch, the
Accumulator's epoch totals survive the restarts, and the final model equals plain
single-process training. A single replica also runs under plain ``python`` with
``--autoscale-bsz``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adaptdl_harness import (
    SCRIPT,
    SCRIPTS,
    finish,
    launcher,
    logs,
    standalone,
    stats,
    steps,
    torchrun_nodes,
)

from stratagem import checkpoint
from stratagem.data import epoch_permutation

sys.path.insert(0, str(SCRIPTS))
from cifar_models import Net, SyntheticImages  # noqa: E402

N, BS, EPOCHS, VALID = 96, 16, 4, 32
STEPS_PER_EPOCH = N // BS


def reference() -> dict[str, torch.Tensor]:
    """The same training in one process with plain torch."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD([{"params": [p]} for p in net.parameters()], lr=0.1, momentum=0.9,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 3], 0.1)
    data = SyntheticImages(N, seed=1)
    for epoch in range(EPOCHS):
        order = epoch_permutation(N, epoch, 0, shuffle=True)
        for start in range(0, N - BS + 1, BS):
            idx = order[start:start + BS]
            opt.zero_grad()
            F.cross_entropy(net(data.x[idx]), data.y[idx]).backward()
            opt.step()
        sched.step()
    return net.state_dict()


def check_every_sample_once(out: Path, drop_last_ok: bool = False) -> dict[int, int]:
    """Each epoch's steps cover the dataset exactly once (``drop_last_ok``: at most once,
    the rest left for ``drop_last``); returns step -> world size."""
    seen: dict[int, list[int]] = {}
    worlds = {}
    for step, recs in sorted(steps(out).items()):
        worlds[step] = recs[0]["world"]
        assert sorted(r["rank"] for r in recs) == list(range(worlds[step])), f"step {step}"
        seen.setdefault(recs[0]["epoch"], []).extend(i for r in recs for i in r["ids"])
    for epoch, ids in seen.items():
        if drop_last_ok:
            assert len(set(ids)) == len(ids), f"epoch {epoch}: samples repeated"
        else:
            assert sorted(ids) == list(range(N)), f"epoch {epoch}: samples lost or repeated"
    return worlds


def check_progress_epochs(out: Path, epochs: int) -> None:
    """AdaptDL's autoscaled epoch runs on scale-invariant progress, so it may take more than
    one pass (and one step more than the target): each epoch starts with a pass without a
    repeated sample, short of at most a remainder that drop_last leaves at a larger batch."""
    by_epoch: dict[int, list[list[int]]] = {}
    for _step, recs in sorted(steps(out).items()):
        by_epoch.setdefault(recs[0]["epoch"], []).append([i for r in recs for i in r["ids"]])
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, batches in by_epoch.items():
        seen: set[int] = set()
        for batch in batches:
            if seen & set(batch):
                break
            seen |= set(batch)
        assert len(seen) > N - max(len(b) for b in batches), f"epoch {epoch}"


def test_only_the_imports_differ_from_the_adaptdl_script() -> None:
    text = SCRIPT.read_text()
    original = text.replace("from stratagem import adaptdl", "import adaptdl")
    original = re.sub(r"\bstratagem\.adaptdl\b", "adaptdl", original)
    changed = [(a, b) for a, b in zip(text.splitlines(), original.splitlines(), strict=True)
               if a != b]
    assert changed and all(re.match(r"(import|from) ", a) for a, _ in changed), changed
    assert "stratagem" not in original


def restart_chain(tmp_path: Path, gpu: bool = False) -> Path:
    """Run the chain, check it, return its log directory. ``gpu``: on the machine's one GPU,
    the two-replica runs as two nodes of one GPU each (AdaptDL's ``ADAPTDL_NUM_NODES``,
    then ``torchrun --nnodes 2``), compared with the CPU reference at float32 tolerances."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["--out", str(out)]
    log = tmp_path / "run1.log"
    codes = finish(standalone(2, ckpt, [*args, "--stop-at", "3"], log, gpu=gpu,
                              nodes=2 if gpu else None), out, stop=2)
    assert codes == [143, 143], logs(log)[-3000:]
    log = tmp_path / "run2.log"
    codes = finish(launcher("stratagem", 1, ckpt, [*args, "--stop-at", "10"], log, gpu=gpu),
                   out, stop=1)
    newest = checkpoint.CheckpointDir(ckpt).checkpoints()[-1]
    assert checkpoint.read_meta(newest)["world_size"] == 1, logs(log)[-3000:]
    log = tmp_path / "run3.log"
    last = (torchrun_nodes(2, ckpt, args, log, gpu=True) if gpu else
            launcher("torchrun", 2, ckpt, args, log))
    codes = finish(last, out)
    assert codes == [0] * len(last), logs(log)[-3000:]

    worlds = check_every_sample_once(out)
    assert list(worlds.values()) == [2] * 3 + [1] * 7 + [2] * 14
    got = [(s["epoch"], s["phase"], s["total"]) for s in stats(out)]
    assert got == [(e, p, N if p == "train" else VALID)
                   for e in range(EPOCHS) for p in ("train", "valid")]
    final = torch.load(out / "final.pt", weights_only=True, map_location="cpu")
    assert final["steps"] == EPOCHS * STEPS_PER_EPOCH
    rtol, atol = (1e-3, 1e-4) if gpu else (1e-4, 1e-6)
    for name, want in reference().items():
        torch.testing.assert_close(final["model"][name], want, rtol=rtol, atol=atol, msg=name)
    return out


@pytest.mark.slow
def test_restart_chain_standalone_stratagem_run_torchrun(tmp_path: Path) -> None:
    out = restart_chain(tmp_path)
    assert {r["device"] for recs in steps(out).values() for r in recs} == {"cpu"}


@pytest.mark.slow
def test_single_replica_plain_python_with_autoscale(tmp_path: Path) -> None:
    import subprocess

    from adaptdl_harness import base_env

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--epochs", "2",
                           "--autoscale-bsz"], env=base_env(tmp_path / "ckpt"), cwd=SCRIPTS,
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check_progress_epochs(out, 2)
    per_epoch = [sum(len(r["ids"]) for recs in steps(out).values() for r in recs
                     if r["epoch"] == e) for e in range(2)]
    assert [s["total"] for s in stats(out) if s["phase"] == "train"] == per_epoch
