"""Mixed precision on the GPU: bf16 autocast on CUDA and ``torch.amp.GradScaler("cuda")``
with the all-reduce and parameter-server families, two workers sharing the one GPU over
NCCL (``cpu:gloo,cuda:nccl``). One rank's infinite embedding gradient must skip the step on
every rank, as one process on the GPU skips it (tests/runtime/test_amp.py's cases, on the
CPU there). Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
import amp_workers  # noqa: E402
from ps_common import spawn_ps  # noqa: E402
from test_amp import _close, _workers  # noqa: E402

from stratagem.distributed.process_group import GPU_BACKEND  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = ["allreduce", "allreduce-fp16", "partitioned_ps", "parallax"]


@pytest.fixture(scope="module")
def on_gpu(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ps(amp_workers.suite, 2, 0, tmp_path_factory.mktemp("amp_gpu"), cases=CASES,
                    device="cuda", backend=GPU_BACKEND)


@pytest.mark.parametrize("case", CASES)
def test_the_scaler_skips_on_every_rank_and_matches_one_gpu_process(
        case: str, on_gpu: list[dict]) -> None:
    workers = _workers(on_gpu, case)
    want = amp_workers.reference(case, device="cuda")
    for w in workers:
        assert w["scales"] == want["scales"], (w["scales"], want["scales"])
        assert w["scales"][amp_workers.INF_STEP] < w["scales"][amp_workers.INF_STEP - 1]
        for v in w["state"].values():
            assert torch.isfinite(v).all()
    for k in workers[0]["state"]:
        torch.testing.assert_close(workers[0]["state"][k], workers[1]["state"][k], msg=k)
    assert _close(workers[0]["state"], want["state"]), {  # (test_amp's bf16 tolerances)
        k: float((workers[0]["state"][k] - want["state"][k]).abs().max())
        for k in want["state"]}
    assert not _close(amp_workers.reference(case, poison=False, device="cuda")["state"],
                      want["state"])
