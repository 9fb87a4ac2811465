"""One module per FP8 recipe: the only code that knows byte layouts."""

from .base import COLUMNWISE, ROWWISE, USAGES, BlockShape, Recipe, Plane, RecipeError
from .blockwise import Blockwise
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling

#: Each recipe with TE's defaults, by its ``name`` (command lines, tests). Recipes are frozen
#: dataclasses, so one shared instance per name is safe.
RECIPES: dict[str, Recipe] = {
    c.name: c for c in (DelayedScaling(), CurrentScaling(), MXFP8(), Blockwise(block_dims=1), Blockwise(block_dims=2))
}

__all__ = [
    "BlockShape", "Blockwise", "Recipe", "COLUMNWISE", "CurrentScaling", "DelayedScaling",
    "MXFP8", "Plane", "RECIPES", "RecipeError", "ROWWISE", "USAGES",
]
