"""The seed-comparison harness of bench/adaptdl_seeds.py (issue 48 item 4): its tests
against known answers, and one drop-in run (AdaptDL itself is not installed here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import adaptdl_seeds as seeds  # noqa: E402


def test_mann_whitney_exact_known_answers() -> None:
    # completely separated samples of 3 and 3: 2 of the C(6,3) = 20 splits are as extreme
    assert seeds.mann_whitney([1, 2, 3], [4, 5, 6]) == (0.0, pytest.approx(0.1))
    assert seeds.mann_whitney([5, 6, 7, 8], [1, 2, 3, 4]) == (16.0, pytest.approx(2 / 70))
    # identical samples: nothing is more extreme than the middle
    assert seeds.mann_whitney([0.5] * 4, [0.5] * 4)[1] == pytest.approx(1.0)
    # ties get midranks: a = [1, 2, 2], b = [2, 3, 4]: ranks 1, 3, 3 | 3, 5, 6
    u, p = seeds.mann_whitney([1, 2, 2], [2, 3, 4])
    assert u == pytest.approx(1.0) and 0.05 < p < 1
    with pytest.raises(ValueError):
        seeds.mann_whitney([], [1.0])


def test_fisher_exact_known_answers() -> None:
    assert seeds.fisher_exact(3, 3, 0, 3) == pytest.approx(0.1)
    assert seeds.fisher_exact(0, 8, 0, 8) == pytest.approx(1.0)
    # 3 of 5 against 1 of 5: p = 0.5238 (two-sided, tables no more likely than observed)
    assert seeds.fisher_exact(3, 5, 1, 5) == pytest.approx(0.5238, abs=1e-4)


def test_mann_whitney_exact_beyond_enumeration() -> None:
    # 12 + 12 completely separated: 2 of C(24, 12) = 2,704,156 splits are as extreme
    u, p = seeds.mann_whitney(list(range(12)), list(range(12, 24)))
    assert u == 0.0 and p == pytest.approx(2 / 2_704_156)


def test_the_training_order_follows_the_seed_with_the_same_samples() -> None:
    """Neither system's sampler takes the run's seed, so the bench permutes the dataset by
    it: the same samples, another order per seed, the same order for a seed."""
    a, b, a2 = (seeds._data(64, 1, s) for s in (0, 1, 0))
    assert torch.equal(a.tensors[0], a2.tensors[0])
    assert not torch.equal(a.tensors[1], b.tensors[1])
    key = lambda d: sorted(map(tuple, d.tensors[0].flatten(1)[:, :4].tolist()))  # noqa: E731
    assert key(a) == key(b)


def test_summary_flags_a_difference_and_accepts_equal_samples() -> None:
    same = {s: [{"accuracy": a, "diverged": False} for a in (0.5, 0.6, 0.7, 0.8)]
            for s in ("adaptdl", "stratagem")}
    assert seeds.summarize(same)["same_at_5pct"]
    worse = {"adaptdl": same["adaptdl"],
             "stratagem": [{"accuracy": a, "diverged": True} for a in (0.1, 0.1, 0.2, 0.2)]}
    out = seeds.summarize(worse)
    assert not out["same_at_5pct"] and out["diverged"] == {"adaptdl": 0, "stratagem": 4}
    assert out["p_accuracy"] == pytest.approx(2 / 70)



def test_batch_growth_reads_the_batch_of_each_epoch() -> None:
    def run(*sizes: list[int]) -> dict:
        return {"decisions": [{"batch_sizes": b, "accumulation_steps": 0} for b in sizes]}

    runs = {"adaptdl": [run([32], [32]), run([32], [256], [32])],
            "stratagem": [run([32, 96], [96]), run([32], [64], [192])]}
    out = seeds.batch_growth(runs)
    assert out["adaptdl"] == {"grew": 1, "runs": 2, "largest_batch": [32, 256],
                              "first_epoch_grown": [None, 1]}
    assert out["stratagem"] == {"grew": 2, "runs": 2, "largest_batch": [96, 192],
                                "first_epoch_grown": [0, 1]}


def test_setups_other_than_the_first_sweep_get_their_own_keys() -> None:
    assert seeds.variant(seeds.TRAIN, 4) == ""
    assert seeds.variant(4096, 16) == "-n4096-e16"
    assert seeds.variant(4096, 12, 0.02) == "-n4096-e12-lr0.02"
    assert seeds.variant(3072, 16, 0.02, 0.5) == "-n3072-e16-lr0.02-ln0.5"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_drop_in_run_trains(tmp_path: Path) -> None:
    run = seeds.run_once(sys.executable, "stratagem", 1, 0, 2, False, tmp_path, timeout=150)
    assert "error" not in run, run.get("error")
    assert not run["diverged"] and len(run["losses"]) == 2
    assert all(math.isfinite(v) for v in run["losses"])
    assert run["losses"][1] < run["losses"][0]
    assert 0.0 <= run["accuracy"] <= 1.0


def test_label_noise_relabels_that_fraction_the_same_way_each_time() -> None:
    clean = seeds._data(2000, 1, 3)
    noisy = seeds._data(2000, 1, 3, label_noise=0.5)
    again = seeds._data(2000, 1, 3, label_noise=0.5)
    assert torch.equal(clean.tensors[0], noisy.tensors[0])  # same images, same order
    assert torch.equal(noisy.tensors[1], again.tensors[1])
    changed = float((clean.tensors[1] != noisy.tensors[1]).float().mean())
    assert 0.4 < changed < 0.5  # half relabelled, a tenth of those to their own label
