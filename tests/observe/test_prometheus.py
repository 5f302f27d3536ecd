"""The hints server's ``GET /metrics``: the hints document's numbers as Prometheus text."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from stratagem.adapt.hints import HintsPublisher, prometheus_text

HINTS = {"allocation": {"num_nodes": 1, "num_replicas": 2},
         "batch": {"current": {"global_bsz": 256, "local_bsz": 64, "accum_steps": 1}},
         "lr_factor": 3.5, "gain": 3.2, "gradient": {"noise_scale": 1700.0},
         "goodput": {"goodput": 4300.0, "efficiency": 0.83, "throughput": 5200.0},
         "epoch": 3, "time": 1.5e9}


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split(" ")
            out[name] = float(value)
    return out


def test_gauges_carry_the_document_values() -> None:
    text = prometheus_text(HINTS)
    assert _samples(text) == {
        "stratagem_replicas": 2, "stratagem_nodes": 1, "stratagem_global_batch_size": 256,
        "stratagem_local_batch_size": 64, "stratagem_accumulation_steps": 1,
        "stratagem_lr_factor": 3.5, "stratagem_gain": 3.2,
        "stratagem_gradient_noise_scale": 1700.0, "stratagem_goodput": 4300.0,
        "stratagem_efficiency": 0.83, "stratagem_throughput": 5200.0, "stratagem_epoch": 3,
        "stratagem_hints_time_seconds": 1.5e9}
    assert text.count("# TYPE ") == 13 and "# HELP stratagem_goodput " in text


def test_unknown_values_are_left_out() -> None:
    samples = _samples(prometheus_text({"lr_factor": 1.0, "goodput": None,
                                        "gradient": {"noise_scale": float("inf")}}))
    assert samples == {"stratagem_lr_factor": 1.0}


@pytest.mark.timeout(60)
def test_served_at_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATAGEM_HINTS_PORT", raising=False)
    pub = HintsPublisher(tmp_path / "hints.json", port=0)
    try:
        pub.publish(HINTS)
        url = pub.url.rsplit("/", 1)[0] + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert _samples(response.read().decode())["stratagem_goodput"] == 4300.0
    finally:
        pub.close()
