"""dtensor_fp8: FP8 parameters (per-tensor, MXFP8, blockwise) as DTensors for FSDP2, DCP and TP.

Quick start::

    import dtensor_fp8
    q = dtensor_fp8.quantize(weight, dtensor_fp8.MXFP8())    # bit-exact with Transformer Engine
    y = torch.nn.functional.linear(x, q)                       # forward reads the rowwise plane
    bufs = dtensor_fp8.te_layout(q)                            # TE's own attribute layout
"""

from . import ops as _ops  # noqa: F401  (registers the op table)
from .formats import (
    COLUMNWISE,
    ROWWISE,
    Blockwise,
    Recipe,
    CurrentScaling,
    DelayedScaling,
    MXFP8,
    PerExpert,
    Plane,
    per_expert,
    RECIPES,
    RecipeError,
)
from . import fsdp as _fsdp  # noqa: F401  (installs the FSDP2 all-gather extension)
from . import settings  # noqa: F401  (the kernel / GEMM switches: dtensor_fp8.settings.override)
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, load_hp_checkpoint, save_checkpoint
from .hp_load import load_hp_state_dict
from .state_dict import export_hp_state_dict, high_precision_state_dict
from .export_fp8 import export_fp8_hf
from .fsdp import gather_both_usages
from .describe import describe
from .linear import quantized_linear
from .optim import MasterWeightOptimizer
from .module import finish_init_, quantize_module_
from .operand_scaling import update_operand_scaling_
from .placement import check_shardable, distribute, distribute_quantized, for_usage
from .quantize import quantize, te_layout
from .tensor import QuantizedTensor
from .tp import check_tp_plan, parallelize_module
from .ops import QuantizedTransposeView

__version__ = "0.1.0"

__all__ = [
    "Blockwise", "CheckpointError", "COLUMNWISE", "Recipe", "CurrentScaling", "DelayedScaling", "MXFP8", "PerExpert", "per_expert", "Plane",
    "QuantizedTensor", "RECIPES", "ROWWISE", "RecipeError", "check_shardable", "distribute", "distribute_quantized",
    "describe", "export_fp8_hf", "export_hp_state_dict", "high_precision_state_dict", "latest_checkpoint", "load_checkpoint", "load_hp_checkpoint", "load_hp_state_dict", "save_checkpoint",
    "finish_init_", "for_usage", "gather_both_usages", "MasterWeightOptimizer", "quantize", "quantize_module_",
    "quantized_linear", "te_layout", "check_tp_plan", "parallelize_module", "QuantizedTransposeView",
    "update_operand_scaling_",
]
