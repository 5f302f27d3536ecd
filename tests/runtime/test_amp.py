"""Issue 10 section 6: bf16 autocast and a GradScaler with every strategy family, against
one process (runtime/amp.py). One rank's infinite embedding gradient must skip the step on
every rank and owner, as one process skips it."""

from __future__ import annotations

import amp_workers
import pytest
import torch
from ps_common import spawn_ps

RTOL, ATOL = 2e-2, 2e-3  # bf16 forwards over half batches vs the whole batch
CASES = list(amp_workers.BUILDERS)


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ps(amp_workers.suite, 2, 0, tmp_path_factory.mktemp("amp_w2"), cases=CASES)


@pytest.fixture(scope="module")
def w2s2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_ps(amp_workers.suite, 2, 2, tmp_path_factory.mktemp("amp_w2s2"),
                    cases=["partitioned_ps", "parallax", "parallax-ddp"])


def _workers(results: list[dict], case: str) -> list[dict]:
    out = []
    for r in results:
        res = r[case]
        if "__error__" in res:
            raise AssertionError(res["__error__"])
        if not res.get("server"):
            out.append(res)
    return out


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[k], want[k], rtol=RTOL, atol=ATOL) for k in want)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", ["w2", "w2s2"])
def test_scaler_skips_on_every_rank_and_matches_one_process(
        config: str, case: str, request: pytest.FixtureRequest) -> None:
    if config == "w2s2" and case not in ("partitioned_ps", "parallax", "parallax-ddp"):
        pytest.skip("dedicated servers: parameter-server strategies only")
    workers = _workers(request.getfixturevalue(config), case)
    want = amp_workers.reference(case)
    for w in workers:
        # the skip at INF_STEP halves the scale on every rank, as in one process
        assert w["scales"] == want["scales"], (w["scales"], want["scales"])
        assert w["scales"][amp_workers.INF_STEP] < w["scales"][amp_workers.INF_STEP - 1]
        for v in w["state"].values():
            assert torch.isfinite(v).all()
        for v in w["sync"].values():  # PowerSGD's error feedback was not poisoned
            assert torch.isfinite(v.double()).all()
    for k in workers[0]["state"]:  # all workers hold the same values
        torch.testing.assert_close(workers[0]["state"][k], workers[1]["state"][k], msg=k)
    if case in ("powersgd", "powersgd-ddp"):
        return  # (a rank-1 approximation: no one-process equivalent)
    assert _close(workers[0]["state"], want["state"]), {
        k: float((workers[0]["state"][k] - want["state"][k]).abs().max()) for k in want["state"]}
    # the comparison can fail: not skipping the step ends elsewhere
    assert not _close(amp_workers.reference(case, poison=False)["state"], want["state"])


@pytest.mark.parametrize("case", ["allreduce", "allreduce-fp16", "powersgd", "parallax",
                                  "allreduce-ddp", "allreduce-ddp-fp16", "powersgd-ddp",
                                  "parallax-ddp"])
def test_gradient_statistics_see_unscaled_gradients(case: str, w2: list[dict]) -> None:
    """AdaScale's gain comes from the gradient observers: what they see, divided by the
    scale they are given, is the unscaled gradient (the scaler's own unscale_ result)."""
    for w in _workers(w2, case):
        steps = [i for i in range(amp_workers.STEPS) if i != amp_workers.INF_STEP]
        if case in ("allreduce", "allreduce-fp16", "allreduce-ddp", "allreduce-ddp-fp16"):
            # every parameter is all-reduced
            for i in steps:
                assert w["observed"][i] == pytest.approx(w["grads"][i], rel=1e-3)
        for i in steps:  # about 1, not the loss scale squared (2^24)
            assert 0 < w["observed"][i] < 1e3
