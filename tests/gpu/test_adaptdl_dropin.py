"""The AdaptDL drop-in on a GPU: tests/adaptdl's CIFAR-style script, written against AdaptDL
with only its imports changed, asks for ``init_process_group("nccl")`` where CUDA is
available. Its replicas share the one GPU lent (tests/gpu/share_one_gpu). Skipped without
CUDA (run where a GPU is lent: ``python -m pytest tests/gpu``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adaptdl"))
import test_cifar_style as chain  # noqa: E402
from adaptdl_harness import finish, logs, standalone, stats, steps  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def devices(out: Path) -> set[str]:
    return {r["device"] for recs in steps(out).values() for r in recs}


def test_restart_chain_on_the_gpu(tmp_path: Path) -> None:
    """Two replicas on the NCCL group the script asks for (gloo beside it for CPU tensors;
    two AdaptDL nodes of one GPU each) stopped by SIGTERM mid-epoch, one under ``stratagem
    run``, two under ``torchrun --nnodes 2`` without a resource spec: every sample once per
    epoch, the epoch totals kept, the final model equal to single-process training on the
    CPU."""
    out = chain.restart_chain(tmp_path, gpu=True)
    assert devices(out) == {"cuda:0"}


def test_two_replicas_autoscale_on_the_gpu(tmp_path: Path) -> None:
    """Batch-size autoscaling on two GPU replicas: the gradient statistics all-reduced over
    NCCL, the decisions broadcast on the gloo control group; AdaptDL's progress epochs (a
    first pass without repeats) and the synchronized totals equal to the samples the
    replicas logged."""
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "run.log"
    args = ["--out", str(out), "--epochs", "2", "--autoscale-bsz"]
    codes = finish(standalone(2, tmp_path / "ckpt", args, log, gpu=True, nodes=2), out)
    assert codes == [0, 0], logs(log)[-3000:]
    assert devices(out) == {"cuda:0"}
    chain.check_progress_epochs(out, 2)
    per_epoch = [sum(len(r["ids"]) for recs in steps(out).values() for r in recs
                     if r["epoch"] == e) for e in range(2)]
    assert [s["total"] for s in stats(out) if s["phase"] == "train"] == per_epoch


def test_auto_on_the_scripts_nccl_group_calibrates_and_probes(tmp_path: Path) -> None:
    """``stratagem run --strategy Auto`` (``STRATAGEM_STRATEGY``) on two GPU replicas whose
    script asks for ``"nccl"``: the group has gloo beside NCCL, so Auto plans on the first
    batch with the ranks' calibration and a measured link probe (a group of NCCL alone
    skips both), and every sample is trained once."""
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "run.log"
    args = ["--out", str(out), "--epochs", "1"]
    extra = {"STRATAGEM_STRATEGY": "Auto", "STRATAGEM_LOG_LEVEL": "debug"}
    codes = finish(standalone(2, tmp_path / "ckpt", args, log, gpu=True, nodes=2,
                              extra=extra), out)
    text = logs(log)
    assert codes == [0, 0], text[-3000:]
    print("\n".join(line for line in text.splitlines() if "Auto" in line or "link" in line))
    assert devices(out) == {"cuda:0"}
    chain.check_every_sample_once(out)
    assert "Auto chose" in text and "calibrated in" in text, text[-3000:]
    assert "links measured" in text, text[-3000:]  # the explanation, logged at debug level


def test_single_replica_plain_python_on_the_gpu(tmp_path: Path) -> None:
    """One replica, no launcher: the script's ``nccl`` group of one on the GPU (gloo beside
    it)."""
    from adaptdl_harness import SCRIPT, SCRIPTS, base_env

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--epochs", "1"],
                          env=base_env(tmp_path / "ckpt", gpu=True), cwd=SCRIPTS,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert devices(out) == {"cuda:0"}
    chain.check_every_sample_once(out)


def test_a_model_on_the_gpu_is_not_moved_to_the_cpu_behind_the_scripts_back() -> None:
    """A spec that gives the worker no GPU, a model the script put on the GPU: a clear error
    from ``distribute`` (before, the model went back to the CPU and the script's GPU batches
    failed in the forward)."""
    import stratagem as sg
    from stratagem.errors import StratagemError
    from stratagem.resource import ResourceSpec

    spec = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "cpus": [0]}]})
    ad = sg.AutoDist(resource_spec=spec, strategy_builder="AllReduce", verbose=False)
    model = torch.nn.Linear(4, 2).cuda()
    with pytest.raises(StratagemError, match="the model is on cuda:0 but this worker trains "
                                             "on the CPU"):
        ad.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert next(model.parameters()).device.type == "cuda"
