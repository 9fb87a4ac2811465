"""One codec per FP8 recipe: the only code that knows byte layouts."""

from .base import COLUMNWISE, ROWWISE, USAGES, BlockShape, Codec, Plane, RecipeError
from .blockwise import Blockwise
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling

__all__ = [
    "BlockShape", "Blockwise", "Codec", "COLUMNWISE", "CurrentScaling", "DelayedScaling",
    "MXFP8", "Plane", "RecipeError", "ROWWISE", "USAGES",
]
