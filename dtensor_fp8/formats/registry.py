"""Every recipe, registered once: the one table that adding a recipe touches beside its codec file
and golden vectors (docs/README.md, "Adding a recipe"). The recipe names (``RECIPES``), the
checkpoint configs' classes (``config.py``) and the package's exports derive from it, and
``tests/test_recipe_registry.py`` fails when a recipe misses anything else it needs (its TE classes,
its export, a test oracle for its scale shapes)."""

from __future__ import annotations

from .base import Recipe, RecipeError
from .blockwise import Blockwise
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling

#: Each recipe class, with its instances under TE's defaults (one per ``name``: command lines, tests,
#: messages). Recipes are frozen dataclasses, so one shared instance per name is safe.
RECIPE_CLASSES: dict[type[Recipe], tuple[Recipe, ...]] = {
    DelayedScaling: (DelayedScaling(),),
    CurrentScaling: (CurrentScaling(),),
    MXFP8: (MXFP8(),),
    Blockwise: (Blockwise(block_dims=1), Blockwise(block_dims=2)),
}

#: Each registered recipe with TE's defaults, by its ``name``.
RECIPES: dict[str, Recipe] = {r.name: r for instances in RECIPE_CLASSES.values() for r in instances}


def recipe_named(name: str, caller: str) -> Recipe:
    """The registered recipe called ``name`` (a command line's or a config's string).

    Args:
        name: a key of :data:`RECIPES`.
        caller: who asks, for the error (e.g. ``"FP8ParameterConverter"``).

    Raises:
        RecipeError: ``name`` is not registered, naming the choices.

    Example:
        >>> recipe_named("mxfp8", "FP8ParameterConverter")
        MXFP8(...)
    """
    if name not in RECIPES:
        raise RecipeError(f"{caller}: unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]
