"""One local Ray cluster per test module, with fake GPUs (a custom resource) on CPU workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from _ray_service import FAKE_GPU


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install "
                              "'stratagem[cluster]'")
    from stratagem.service.cluster import RAY_DEFAULTS

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for key, value in RAY_DEFAULTS.items():  # Ray as `cluster up` starts it
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=4, num_gpus=2, resources={FAKE_GPU: 2},
             include_dashboard=False,
             object_store_memory=80 * 1024 * 1024, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    yield ray
    ray.shutdown()
