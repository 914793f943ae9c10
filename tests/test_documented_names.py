"""Every ``autopar.x.y`` name that README.md and docs/ use imports as written: each module on
the way imports by its dotted name (``from autopar.checkpoint import Checkpointer``, not only
the attribute ``autopar.checkpoint``), and the rest resolves as attributes."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# not after a dot or a word: torch.ops.autopar.moe_experts is an op namespace, not a module
NAME = re.compile(r"(?<![\w.])autopar(?:\.[A-Za-z_]\w*)+")


def documented_names() -> dict[str, str]:
    """name -> the first page that uses it."""
    names: dict[str, str] = {}
    for page in PAGES:
        for name in NAME.findall(page.read_text()):
            names.setdefault(name, str(page.relative_to(REPO)))
    return names


def resolve(name: str) -> object:
    """The object ``name`` names, reached as Python would: a module imported where one is
    named, attributes after. Raises ImportError or AttributeError saying which part failed."""
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        dotted = ".".join(parts[: i + 1])
        if isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(dotted)
                continue
            except ModuleNotFoundError as e:
                if e.name != dotted:  # the module exists but imports something missing
                    raise
        obj = getattr(obj, parts[i])
        if isinstance(obj, types.ModuleType):
            raise ImportError(f"{dotted} is an attribute holding the module {obj.__name__}, "
                              f"but `import {dotted}` fails")
    return obj


def is_custom_op(name: str) -> bool:
    """``autopar.moe_experts.default``: an op of the ``autopar`` namespace, as the op tables
    print it (``torch.ops.autopar.moe_experts.default``), registered by importing autopar."""
    importlib.import_module("autopar")
    namespace, _, rest = name.partition(".")
    obj: object = getattr(torch.ops, namespace)
    try:
        for part in rest.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return False
    return isinstance(obj, torch._ops.OpOverload)


def test_the_pages_name_the_public_modules():
    names = documented_names()
    assert {"autopar.checkpoint", "autopar.plan", "autopar.passes.plan.Plan"} <= set(names), sorted(names)


def test_every_documented_name_imports_as_written():
    wrong = []
    for name, page in sorted(documented_names().items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            if not is_custom_op(name):
                wrong.append(f"{name} ({page}): {type(e).__name__}: {e}")
    assert not wrong, "autopar: these names of the docs do not import as written; fix the name or the code:\n" + \
        "\n".join(wrong)


@pytest.mark.parametrize("statement", [
    "from autopar.checkpoint import Checkpointer, save, load, export",
    "from autopar.faults import deadline, shared_failures, PeerFailure",
    "import autopar.checkpoint, autopar.faults",
])
def test_the_checkpoint_and_fault_modules_import(statement):
    exec(statement, {})  # noqa: S102 - the statement a user writes, as written


def test_the_check_catches_an_attribute_that_is_not_a_module():
    with pytest.raises(ImportError, match="autopar.passes.capture.torch is an attribute holding the module torch"):
        resolve("autopar.passes.capture.torch")
    with pytest.raises(AttributeError):
        resolve("autopar.checkpoint.NoSuchName")
    assert is_custom_op("autopar.moe_experts.default") and not is_custom_op("autopar.checkpoint.save")
