"""One compressor registry: what the runtime registers, validation and the builders accept;
a compressor's own setting checks (PowerSGD's rank, no sparse gradients) live with its name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torch import nn

from stratagem.analysis import analyze
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy import AllReduce, validate
from stratagem.strategy.compressors import check_compressor, compressor_names


def test_builtins_are_registered_below_the_runtime() -> None:
    assert {"none", "fp16", "bf16", "powersgd"} <= set(compressor_names())


def test_powersgd_settings_are_checked_in_one_place() -> None:
    check_compressor("powersgd", 4, sparse=False)
    with pytest.raises(StrategyError, match="powersgd_rank must be >= 1"):
        check_compressor("powersgd", 0, where="node_config[0]")
    with pytest.raises(StrategyError, match="sparse embedding"):
        check_compressor("powersgd", 1, sparse=True)
    with pytest.raises(StrategyError, match="unknown compressor 'zstd'") as err:
        check_compressor("zstd")
    assert "register" in (err.value.fix or "")


def test_validation_reads_the_registry_for_sparse_parameters() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    profile = analyze(model)
    with pytest.raises(StrategyError, match="sparse embedding"):
        validate(AllReduce(compressor="powersgd").build(profile, ResourceSpec.local(2)),
                 profile, ResourceSpec.local(2))


def test_a_registered_compressor_passes_validation_and_compiles() -> None:
    """In a fresh interpreter, so the registration does not leak into other tests."""
    code = textwrap.dedent("""
        import torch
        from torch import nn
        from stratagem.analysis import analyze
        from stratagem.errors import StrategyError
        from stratagem.resource import ResourceSpec
        from stratagem.runtime import compile_plan, register_compressor
        from stratagem.runtime.compressors import CastCompressor, make_compressor
        from stratagem.strategy import AllReduce, validate

        model = nn.Linear(4, 2)
        profile, spec = analyze(model), ResourceSpec.local(2)
        try:
            AllReduce(compressor="half")
        except StrategyError:
            pass
        else:
            raise SystemExit("an unregistered compressor was accepted")

        @register_compressor("half")
        class Half(CastCompressor):
            wire_dtype = torch.float16

        strategy = validate(AllReduce(compressor="half").build(profile, spec), profile, spec)
        plan = compile_plan(strategy, profile, rank=0, world_size=2, device=torch.device("cpu"))
        group = plan.groups[0]
        assert group.compressor == "half"
        assert isinstance(make_compressor(group, torch.zeros(group.numel)), Half)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
