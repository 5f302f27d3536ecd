"""Scheduling hints: the JSON file and the loopback HTTP endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration_workers import regression_data, train
from torch import nn

import stratagem as sg
from stratagem.adapt import HintsPublisher
from stratagem.adapt.hints import ENV_HINTS_FILE, ENV_HINTS_PORT
from stratagem.elastic import drop_job, state


@pytest.fixture(autouse=True)
def fresh_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "STRATAGEM_CHECKPOINT_DIR", "ADAPTDL_CHECKPOINT_PATH", ENV_HINTS_PORT,
                ENV_HINTS_FILE):
        monkeypatch.delenv(var, raising=False)
    yield


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"] == "application/json"
        return json.loads(response.read())


def test_publisher_file_and_http_endpoint(tmp_path: Path) -> None:
    pub = HintsPublisher(tmp_path / "hints.json", port=0)
    try:
        assert pub.url is not None and pub.url.startswith("http://127.0.0.1:")
        assert get(pub.url) == {}
        pub.publish({"version": 1, "batch": {"current": {"global_bsz": 64}}})
        served = get(pub.url)
        assert served["batch"]["current"]["global_bsz"] == 64
        assert served["endpoint"] == pub.url
        assert json.loads((tmp_path / "hints.json").read_text()) == served
        with pytest.raises(urllib.error.HTTPError):
            get(pub.url.replace("/hints", "/other"))
    finally:
        pub.close()
    pub.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        get(pub.url or "http://127.0.0.1:1/hints")


def test_other_ranks_publish_nothing(tmp_path: Path) -> None:
    pub = HintsPublisher(tmp_path / "hints.json", port=0, enabled=False)
    pub.publish({"version": 1})
    assert pub.url is None and not (tmp_path / "hints.json").exists()


def test_training_job_publishes_its_hints(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HINTS_FILE, str(tmp_path / "job-hints.json"))
    monkeypatch.setenv(ENV_HINTS_PORT, "0")
    ad = sg.AutoDist(verbose=False)
    model = nn.Linear(6, 1)
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.01)
    model, opt = ad.distribute(model, opt)
    loader = ad.data_loader(regression_data(1024, noise=5.0), batch_size=32, shuffle=True)
    loader.autoscale_batch_size(256, (8, 64), gradient_accumulation=True)
    for _ in ad.remaining_epochs_until(1):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    on_disk = json.loads((tmp_path / "job-hints.json").read_text())
    try:
        served = get(ad.adaptive.hints.url)
    finally:
        ad.adaptive.hints.close()
    assert served == on_disk
    assert on_disk["version"] == 1
    assert on_disk["allocation"] == {"num_nodes": 1, "num_replicas": 1}
    batch = on_disk["batch"]
    assert batch["base_batch_size"] == 32 and batch["max_batch_size"] == 256
    assert batch["local_bsz_bounds"] == [8, 64] and batch["gradient_accumulation"]
    assert batch["current"]["global_bsz"] == loader.batch_size
    assert set(on_disk["throughput_params"]) == {"alpha_c", "beta_c", "alpha_r", "beta_r",
                                                 "alpha_n", "beta_n", "gamma"}
    grad = on_disk["gradient"]
    assert grad["var"] > 0 and grad["noise_scale"] == pytest.approx(grad["var"] /
                                                                    grad["sqr_norm"])
    assert on_disk["goodput"]["goodput"] > 0 and on_disk["profile"][0]["count"] > 0
    assert on_disk["scaling_rule"] == "AdaScale" and on_disk["progress"]["steps"] > 0


def test_adaptive_state_survives_a_restart(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(state.ENV_CHECKPOINT_DIR, str(tmp_path / "ckpt"))
    auto = {"max_batch_size": 256, "local_bsz_bounds": (8, 64), "gradient_accumulation": True}
    train(None, batch_size=32, data=regression_data(1024, noise=5.0), autoscale=auto)
    ad_state = state.registered_states()["adapt"].state_dict()
    sg.adapt.save_all_states()
    drop_job()
    resumed = train(0, batch_size=32, data=regression_data(1024, noise=5.0), autoscale=auto,
                    epochs=1)
    assert resumed["steps"] == ad_state["steps"]
    assert resumed["progress"] == pytest.approx(ad_state["tracker"]["progress"])
    assert resumed["updates"] == ad_state["gns"]["updates"]
