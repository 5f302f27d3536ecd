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

    model = _call_target(target, "--model")
    if not isinstance(model, nn.Module):
        raise StratagemError(f"{target} returned {type(model).__name__}, not an nn.Module",
                             where="--model", fix="return the model from the callable")
    return model


def _call_target(target: str, option: str) -> Any:
    """Import ``module:callable`` (or ``file.py:callable``) and call it."""
    if ":" not in target:
        raise StratagemError(f"cannot read {option} {target!r}", where=option,
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
        raise StratagemError(f"cannot import {where!r}: {exc}", where=option,
                             fix="check the module path or file name") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise StratagemError(f"{where} has no callable {name!r}", where=option,
                             fix="name a function or class that builds it")
    return factory()


def explain(model_target: str, spec_file: str | None, strategy: str | None,
            nproc: int | None, out: str | None, show_plan: bool,
            sample_target: str | None = None, batch_size: int | None = None,
            as_json: bool = False, picture: str | None = None) -> str:
    """The report ``stratagem plan`` prints; saves the strategy to ``out`` and draws it to
    ``picture`` (PNG/SVG/PDF) if given.

    With ``--strategy Auto`` the planner chooses (calibrating on the batch that
    ``sample_target`` returns, else estimating at ``batch_size`` per worker) and the report
    is its explanation; any other strategy gets its predicted step split too."""
    from stratagem.analysis import analyze
    from stratagem.planner import (
        Auto,
        choose,
        estimate,
        explain_json,
        explain_text,
        predict,
    )
    from stratagem.planner.calibrate import calibrate
    from stratagem.resource import ResourceSpec
    from stratagem.strategy import resolve_builder, validate

    spec = ResourceSpec.from_file(spec_file) if spec_file else ResourceSpec.local(nproc or 1)
    model = load_model(model_target)
    sample = load_sample(sample_target) if sample_target else None
    if batch_size is not None and batch_size < 1:
        raise StratagemError(f"--batch-size must be >= 1, got {batch_size}",
                             where="--batch-size", fix="give the samples per worker")
    builder = resolve_builder(strategy)
    profile = analyze(model)
    lines = [f"resource spec: {spec.source}: {len(spec.nodes)} node(s), "
             f"{spec.num_workers} worker(s): {', '.join(spec.replicas)}",
             f"model: {profile.summary()}"]
    report: dict[str, Any] = {"spec": spec.source, "workers": spec.num_workers}
    if isinstance(builder, Auto):
        options = builder if batch_size is None else Auto(
            compressors=builder.compressors, rows=builder.rows,
            detect_sparse=builder.detect_sparse, batch_size=batch_size)
        choice = choose(model, spec, sample_input=sample, options=options)
        built = validate(choice.strategy, profile, spec)
        plan = compiled(built, profile, spec)
        lines += [explain_text(choice, plan=plan), "", *listing(built, plan)]
        report["auto"] = explain_json(choice, plan=plan)
    else:
        built = validate(builder.build(profile, spec), profile, spec)
        plan = compiled(built, profile, spec)
        cal = (calibrate(model, sample) if sample is not None
               else estimate(profile, batch_size or Auto().batch_size))
        cost = predict(built, profile.with_access(cal.access) if sample is not None
                       else profile, spec, cal)
        lines += [*listing(built, plan),
                  f"predicted step {cost.total_s * 1e3:.1f} ms = compute "
                  f"{cost.compute_s * 1e3:.1f} + exposed comm {cost.exposed_comm_s * 1e3:.1f}"
                  f" + overheads {cost.overhead_s * 1e3:.1f}"]
        report["predicted"] = cost.to_dict()
    return _finish(lines, report, built, plan, profile, spec, show_plan, out, as_json, picture,
                   model_target)


def compiled(built: Any, profile: Any, spec: Any) -> Any:
    """Rank 0's plan of ``built``: the one source of the report's table, list and picture."""
    import torch

    from stratagem.runtime import compile_plan

    return compile_plan(built, profile, rank=0, world_size=spec.num_workers,
                        device=torch.device("cpu"))


def listing(built: Any, plan: Any) -> list[str]:
    """The per-parameter list: the strategy's id, then how each parameter's pieces travel."""
    return [f"strategy {built.id} (builder {built.builder}, "
            f"{len(built.graph_config.replicas)} replicas), per parameter:",
            *plan.by_parameter()]


def _finish(lines: list[str], report: dict[str, Any], built: Any, plan: Any, profile: Any,
            spec: Any, show_plan: bool, out: str | None, as_json: bool,
            picture: str | None = None, title: str = "") -> str:
    """The common end of a report: the compiled plan, the saved file, the picture, text or
    JSON."""
    import json

    from stratagem.planner.memory import estimate_memory, mib

    report["strategy"] = built.to_dict()
    memory = estimate_memory(built, profile, spec.num_workers)  # (optimizer: Adam's state)
    limit = spec.memory_limit()
    lines.append(f"memory per worker (Adam, activations not counted): {memory.text()}"
                 + (f"; limit {mib(limit[0])} ({limit[1]})" if limit else ""))
    report["memory_per_worker"] = {"peak": memory.peak, **memory.items}
    if show_plan:
        lines.append(plan.summary())
        report["plan"] = plan.summary()
    if out:
        built.save(out)
        lines.append(f"strategy saved to {out} (edit it and pass it back with --strategy)")
    if picture:
        from stratagem.cli.plan_picture import save_picture

        saved = save_picture(built, profile, picture, title, plan=plan)
        lines.append(f"picture saved to {saved}")
        report["picture"] = str(saved)
    if as_json:
        return json.dumps(report, indent=2, default=str)
    return "\n".join(lines)


def explain_script(script: str, spec_file: str | None, strategy: str | None,
                   nproc: int | None, out: str | None, show_plan: bool,
                   as_json: bool = False, picture: str | None = None) -> str:
    """Run a training script until its ``ad.distribute(...)``, as rank 0 of the spec's job
    but joining nothing, and report the strategy it gets (Auto's explanation if Auto)."""
    import runpy

    from stratagem.autodist import PlanOnly, plan_only
    from stratagem.planner import estimate, explain_json, explain_text, predict
    from stratagem.resource import ResourceSpec

    path = Path(script)
    if not path.is_file() or path.suffix != ".py":
        raise StratagemError(f"no Python script at {script!r}", where="stratagem plan",
                             fix="pass the training script (train.py), or --model")
    spec = ResourceSpec.from_file(spec_file) if spec_file else ResourceSpec.local(nproc or 1)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        with plan_only(spec, strategy):
            runpy.run_path(str(path), run_name="__main__")
    except PlanOnly as stop:
        ad = stop.autodist
    else:
        raise StratagemError(f"{script} ended without calling AutoDist.distribute()",
                             where="stratagem plan",
                             fix="plan a script that builds its model and calls "
                                 "ad.distribute(model, optimizer), or use --model")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    built, profile = ad.strategy, ad.profile
    plan = compiled(built, profile, spec)
    lines = [f"resource spec: {spec.source}: {len(spec.nodes)} node(s), "
             f"{spec.num_workers} worker(s): {', '.join(spec.replicas)}",
             f"model: {profile.summary()}"]
    report: dict[str, Any] = {"spec": spec.source, "workers": spec.num_workers,
                              "script": str(path)}
    if ad.choice is not None:
        lines += [explain_text(ad.choice, plan=plan), "", *listing(built, plan)]
        report["auto"] = explain_json(ad.choice, plan=plan)
    else:
        cost = predict(built, profile, spec, estimate(profile, 32))
        lines += [*listing(built, plan), f"predicted step {cost.total_s * 1e3:.1f} ms (estimated "
                  "from the profile at 32 samples per worker)"]
        report["predicted"] = cost.to_dict()
    return _finish(lines, report, built, plan, profile, spec, show_plan, out, as_json, picture,
                   str(path))


def load_sample(target: str) -> Any:
    """Call ``module:callable`` (or ``file.py:callable``) for one worker's sample batch: a
    tensor, or a tuple/dict of the model's inputs."""
    return _call_target(target, "--sample")
