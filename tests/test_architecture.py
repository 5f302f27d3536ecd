"""The package's shape, checked from its source: imports run downward between the layers of
docs/concepts/architecture.md, never in a loop, and never reach for another module's private
names. Imports made inside functions count too (they are how loops used to hide)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top; a module may import its own layer or a lower one. Names are prefixes of
# dotted module names below ``stratagem`` (a package covers its submodules).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "env", "safeload"),
    ("distributed", "resource", "checkpoint", "observe"),
    ("analysis",),
    ("strategy",),
    ("runtime",),
    ("planner",),
    ("launch",),
    ("elastic",),
    ("data",),
    ("adapt",),
    ("sched",),
    ("service",),
    ("autodist",),
    ("adaptdl",),
    # "": the package's own __init__ (public API)
    ("cli", "__main__", ""),
)
ENV_NAME = re.compile(r"(STRATAGEM|ADAPTDL)_[A-Z0-9_]+")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: dict[str, int] = field(default_factory=dict)  # module -> first line
    private: list[str] = field(default_factory=list)  # "line: what" of private crossings
    env_names: list[str] = field(default_factory=list)  # "line: NAME" outside docstrings


def _modules() -> dict[str, Module]:
    out = {}
    for path in sorted((SRC / "stratagem").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = Module(".".join(parts), path, is_package)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(name: str) -> str:
    return name.rpartition(".")[0]


def _private_module_crossing(importer: Module, target: str) -> bool:
    """``target`` is a private module (``pkg._mod``) imported from outside ``pkg``."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            owner = ".".join(parts[:i])
            home = importer.name if importer.is_package else _package(importer.name)
            return not (home == owner or home.startswith(owner + "."))
    return False


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _analyze(mod: Module, modules: dict[str, Module]) -> None:
    tree = ast.parse(mod.path.read_text(), str(mod.path))
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    imported_names: dict[str, str] = {}  # local name -> module it came from (for x._y)

    def add(target: str, line: int) -> None:
        if target != mod.name:
            mod.imports.setdefault(target, line)
        if _private_module_crossing(mod, target):
            mod.private.append(f"{line}: imports private module {target}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "stratagem":
                    add(alias.name, node.lineno)
                    imported_names[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = ".".join(base[:len(base) - node.level + 1]
                                  + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "stratagem":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:  # a submodule
                    add(full, node.lineno)
                    imported_names[alias.asname or alias.name] = full
                    continue
                add(source, node.lineno)
                if _is_private(alias.name):
                    mod.private.append(f"{node.lineno}: imports {source}.{alias.name}")
                imported_names[alias.asname or alias.name] = source
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in imported_names
                and imported_names[node.value.id] != mod.name):
            mod.private.append(f"{node.lineno}: uses {node.value.id}.{node.attr} "
                               f"(from {imported_names[node.value.id]})")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings and ENV_NAME.fullmatch(node.value)):
            mod.env_names.append(f"{node.lineno}: {node.value}")


def _graph() -> dict[str, Module]:
    modules = _modules()
    for mod in modules.values():
        _analyze(mod, modules)
    return modules


def layer_of(name: str) -> int:
    rel = name.removeprefix("stratagem").removeprefix(".")
    best = None
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if rel == prefix or (prefix and rel.startswith(prefix + ".")):
                best = index
    if best is None:
        raise AssertionError(f"module {name} is in no layer: add it to LAYERS and to "
                             "docs/concepts/architecture.md")
    return best


def _cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(sorted(modules[root].imports)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(modules[child].imports))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


MODULES = _graph()


def test_the_checker_sees_imports_inside_functions_and_private_names(tmp_path: Path) -> None:
    """The analysis itself, on a hand-made module (so the real checks cannot pass vacuously)."""
    path = tmp_path / "probe.py"
    path.write_text('"""STRATAGEM_DOC in a docstring is fine."""\n'
                    "from stratagem.elastic import state\n"
                    "def f():\n"
                    "    from stratagem.autodist import AutoDist\n"
                    "    from stratagem.elastic.state import _is_empty\n"
                    "    return state._custom_file, 'STRATAGEM_X'\n")
    probe = Module("stratagem.data", path, False)
    _analyze(probe, MODULES)
    assert "stratagem.autodist" in probe.imports and "stratagem.elastic.state" in probe.imports
    assert any("_is_empty" in p for p in probe.private)
    assert any("state._custom_file" in p for p in probe.private)
    assert probe.env_names == ["6: STRATAGEM_X"]
    assert layer_of("stratagem.autodist") > layer_of("stratagem.data")
    loop = {"a": Module("a", path, False, {"b": 1}), "b": Module("b", path, False, {"a": 1})}
    assert _cycles(loop) == [["a", "b"]]


def test_no_import_loops() -> None:
    assert _cycles(MODULES) == []


def test_imports_only_go_down_the_layers() -> None:
    upward = [f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)}) "
              f"at line {line}"
              for name, mod in MODULES.items() for target, line in mod.imports.items()
              if target in MODULES and layer_of(target) > layer_of(name)]
    assert upward == []


def test_no_private_name_crosses_a_module() -> None:
    crossings = [f"{mod.path.relative_to(SRC)}:{p}" for mod in MODULES.values()
                 for p in mod.private]
    assert crossings == []


def test_environment_variables_are_named_only_in_env_py() -> None:
    """Every STRATAGEM_*/ADAPTDL_* variable has its name and accessor in stratagem/env.py."""
    elsewhere = [f"{mod.path.relative_to(SRC)}:{n}" for name, mod in MODULES.items()
                 if name != "stratagem.env" for n in mod.env_names]
    assert elsewhere == []


def test_every_module_sits_in_a_layer_and_the_root_holds_only_the_base() -> None:
    """The layout shows the layers: a loose module in the package root must be one of the
    few that every layer shares or the entry points; commands live in ``cli/``, process-group
    plumbing in ``distributed/``, the cluster service in ``service/``."""
    root = sorted(p.stem for p in (SRC / "stratagem").glob("*.py"))
    assert root == ["__init__", "__main__", "autodist", "checkpoint", "data", "env", "errors",
                    "resource", "safeload"], root
    packages = {p.parent.name for p in (SRC / "stratagem").glob("*/__init__.py")}
    assert {"cli", "distributed", "service", "sched"} <= packages
    assert layer_of("stratagem.service") > layer_of("stratagem.sched")
    assert layer_of("stratagem.cli.plan") == len(LAYERS) - 1
