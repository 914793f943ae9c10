"""costmodels/ stands alone: it imports only torch, numpy, sympy, tqdm and the standard
library, never passes/ or autopar/ (DESIGN.md, "Where things live")."""

import ast
from pathlib import Path

from autopar import costmodels
ALLOWED = {"torch", "numpy", "sympy", "tqdm"}


def test_costmodels_imports_nothing_of_the_layers_above():
    root = Path(costmodels.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                own = name == "autopar.costmodels" or name.startswith("autopar.costmodels.")
                if not own and top not in ALLOWED and not _stdlib(top):
                    bad.append(f"{path.name}: {name}")
    assert not bad, bad


def _stdlib(name: str) -> bool:
    import sys

    return name in sys.stdlib_module_names or name == "__future__"
