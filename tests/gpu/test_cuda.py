"""Training on a GPU: the runtime's synchronizers with CUDA tensors, the planner calibrating
on the GPU, and a user's AutoDist script in a GPU job, against single-process training on
the CPU. Skipped without CUDA (CI has none; run where a GPU is lent:
``python -m pytest tests/gpu``)."""

from __future__ import annotations

import _spawn
import gpu_workers as gw
import pytest
import torch

from stratagem.analysis import analyze
from stratagem.distributed.process_group import GPU_BACKEND
from stratagem.planner import choose
from stratagem.planner.calibrate import calibrate
from stratagem.strategy import (
    PS,
    AllReduce,
    Parallax,
    UnevenPartitionedPS,
)

pw = gw.pw
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def built(builder: object, name: str) -> str:
    model = pw.make(name)
    return builder.build(analyze(model), gw.gpu_nodes()).to_json()  # type: ignore[attr-defined]


def auto(name: str, bandwidth: float | None) -> str:
    """Auto's strategy, calibrated on the GPU (1 Mbit/s links: the sampled rows go as rows)."""
    model = pw.make(name).to(gw.CUDA)
    (inputs, _), half = pw.batch(name, 0), pw.BATCH // 2
    sample = (tuple(t[:half].to(gw.CUDA) for t in inputs) if name == "dense"
              else (inputs[0][:half].to(gw.CUDA), inputs[1].to(gw.CUDA)))
    return choose(model, gw.gpu_nodes(bandwidth), sample_input=sample).strategy.to_json()


def cases(backend: str) -> dict[str, tuple[str, str, str]]:
    spec = "auto" if backend == "nccl" else "gloo"  # auto: NCCL for CUDA tensors
    fp16 = built(AllReduce(compressor="fp16"), "dense")
    got = {
        "dense/AllReduce": ("dense", built(AllReduce(), "dense")),
        "dense/AllReduce-fp16": ("dense", fp16),
        "dense/PS": ("dense", built(PS(), "dense")),
        "dense/UnevenPartitionedPS": ("dense", built(UnevenPartitionedPS(), "dense")),
        "sampled/rows": ("sampled", gw.on_gpus(pw.rows_strategy().to_json())),
        "sampled/Parallax": ("sampled", built(Parallax(), "sampled")),
        "auto/sampled": ("sampled", auto("sampled", 0.001)),
        "auto/dense": ("dense", auto("dense", None)),
    }
    out = {case: (name, gw.all_reduce_with(s, spec), "cuda:0") for case, (name, s)
           in got.items()}
    out["cpu/AllReduce-fp16"] = ("dense", gw.all_reduce_with(
        fp16.replace(":GPU:0", ":CPU:0"), "auto"), "cpu")
    return out


@pytest.fixture(scope="module", params=["nccl", "gloo"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, list[dict]]:
    backend = request.param
    default = GPU_BACKEND if backend == "nccl" else "gloo"
    return backend, _spawn.run(gw.suite, 2, tmp_path_factory.mktemp(f"cuda_{backend}"),
                               {"backend": default, "cases": cases(backend)},
                               _spawn.Setup(args=(2,), local_rank=True,
                                            roles=("worker",) * 2))


CASES = ["dense/AllReduce", "dense/PS", "dense/UnevenPartitionedPS", "sampled/rows",
         "sampled/Parallax", "auto/sampled", "auto/dense"]


@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(trained: tuple[str, list[dict]], case: str) -> None:
    backend, ranks = trained
    name = case.split("/")[0] if not case.startswith("auto") else case.split("/")[1]
    want = pw.reference(name)
    for rank in ranks:
        got = rank[case]
        assert got["devices"] == ["cuda:0"], got["devices"]
        if "AllReduce" in case:
            assert got["backends"] == [backend], got["backends"]
        for k, v in want.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-6, atol=1e-9,
                                       msg=f"{backend} {case}: {k}")


def test_fp16_on_gpu_as_on_cpu(trained: tuple[str, list[dict]]) -> None:
    """The fp16 compressor rounds CUDA gradients as it rounds CPU ones."""
    backend, ranks = trained
    for rank in ranks:
        gpu, cpu = rank["dense/AllReduce-fp16"]["state"], rank["cpu/AllReduce-fp16"]["state"]
        for k, v in cpu.items():
            torch.testing.assert_close(gpu[k], v, rtol=1e-6, atol=1e-9, msg=f"{backend}: {k}")


def test_calibration_times_the_gpu() -> None:
    """A pass on the GPU is timed to its end (synchronized), and cached apart from the same
    model's CPU calibration."""
    model = pw.make("dense")
    x = pw.batch("dense", 0)[0][0]
    on_cpu = calibrate(model, x, use_cache=True)
    model.to(gw.CUDA)
    on_gpu = calibrate(model, x.to(gw.CUDA), use_cache=True)
    assert on_gpu is not on_cpu
    assert on_gpu.forward_s > 0 and on_gpu.backward_s > 0


@pytest.mark.parametrize(("stats", "starve"), [(False, False), (True, False), (False, True)],
                         ids=["sample", "first-batch-stats", "no-room-for-trials"])
def test_autodist_script_in_a_gpu_job(tmp_path: pytest.TempPathFactory, stats: bool,
                                      starve: bool) -> None:
    """AutoDist with Auto on two GPU workers: a ``cpu:gloo,cuda:nccl`` default group (the
    planner's CPU control tensors and NCCL's CUDA ones), calibration together, the link
    probe and trial steps of copies on the GPU in the job; trains to single-process
    training's parameters. ``first-batch-stats``: planned on the first training batch (the
    model switching strategies on the GPU), all-reduce kept for the gradient statistics.
    ``no-room-for-trials``: one rank cannot fit a copy, so neither times any."""
    ranks = _spawn.run(gw.autodist_case, 2, tmp_path, {"stats": stats, "starve": starve},
                       _spawn.Setup(args=(2,)))
    want = pw.reference("sampled")
    for rank in ranks:
        assert rank["device"] == "cuda:0"
        assert "nccl" in rank["backend"] and "gloo" in rank["backend"], rank["backend"]
        assert rank["probed"] and rank["forward_s"] > 0
        if starve:
            assert rank["trials"] == 0
            assert any("does not fit" in n for n in rank["notes"]), rank["notes"]
        else:
            assert rank["trials"] >= 2, rank["notes"]
        for k, v in want.items():
            torch.testing.assert_close(rank["state"][k], v, rtol=1e-6, atol=1e-9, msg=k)
        assert not (stats and rank["ps"]), rank["strategy"]
    assert ranks[0]["strategy"] == ranks[1]["strategy"]
