"""One module per FP8 recipe: the only code that knows byte layouts."""

from .base import COLUMNWISE, ROWWISE, USAGES, BlockShape, Recipe, Plane, RecipeError
from .blockwise import Blockwise
from .experts import PerExpert, per_expert
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling
from .registry import RECIPE_CLASSES, RECIPES

__all__ = [
    "BlockShape", "Blockwise", "Recipe", "COLUMNWISE", "CurrentScaling", "DelayedScaling",
    "MXFP8", "PerExpert", "per_expert", "Plane", "RECIPE_CLASSES", "RECIPES", "RecipeError", "ROWWISE", "USAGES",
]
