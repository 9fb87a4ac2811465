"""FP8 knowledge stays in ``dtensor_fp8/formats/``: no other file branches on the recipe class.

Every Python file of the package outside ``formats/`` (the TE bridge, FSDP, DTensor, DCP and TP
code, the benchmarks) and of ``examples/`` is parsed with ``ast``; it must not test a recipe's class:
``isinstance(x, <recipe class>)``, ``issubclass(x, <recipe class>)``, ``type(x) is / == / in
<recipe class>``, ``x.__class__`` compared with one, a class name compared as a string
(``type(x).__name__ == "MXFP8"``), or a ``case MXFP8():`` pattern. What differs between recipes
is declared by the recipe (its methods, ``block_shape``, ``te_binding``, ...) and read from it.
The base class ``Recipe`` is allowed: checking that an argument *is* a recipe is not a branch on
which one it is. Tests are not checked (they compare recipes with independent expectations).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import dtensor_fp8.formats as formats
from dtensor_fp8.formats.base import Recipe

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED = [p for p in sorted((ROOT / "dtensor_fp8").rglob("*.py")) if "formats" not in p.relative_to(ROOT).parts]
CHECKED += sorted((ROOT / "examples").rglob("*.py"))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


#: Every recipe class (``DelayedScaling``, ``CurrentScaling``, ``MXFP8``, ``Blockwise`` and their
#: private bases), found from the package itself so a new recipe is covered without editing this.
RECIPE_CLASSES = frozenset(c.__name__ for c in _subclasses(Recipe) if c.__module__.startswith(formats.__name__))


def _class_name(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The recipe class ``node`` names (``MXFP8``, ``d.MXFP8``, an import alias), else None."""
    if isinstance(node, ast.Name):
        name = aliases.get(node.id, node.id)
    elif isinstance(node, ast.Attribute):
        name = node.attr
    else:
        return None
    return name if name in RECIPE_CLASSES else None


def _named_classes(node: ast.AST, aliases) -> list[str]:
    """Recipe classes named by ``node`` or inside a tuple / list / set of names."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n for n in (_class_name(i, aliases) for i in items) if n]


def _is_type_of(node: ast.AST) -> bool:
    """``type(x)``, ``x.__class__`` or ``type(x).__name__`` / ``x.__class__.__name__``."""
    if isinstance(node, ast.Attribute) and node.attr == "__name__":
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def recipe_branches(source: str, filename: str = "<src>") -> list[str]:
    """``"file:line: what"`` for every test of a recipe's class in ``source``."""
    tree = ast.parse(source, filename)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in RECIPE_CLASSES and a.asname:
                    aliases[a.asname] = a.name
    found = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
            if len(node.args) == 2 and (names := _named_classes(node.args[1], aliases)):
                found.append(f"{where}: {node.func.id}(..., {', '.join(names)})")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = [o.value for o in operands if isinstance(o, ast.Constant) and o.value in RECIPE_CLASSES]
            named = [n for o in operands for n in _named_classes(o, aliases)]
            if strings or (named and any(_is_type_of(o) for o in operands)):
                found.append(f"{where}: type comparison with {', '.join(strings + named)}")
        elif isinstance(node, ast.MatchClass) and (name := _class_name(node.cls, aliases)):
            found.append(f"{where}: case {name}()")
    return found


def test_recipe_classes_found():
    assert {"DelayedScaling", "CurrentScaling", "MXFP8", "Blockwise"} <= RECIPE_CLASSES, RECIPE_CLASSES
    assert "Recipe" not in RECIPE_CLASSES


def test_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in CHECKED}
    assert {"dtensor_fp8/te.py", "dtensor_fp8/fsdp.py", "examples/train.py"} <= names
    assert any(n.startswith("dtensor_fp8/benchmarks/") for n in names)
    assert not any(n.startswith("dtensor_fp8/formats/") for n in names)


@pytest.mark.parametrize("source", [
    "isinstance(r, DelayedScaling)",
    "isinstance(r, d.MXFP8)",
    "isinstance(r, (d.CurrentScaling, d.Blockwise))",
    "issubclass(type(r), _PerTensor)",
    "type(r) is MXFP8",
    "type(r) == d.Blockwise",
    "r.__class__ is CurrentScaling",
    "type(r) in (DelayedScaling, CurrentScaling)",
    "type(r).__name__ == 'MXFP8'",
    "from dtensor_fp8.formats import MXFP8 as MX\nisinstance(r, MX)",
    "match r:\n    case Blockwise():\n        pass",
])
def test_checker_catches(source):
    """The checker itself finds each form (so an empty result below means something)."""
    assert recipe_branches(source), source


@pytest.mark.parametrize("source", [
    "isinstance(r, Recipe)",
    "isinstance(q, QuantizedTensor)",
    "r.block_shape('rowwise').rows == 32",
    "d.MXFP8()",
    "recipe = RECIPES['mxfp8']",
])
def test_checker_allows(source):
    assert not recipe_branches(source), source


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_recipe_branch_outside_formats(path):
    found = recipe_branches(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, ("recipe-class branches outside dtensor_fp8/formats/ (declare the difference on the recipe, "
                       "e.g. in its te_binding, and read it from there):\n  " + "\n  ".join(found))
