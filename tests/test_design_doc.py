"""``docs/design.md`` names only what exists, and maps every module there is.

Every repository path the page writes (``passes/solve/ilp.py``, ``autopar/runtime/``) must
exist; every dotted name it writes under ``autopar.``, ``benchmarks.`` or ``tests.``
(``autopar.passes.costing.build_costs``, ``autopar.passes.plan.Plan.load``) must be a
module, or a name defined at the top of one (a class's names followed into its body);
every module of the package and every benchmark script must appear on the page by its
path; and the page names every floor ``tests/test_architecture.py`` enforces. Reads files
only (no imports of the project): well under a second.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from tests.test_architecture import FLOORS

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "design.md"
# The folders a path on the page may start with, and where a dotted name's package lives.
PATH_ROOTS = ("autopar", "passes", "costmodels", "tests", "benchmarks", "examples", "docs")
PACKAGE_DIRS = {"autopar.passes": "passes", "autopar.costmodels": "costmodels", "autopar": "autopar",
                "benchmarks": "benchmarks", "tests": "tests"}
# folders whose every module the map must list, by path
MAPPED = ("autopar", "passes", "costmodels", "benchmarks")

_PATH = re.compile(r"(?<![\w./~-])(?:" + "|".join(PATH_ROOTS) + r")/[\w./-]*")
_DOTTED = re.compile(r"(?<![\w./-])(?:autopar|benchmarks|tests)(?:\.\w+)+")
_CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def code_text(markdown: str) -> str:
    """The page's code: inline spans and fenced blocks, where names are written."""
    return "\n".join(m.group(0) for m in _CODE.finditer(markdown))


def named_paths(markdown: str) -> set[str]:
    return {m.group(0).rstrip(".") for m in _PATH.finditer(code_text(markdown))}


def named_dotted(markdown: str) -> set[str]:
    return {m.group(0) for m in _DOTTED.finditer(code_text(markdown))}


def _module_file(module: str) -> Path | None:
    """The file (or namespace folder) of a dotted module name, or None."""
    for package in sorted(PACKAGE_DIRS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".")
            base = REPO / PACKAGE_DIRS[package] / Path(*rest.split(".")) if rest else REPO / PACKAGE_DIRS[package]
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
            if (base / "__init__.py").is_file():
                return base / "__init__.py"
            return base if base.is_dir() else None
    return None


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at the top of ``body``: defs, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
    return out


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` is a module or a name defined in one; else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        if path.is_dir():  # a namespace folder: nothing to look names up in
            return None if cut == len(parts) else f"{dotted}: {'.'.join(parts[:cut])} is a folder, not a module"
        body: list[ast.stmt] = _tree(path).body
        for attr in parts[cut:]:
            found = _defined(body).get(attr)
            if found is None:
                return f"{dotted}: no {attr!r} in {path.relative_to(REPO)}"
            body = found.body if isinstance(found, ast.ClassDef) else []
        return None
    return f"{dotted}: no such module"


def missing_names(markdown: str) -> list[str]:
    """Every path and dotted name on the page that does not exist, with what is missing."""
    wrong = [f"{p}: no such file or folder" for p in sorted(named_paths(markdown)) if not (REPO / p).exists()]
    wrong += [why for d in sorted(named_dotted(markdown)) if (why := resolve(d)) is not None]
    return wrong


def modules_to_map() -> list[str]:
    """Every module of the package and every benchmark script, by repository path."""
    return sorted(str(p.relative_to(REPO)) for root in MAPPED for p in (REPO / root).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_the_page_names_only_what_exists():
    wrong = missing_names(DOC.read_text())
    assert not wrong, "docs/design.md names what does not exist; fix the page:\n" + "\n".join(wrong)


def test_the_folder_map_lists_every_module():
    named = named_paths(DOC.read_text())
    unmapped = [m for m in modules_to_map() if m not in named]
    folders = sorted({str(p.parent.relative_to(REPO)) + "/" for root in MAPPED[:3]
                      for p in (REPO / root).rglob("__init__.py")})
    unmapped += [f for f in folders if f not in named]
    assert not unmapped, ("docs/design.md's folder map lacks these; add a line saying each one's job:\n"
                          + "\n".join(unmapped))


def test_the_page_names_every_floor():
    text = DOC.read_text()
    absent = [prefix for _, prefixes in FLOORS for prefix in prefixes if f"`{prefix}`" not in text]
    assert not absent, f"docs/design.md does not name the floors {absent} of tests/test_architecture.py"


def test_the_check_catches_wrong_names():
    page = ("See `autopar.passes.costing.build_costs`, `autopar.passes.plan.Plan.load` and `passes/solve/`;\n"
            "not `autopar.passes.no_such_module`, `autopar.passes.costing.no_such_name`,\n"
            "`autopar.passes.plan.Plan.no_such_method` or `passes/no_such_file.py`.\n"
            "```\nautopar.compile(model)   # passes/capture.py\n```\n")
    assert named_paths(page) == {"passes/solve/", "passes/no_such_file.py", "passes/capture.py"}
    wrong = missing_names(page)
    assert [w.split(":")[0] for w in wrong] == [
        "passes/no_such_file.py", "autopar.passes.costing.no_such_name", "autopar.passes.no_such_module",
        "autopar.passes.plan.Plan.no_such_method"]
