"""The folders are the data flow: imports run one way down, no circle, no private name across
a package boundary (benchmarks and examples use public names only)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> the package it is installed as
PACKAGES = {"autopart/core": "autopart.core", "autopart/runtime": "autopart.runtime",
            "codegen": "autopart.codegen", "profiler": "autopart.profiler",
            "solver": "autopart.solver", "autopart/apps": "autopart.apps",
            "autopart/steps": "autopart.steps", "autopart": "autopart"}
# package -> the packages of ours it may import (besides itself); the top may import all
ALLOWED = {
    "autopart.core": set(),
    "autopart.codegen": {"autopart.core"},
    "autopart.solver": {"autopart.core"},
    "autopart.profiler": {"autopart.core", "autopart.codegen"},
    "autopart.runtime": {"autopart.core", "autopart.codegen"},
    "autopart": {"autopart.core", "autopart.codegen", "autopart.solver", "autopart.profiler",
                 "autopart.runtime"},
    # the applications (CLI, demo, bench, reports, figures) stand on everything; nothing on them
    "autopart.apps": {"autopart", "autopart.core", "autopart.codegen", "autopart.solver",
                      "autopart.profiler", "autopart.runtime"},
}
# The top of autopart/ is the public API, its options and metadata; every other module lives in
# a package (measurement in the profiler, applications in apps).
TOP_MODULES = {"__init__", "api", "lazy", "options", "planning", "layout_planning", "devices",
               "trace"}
TOP_PACKAGES = {"apps", "core", "runtime", "steps"}
OURS = sorted(ALLOWED, key=len, reverse=True)


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    for folder, package in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if rel.as_posix().startswith(folder + "/"):
            rest = rel.as_posix()[len(folder) + 1:].replace("/", ".")
            return package if rest == "__init__" else f"{package}.{rest}"
    raise AssertionError(path)


def _package_of(module: str) -> str:
    return next(p for p in OURS if module == p or module.startswith(p + "."))


def _source_files() -> list[Path]:
    """Every module of ours: the top of ``autopart/`` and each package, subpackages included
    (the runtime's ``local/``, ``distributed/`` and ``checkpoint/``)."""
    files = [p for folder in PACKAGES
             for p in ((ROOT / folder).glob("*.py") if folder == "autopart"
                       else (ROOT / folder).rglob("*.py"))]
    return sorted(set(files))


def _imports(path: Path, type_checking: bool = False) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every import outside ``if TYPE_CHECKING``
    (inside it too with ``type_checking``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and \
                "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert not node.level, f"{path}:{node.lineno}: use absolute imports"
            base = node.module or ""
            found += [(base, alias.name, node.lineno) for alias in node.names]
    return found


def _ours(module: str) -> bool:
    return module == "autopart" or module.startswith("autopart.")


def test_every_package_imports_only_the_layers_below_it() -> None:
    bad = []
    for path in _source_files():
        mine = _package_of(_module_of(path))
        for module, name, line in _imports(path):
            target = f"{module}.{name}" if name and _ours(f"{module}.{name}") and \
                (ROOT / Path(*f"{module}.{name}".split(".")[1:])).exists() else module
            if not _ours(target):
                continue
            theirs = _package_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    assert bad == [], "\n".join(bad)


_APPS_PATH = re.compile(r"autopart\.apps(\.\w+)*(:\w+)?")


def test_no_package_imports_the_apps() -> None:
    """Not by an import statement, nor by a module path in a string (``import_module``, a
    ``module:function`` workload spec)."""
    bad = []
    for path in _source_files():
        if _package_of(_module_of(path)) == "autopart.apps":
            continue
        rel = path.relative_to(ROOT)
        for module, name, line in _imports(path):
            if module == "autopart.apps" or module.startswith("autopart.apps.") or \
                    (module == "autopart" and name == "apps"):
                bad.append(f"{rel}:{line}: imports {module}{'.' + name if name else ''}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    _APPS_PATH.fullmatch(node.value):
                bad.append(f"{rel}:{node.lineno}: names {node.value!r}")
    assert bad == [], "\n".join(bad)


def test_the_top_of_autopart_holds_only_the_api() -> None:
    top = ROOT / "autopart"
    assert {p.stem for p in top.glob("*.py")} == TOP_MODULES
    assert {p.name for p in top.iterdir() if (p / "__init__.py").is_file()} == TOP_PACKAGES


def test_the_module_import_graph_has_no_circle() -> None:
    """Type-checking imports count: a circle of annotations is a circle of ideas."""
    modules = {_module_of(p): p for p in _source_files()}
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for imported, name, _ in _imports(path, type_checking=True):
            for candidate in (f"{imported}.{name}" if name else None, imported):
                if candidate in modules and candidate != module:
                    graph.add_edge(module, candidate)
                    break
    # a package's __init__ re-exports its modules: an edge into it is an edge into them
    cycles = [c for c in nx.simple_cycles(graph)
              if not all(m == c[0] or m.startswith(c[0]) for m in c)]
    assert cycles == [], cycles


_PRIVATE = re.compile(r"(^|\.)_[a-z]")


def _owner_of_private(module: str, name: str | None) -> str | None:
    """The package whose private part an import reaches into, or None if it is public."""
    parts = module.split(".") + ([name] if name else [])
    for k, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:k])
    return None


@pytest.mark.parametrize("folder", ["autopart", "profiler", "solver", "codegen", "benchmarks",
                                    "examples", "tests"])
def test_no_private_name_is_used_outside_its_package(folder: str) -> None:
    tests_of = {"core": "autopart.core", "runtime": "autopart.runtime",
                "codegen": "autopart.codegen", "profiler": "autopart.profiler",
                "solver": "autopart.solver"}
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if folder in ("benchmarks", "examples"):
            home = ""
        elif folder == "tests":
            home = tests_of.get(rel.parts[1], "") if len(rel.parts) > 2 else ""
        else:
            home = _package_of(_module_of(path))
        for module, name, line in _imports(path):
            owner = _owner_of_private(module, name)
            if owner is None or not _ours(module):
                continue
            if not (home and (owner == home or owner.startswith(home + "."))):
                bad.append(f"{rel}:{line}: imports {module}{'.' + name if name else ''}")
        if folder in ("benchmarks", "examples"):
            for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = text.split("#")[0]
                for m in re.finditer(r"\b(\w+)\._[a-z]\w*", code):
                    # torch._C.<name>: torch's own (benchmarks/gpu clears cuBLAS workspaces)
                    if m.group(1) not in ("self", "cls", "torch", "_C", "os", "sys", "pytree"):
                        bad.append(f"{rel}:{lineno}: uses private {m.group(0)}")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("module", ["autopart.solver", "autopart.core.plan",
                                    "autopart.core.schedule", "autopart.core.costgraph",
                                    "autopart.core.cluster", "autopart.core.errors",
                                    "autopart.core.layout", "autopart.core.topology",
                                    "autopart.core.plan_rules", "autopart.core.op_names",
                                    *(f"autopart.solver.{p.stem}"
                                      for p in sorted((ROOT / "solver").glob("*.py"))
                                      if p.stem != "__init__")])
def test_the_solver_and_the_contracts_never_import_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("folder", ["profiler", "solver"])
def test_the_profiler_and_solver_take_a_runtime_description_not_a_name(folder: str) -> None:
    """Which runtime a plan is for reaches the profiler and the solver as a
    ``RuntimeDescription`` (``autopart.core.runtime_model``), never as a string parameter;
    its ``name`` labels messages and cache entries only."""
    bad = []
    for path in sorted((ROOT / folder).glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    ann = ast.unparse(arg.annotation) if arg.annotation else ""
                    if arg.arg == "runtime" and "RuntimeDescription" not in ann:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {arg.arg}: {ann}")
    assert bad == [], "\n".join(bad)
