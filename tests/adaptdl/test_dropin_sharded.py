"""The AdaptDL drop-in on a sharded strategy (issue 45 item 4): an AdaptDL script run
with ``--strategy ZeRO`` (stage 3, FSDP2) reports the same gradient statistics after every
step as on the default all-reduce, and trains the same parameters."""

from __future__ import annotations

from pathlib import Path

import dropin_workers as w
import pytest
import torch
from _spawn import Setup, run

UNSET = ("ADAPTDL_MASTER_ADDR", "ADAPTDL_MASTER_PORT", "ADAPTDL_NUM_REPLICAS",
         "ADAPTDL_REPLICA_RANK", "STRATAGEM_CHECKPOINT_DIR", "STRATAGEM_STRATEGY")


def _trace(tmp_path: Path, strategy: str) -> list[dict]:
    out = tmp_path / (strategy or "default")
    return run(w.statistics_trace, 2, out, {"ckpt": str(out / "ckpt"), "strategy": strategy},
               Setup(args=(2,), unset=UNSET))


@pytest.mark.slow
def test_zero_reports_the_statistics_of_all_reduce(tmp_path: Path) -> None:
    plain, sharded = _trace(tmp_path, "AllReduce"), _trace(tmp_path, "ZeRO")
    assert not plain[0]["sharded"] and all(r["sharded"] for r in sharded)
    want = plain[0]["trace"]
    assert sum(1 for s, v in want if v > 0) > 5  # measured on most steps
    for r in sharded:
        assert len(r["trace"]) == len(want)
        for step, (got, ref) in enumerate(zip(r["trace"], want, strict=True)):
            assert got == pytest.approx(ref, rel=1e-4, abs=1e-9), step
        for k, v in plain[0]["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_the_hand_driven_noise_scale_refuses_sharded_gradients() -> None:
    """AdaptDL's standalone GradientNoiseScale sums ``p.grad`` as if whole: on a sharded
    model it is refused, naming the statistics that do see sharded gradients."""
    from types import SimpleNamespace

    from stratagem.adaptdl.torch.gradient_noise_scale import GradientNoiseScale
    from stratagem.errors import StratagemError

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adp = SimpleNamespace(sharded=True, require_backward_grad_sync=True)
    with pytest.raises(StratagemError, match="shards them") as info:
        GradientNoiseScale(adp, opt, num_replicas=2)
    assert "model.gns" in info.value.fix
    GradientNoiseScale(SimpleNamespace(sharded=False, require_backward_grad_sync=True), opt,
                       num_replicas=1)
