"""``stratagem plan``: show, without training, what a strategy does with a model.

Loads a model from ``module:callable`` or ``path/to/file.py:callable``, profiles it, builds
the strategy for the resource spec, validates it and compiles the plan of every rank, so a
user can read (and save, then hand-edit) exactly what the runtime would execute.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError


def load_model(target: str) -> Any:
    """Call ``module:callable`` (or ``file.py:callable``) and return the nn.Module it makes."""
    from torch import nn

    if ":" not in target:
        raise StratagemError(f"cannot read model {target!r}", where="--model",
                             fix="write MODULE:CALLABLE or path/to/file.py:CALLABLE")
    where, name = target.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None or not path.is_file():
                raise FileNotFoundError(str(path))
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(path.parent))
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, FileNotFoundError) as exc:
        raise StratagemError(f"cannot import {where!r}: {exc}", where="--model",
                             fix="check the module path or file name") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise StratagemError(f"{where} has no callable {name!r}", where="--model",
                             fix="name a function or class that builds the model")
    model = factory()
    if not isinstance(model, nn.Module):
        raise StratagemError(f"{target} returned {type(model).__name__}, not an nn.Module",
                             where="--model", fix="return the model from the callable")
    return model


def explain(model_target: str, spec_file: str | None, strategy: str | None,
            nproc: int | None, out: str | None, show_plan: bool,
            picture: str | None = None) -> str:
    """The report ``stratagem plan`` prints; saves the strategy to ``out`` and draws it to
    ``picture`` (PNG/SVG/PDF) if given."""
    import torch

    from stratagem.analysis import analyze
    from stratagem.resource import ResourceSpec
    from stratagem.runtime import compile_plan
    from stratagem.strategy import resolve_builder, validate

    spec = ResourceSpec.from_file(spec_file) if spec_file else ResourceSpec.local(nproc or 1)
    model = load_model(model_target)
    profile = analyze(model)
    built = validate(resolve_builder(strategy).build(profile, spec), profile, spec)
    lines = [f"resource spec: {spec.source}: {len(spec.nodes)} node(s), "
             f"{spec.num_workers} worker(s): {', '.join(spec.replicas)}",
             f"model: {profile.summary()}", built.summary()]
    if show_plan:
        plan = compile_plan(built, profile, rank=0, world_size=spec.num_workers,
                            device=torch.device("cpu"))
        lines.append(plan.summary())
    if out:
        built.save(out)
        lines.append(f"strategy saved to {out} (edit it and pass it back with --strategy)")
    if picture:
        from stratagem.plan_picture import save_picture

        lines.append(f"picture saved to {save_picture(built, profile, picture, model_target)}")
    return "\n".join(lines)
