"""``formats/registry.py`` is the one table of recipes: everything else a recipe needs derives from it
or is checked here, so a recipe added there and missing elsewhere fails with what to add
(docs/README.md, "Adding a recipe")."""

import dataclasses

import pytest

import dtensor_fp8 as d
from conftest import load_golden, valid_region
from dtensor_fp8.formats import USAGES, config, te_import
from dtensor_fp8.formats.registry import RECIPE_CLASSES, RECIPES
from dtensor_fp8.formats.scaled_mm import SCALE_LAYOUTS, gemm_block


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_registered_recipe_has_everything_it_needs(name):
    recipe = RECIPES[name]
    cls = type(recipe)
    # the package exports its class, under its own name
    assert getattr(d, cls.__name__, None) is cls and cls.__name__ in d.__all__, \
        f"export {cls.__name__} from dtensor_fp8/__init__.py (and add it to __all__)"
    # its checkpoint config names it and reads back to an equal recipe
    assert config.recipe_from_config(config.recipe_config(recipe)) == recipe
    # its TE classes are ones the lazy importer knows (formats/te_import.py's table)
    binding = recipe.te_binding
    for te_class in (binding.tensor_class, binding.storage_class, binding.quantizer_class):
        assert te_class in te_import._CLASSES, f"{name}: add TE's {te_class} to te_import._CLASSES"
    # the tests' independent oracle of TE's scale shapes covers its block-scaled planes
    for usage in USAGES:
        if recipe.block_shape(usage).extent(0) is not None or recipe.block_shape(usage).extent(1) is not None:
            assert valid_region(f"_{usage}_scale_inv", 256, 256, recipe) is not None, \
                f"{name}: tests/conftest.py's valid_region has no scale shape for its {usage} plane"


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_gemm_operand_has_torch_s_scale_layout(name):
    """The weight's operands of the GEMMs: the rowwise plane contracted over its dim 1 (forward), the
    columnwise plane over its dim 0 (input gradient); each in the GEMM's orientation has torch's
    scaled-GEMM scale layout (formats/scaled_mm.py), which the dispatch reads by block shape."""
    recipe = RECIPES[name]
    for usage, contract_dim in (("rowwise", 1), ("columnwise", 0)):
        block = gemm_block(recipe.block_shape(usage), contract_dim)
        assert block in SCALE_LAYOUTS, f"{name}: {usage} blocks {block} in GEMM orientation: add a scaled_mm.SCALE_LAYOUTS entry"


def test_every_class_and_name_is_registered_once():
    names = [r.name for instances in RECIPE_CLASSES.values() for r in instances]
    assert len(names) == len(set(names)) == len(RECIPES)
    assert sorted(config._CLASSES) == sorted(c.__name__ for c in (*RECIPE_CLASSES, *config._WRAPPERS))
    for cls, instances in RECIPE_CLASSES.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, f"{cls.__name__}: a frozen dataclass"
        assert instances and all(type(r) is cls for r in instances)
    # every recipe class the package exports is registered
    exported = {getattr(d, n) for n in d.__all__ if isinstance(getattr(d, n), type) and issubclass(getattr(d, n), d.Recipe)}
    # PerExpert (formats/experts.py) is not a recipe of its own but a registered recipe applied to each
    # expert of a 3-D weight (made per weight by per_expert: it has no default instance to register)
    assert exported - {d.Recipe, d.PerExpert} == set(RECIPE_CLASSES)


def test_golden_vectors_cover_every_recipe_te_writes_on_sm90():
    """TE 2.20.2's golden vectors (tests/golden) hold every recipe but MXFP8, whose TE quantize needs
    sm_100+ (its bytes are checked against the spec instead: tests/test_formats_spec.py)."""
    te_recipes = {RECIPES[n].te_binding.te_recipe for n in RECIPES if RECIPES[n].te_binding.min_capability < (10, 0)}
    families = {k.split("/")[0] for k, v in load_golden().items() if isinstance(v, dict) and "buffers" in v}
    assert te_recipes <= families, f"add TE's golden vectors for {te_recipes - families} (tests/golden/README.md)"
