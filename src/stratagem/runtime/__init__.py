"""Runtime: compile a Strategy into a per-rank Plan and execute it.

``compile_plan`` (pure data) -> ``DistributedModel`` (hooks, fused all-reduce groups,
compressors). See docs/concepts/allreduce-runtime.md.
"""

from stratagem.runtime.compressors import (
    Compressor,
    compressor_names,
    register_compressor,
)
from stratagem.runtime.materialize import MetaInit
from stratagem.runtime.model import DistributedModel
from stratagem.runtime.plan import GroupPlan, Member, Plan, compile_plan, resolve_backend
from stratagem.runtime.stats import CommStats

__all__ = [
    "CommStats",
    "Compressor",
    "DistributedModel",
    "GroupPlan",
    "Member",
    "MetaInit",
    "Plan",
    "compile_plan",
    "compressor_names",
    "register_compressor",
    "resolve_backend",
]
