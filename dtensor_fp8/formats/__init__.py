"""One codec per FP8 recipe: the only code that knows byte layouts."""

from .base import COLUMNWISE, ROWWISE, USAGES, BlockShape, Codec, Plane, RecipeError
from .blockwise import Blockwise
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling

#: Each recipe with TE's defaults, by its ``name`` (command lines, tests). Codecs are frozen
#: dataclasses, so one shared instance per name is safe.
RECIPES: dict[str, Codec] = {
    c.name: c for c in (DelayedScaling(), CurrentScaling(), MXFP8(), Blockwise(block_dims=1), Blockwise(block_dims=2))
}

__all__ = [
    "BlockShape", "Blockwise", "Codec", "COLUMNWISE", "CurrentScaling", "DelayedScaling",
    "MXFP8", "Plane", "RECIPES", "RecipeError", "ROWWISE", "USAGES",
]
