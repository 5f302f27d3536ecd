"""Drop-in replacement for AdaptDL: ``import adaptdl.torch as adl`` becomes
``import stratagem.adaptdl.torch as adl`` and the script runs on Stratagem.

``stratagem.adaptdl.torch``: init_process_group, AdaptiveDataParallel, AdaptiveDataLoader,
Accumulator, remaining_epochs_until / current_epoch / finished_epochs, scaling rules.
``stratagem.adaptdl.env``: replica_rank, num_replicas, num_nodes, job_id, share_path, ...
``stratagem.adaptdl.checkpoint``: State, save_all_states, save_state, load_state.
``stratagem.adaptdl.collective``: initialize, allreduce, allreduce_async, broadcast.
See docs/how-to/adaptdl-migration.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratagem.adaptdl import env

__all__ = ["checkpoint", "collective", "env", "torch"]


def __getattr__(name: str) -> Any:
    if name in ("checkpoint", "collective", "torch"):
        module = importlib.import_module(f"stratagem.adaptdl.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'stratagem.adaptdl' has no attribute {name!r}")
