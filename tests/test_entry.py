"""The on-disk entry of an FP8 weight has one home (``dtensor_fp8/entry.py``): its key grammar there,
and no other module of the package spells it.

The structure rule, read from the source of every module but ``entry.py``: no string literal names an
entry key of its own (``"recipe"`` as a key suffix, ``".master"``, ``"_extra_state"``, an f-string
ending in ``_data`` / ``_scale_inv``); such keys are built and recognised with ``entry.py``'s names.
Two kinds of module are not about the entry and keep their own spellings: the codecs
(``formats/``: TE's attribute and constructor names, e.g. ``"_rowwise_scale_inv"``) and
``tensor.py`` (``QuantizedTensor``'s flattened attributes for torch's subclass protocol).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import dtensor_fp8 as d
from dtensor_fp8 import entry
from dtensor_fp8.formats import RECIPES
from dtensor_fp8.state_dict import plane_entries

PACKAGE = Path(__file__).resolve().parent.parent / "dtensor_fp8"
#: modules whose spellings of these names are not the entry's (see the module docstring)
NOT_THE_ENTRY = ("entry.py", "formats/", "tensor.py")


def entry_spellings(source: str) -> list[str]:
    """String literals in ``source`` that spell an entry key (see the module docstring).

    Args:
        source: a module's Python source.

    Example:
        >>> sorted(entry_spellings('k.endswith(".recipe"); f"{u}_data"; x = "rowwise"'))
        ['.recipe', '{u}_data']
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in (".recipe", ".master", "_extra_state", ".master_weight") or text.endswith("._extra_state"):
                found.append(text)
        elif isinstance(node, ast.JoinedStr) and node.values:
            last = node.values[-1]
            if isinstance(last, ast.Constant) and isinstance(last.value, str) and last.value.endswith(("_data", "_scale_inv")):
                found.append(ast.unparse(node)[2:-1])
    return found


def test_the_structure_rule_finds_what_it_forbids():
    """The rule itself: each forbidden spelling is found, and names from ``entry.py`` are not."""
    bad = 'a = k.endswith(".recipe")\nb = k.endswith(".master")\nc = "_extra_state"\nd = f"{usage}_scale_inv"\n'
    assert sorted(entry_spellings(bad)) == [".master", ".recipe", "_extra_state", "{usage}_scale_inv"]
    good = 'a = is_recipe_key(k); b = is_master_key(k); c = is_extra_state(k); d = plane_key(u, "scale_inv")\n'
    assert entry_spellings(good) == []


def test_no_module_but_entry_spells_the_entry():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(NOT_THE_ENTRY):
            continue
        found = entry_spellings(path.read_text())
        if found:
            offenders[rel] = found
    assert offenders == {}, f"spell entry keys with dtensor_fp8/entry.py's names: {offenders}"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_written_entry_parses_with_the_grammar(recipe):
    """Every name ``plane_entries`` writes is either the recipe, a plane tensor (``plane_key``) or a
    scaling state the grammar recognises; the flat keys parse back to the weight's key."""
    w = d.quantize(torch.randn(256, 256, generator=torch.Generator().manual_seed(0)), RECIPES[recipe])
    written = plane_entries(w)
    planes = {entry.plane_key(u, f) for u in w.planes for f in entry.PLANE_FIELDS}
    assert planes <= set(written)
    for name in written:
        flat = f"layers.0.w1.weight.{name}"
        assert entry.weight_key(flat) == "layers.0.w1.weight"
        kinds = [name == entry.RECIPE_KEY, name in planes, entry.is_scaling_state_entry(flat)]
        assert kinds.count(True) == 1, (name, kinds)
        assert entry.is_recipe_key(flat) == (name == entry.RECIPE_KEY)
    assert json.loads(written[entry.RECIPE_KEY])["recipe"] == type(w.recipe).__name__


def test_grammar_names():
    assert entry.is_weight_state_entry("w.rowwise_amax_history") and not entry.is_weight_state_entry("w.rowwise_data")
    assert entry.is_operand_state_entry("w.input_scale") and entry.is_operand_state_entry("w.grad_amax_history")
    assert not entry.is_scaling_state_entry("w.columnwise_scale_inv")
    assert entry.is_master_key("optim.state.layers.0.w1.weight.master") and not entry.is_master_key("w.exp_avg")
    assert entry.is_extra_state("_extra_state") and entry.is_extra_state("m._extra_state")
    assert not entry.is_extra_state("m.my_extra_state")


def test_recipe_tensor_round_trips_and_refuses_what_does_not_fit():
    config = '{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e4m3fn"}'
    t = entry.recipe_tensor(config)
    assert t.dtype == torch.uint8 and t.shape == (entry.RECIPE_FIELD_BYTES,)
    assert entry.recipe_from_tensor(t) == config
    with pytest.raises(d.RecipeError, match="does not fit the 256-byte"):
        entry.recipe_tensor("x" * 257)
