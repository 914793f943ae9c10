"""The folder map of ``docs/design.md`` holds: no module imports a floor above its own, no
project import hides inside a function, and the installed package list is the folders'."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's package-dir)
ROOTS = {"autopar": "autopar", "passes": "autopar.passes", "costmodels": "autopar.costmodels"}

# Floors, bottom up: a module may import its own floor and the ones below, never above.
FLOORS = [
    ("cost models", ("autopar.costmodels",)),
    ("passes: capture, strategies, rules, costing, solvers", ("autopar.passes",)),
    ("passes: lowering", ("autopar.passes.lowering",)),
    ("passes: planner", ("autopar.passes.planner",)),
    ("runtime", ("autopar.runtime",)),
    ("public API, CLI, benchmarks", ("autopar",)),
]
# lowering and the planner are side by side: neither needs the other
SIDE_BY_SIDE = {("autopar.passes.planner", "autopar.passes.lowering"), ("autopar.passes.lowering", "autopar.passes.planner")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = list(rel.with_suffix("").parts)
    parts[0] = ROOTS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}


def _floor(module: str) -> tuple[int, str]:
    """The floor of ``module``: the last (highest) floor whose prefix is the longest match."""
    best = (-1, -1, "")
    for level, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), level, prefix))
    return best[1], best[2]


def _imports(path: Path, package: str):
    """(imported module, line, at module level) for every project import in ``path``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]  # a module, or a name in module `base`
        else:
            continue
        for name in names:
            if name == "autopar" or name.startswith("autopar."):
                yield name, node.lineno, id(node) in top


def test_no_module_imports_a_floor_above_its_own():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        level, prefix = _floor(module)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name, line, _ in _imports(path, package):
            while name not in modules and "." in name:  # `from pkg import name`: name may be an attribute
                name = name.rpartition(".")[0]
            their_level, their_prefix = _floor(name)
            if their_level > level or (prefix, their_prefix) in SIDE_BY_SIDE:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({FLOORS[level][0]}) imports {name} "
                             f"({FLOORS[their_level][0]})")
    assert not wrong, "\n".join(wrong)


def test_project_imports_are_at_module_top():
    inside = [f"{path.relative_to(REPO)}:{line} imports {name} inside a function or class"
              for module, path in _modules().items()
              for name, line, at_top in _imports(path, module.rpartition(".")[0]) if not at_top]
    assert not inside, "\n".join(inside)


def test_installed_packages_are_the_folders():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {_module_name(p) for root in ROOTS for p in (REPO / root).rglob("__init__.py")}
    assert listed == found, f"pyproject.toml lists {sorted(listed)}; the folders hold {sorted(found)}"
    assert config["package-dir"] == {v: k for k, v in ROOTS.items() if k != "autopar"}


def test_no_sys_path_patches():
    patched = [str(p.relative_to(REPO)) for folder in ("benchmarks", "tests", "passes", "costmodels")
               for p in (REPO / folder).rglob("*.py")
               if re.search(r"sys\.path\.(insert|append)", p.read_text()) and p.name != Path(__file__).name]
    assert not patched, f"sys.path patched in {patched}; import autopar.passes / autopar.costmodels instead"
