"""Every shipped example runs: each strategy and spec through ``stratagem plan``, each model
planned, and each script trained briefly (one epoch) alone and under ``stratagem run``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _load import patience

from stratagem.cli import main
from stratagem.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = EXAMPLES / "models.py"

# (model in examples/models.py, spec under examples/specs or None, strategy name or file)
PLANS = {
    "mlp-local": ("mlp", "specs/local.yml", "AllReduce"),
    "mlp-two-node": ("mlp", "specs/two-node.yml", "PartitionedPS"),
    "mlp-gpu-cluster": ("mlp", "specs/gpu-cluster.yml", "PS"),
    "mixed-strategy": ("small_mlp", "specs/two-node.yml", "strategies/mlp-mixed.yaml"),
    "recommender": ("Recommender", "specs/two-node.yml", "Parallax"),
    "tiny-lm": ("TinyLM", "specs/two-node.yml", "Parallax"),  # ~200 tensors (docs' picture)
}
SCRIPTS = {"train_mlp.py": ["--epochs", "1"]}
# The cluster service's example job files (checked below) and the script its end-to-end
# tests train (tests/service); KubeRay manifests (parsed below: no Kubernetes here).
JOB_FILES = ("cluster/job-a.yaml", "cluster/job-b.yaml")
SERVICE_SCRIPT = "cluster/classify.py"
MANIFESTS = ("kuberay/raycluster.yaml", "kuberay/scheduler.yaml")


def _example(rel: str) -> str:
    return str(EXAMPLES / rel) if "/" in rel else rel


@pytest.mark.parametrize(("model", "spec", "strategy"), PLANS.values(), ids=PLANS.keys())
def test_plan_every_example(model: str, spec: str, strategy: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", f"{MODELS}:{model}", "--resource-spec", _example(spec),
                 "--strategy", _example(strategy), "--show-plan"]) == 0
    out = capsys.readouterr().out
    assert "plan for rank 0/" in out
    if strategy.endswith(".yaml"):
        assert f"strategy {Strategy.load(_example(strategy)).id} (builder manual" in out


def test_every_example_file_is_exercised() -> None:
    used = {MODELS, *(EXAMPLES / s for s in SCRIPTS)}
    used |= {EXAMPLES / rel for rel in (*JOB_FILES, SERVICE_SCRIPT, *MANIFESTS)}
    used |= {EXAMPLES / rel for plan in PLANS.values() for rel in plan[1:] if "/" in rel}
    shipped = {p for p in EXAMPLES.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped - used == set(), "add the new example to PLANS or SCRIPTS"
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_models", MODELS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factories = {name for name, obj in vars(module).items()
                 if callable(obj) and getattr(obj, "__module__", "") == "example_models"}
    assert factories - {plan[0] for plan in PLANS.values()} == set()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SCRIPTS)
def test_example_script_trains_alone_and_on_the_local_spec(name: str, tmp_path: Path) -> None:
    script, args = str(EXAMPLES / name), SCRIPTS[name]
    alone = subprocess.run([sys.executable, script, *args, "--save", str(tmp_path / "ck")],
                           capture_output=True, text=True, timeout=patience(100), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert "epoch 1/1" in alone.stdout and (tmp_path / "ck" / "meta.json").is_file()
    launched = subprocess.run(
        [sys.executable, "-m", "stratagem", "run", "--resource-spec",
         str(EXAMPLES / "specs" / "local.yml"), script, *args],
        capture_output=True, text=True, timeout=patience(100), cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert "epoch 1/1" in launched.stdout and "2 replicas" in launched.stdout


@pytest.mark.parametrize("rel", JOB_FILES)
def test_cluster_job_files_parse_and_name_the_service_script(rel: str) -> None:
    from stratagem.service.jobfile import load_job_file

    spec = load_job_file(EXAMPLES / rel)
    assert Path(spec.script).resolve() == (EXAMPLES / SERVICE_SCRIPT).resolve()
    assert 1 <= spec.min_replicas <= spec.max_replicas


def test_service_tests_train_the_example_script() -> None:
    helper = (ROOT / "tests" / "service" / "_ray_service.py").read_text()
    assert '"examples" / "cluster" / "classify.py"' in helper


@pytest.mark.parametrize("rel", MANIFESTS)
def test_kuberay_manifests_are_kubernetes_objects(rel: str) -> None:
    import yaml

    docs = [d for d in yaml.safe_load_all((EXAMPLES / rel).read_text()) if d]
    assert docs and all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
