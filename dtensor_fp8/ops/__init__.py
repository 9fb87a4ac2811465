"""The ops of ``QuantizedTensor``: the aten ops FSDP2, DTensor and DCP apply to parameters, and the
GEMMs of a quantized weight. Importing this package fills the op tables of ``op_table.py``; every
registration is a ``@TABLE.implements([...])`` in one of these files, one concept each:

* ``slicing.py``: block-aligned slice / split / chunk / as_strided / pad / cat, and the shard rule;
* ``copies.py``: aliases, views, copies and allocation;
* ``init.py``: ``torch.nn.init``'s in-place ops on a meta-built weight's pending values;
* ``collectives.py``: DTensor's functional collectives (FP8 bytes on the wire);
* ``gemm.py``: ``F.linear`` and the tensor-parallel ``mm`` / ``addmm`` (``QuantizedTransposeView``);
* ``spmd_types.py``: ``spmd_types``' tensor-parallel shard op (torchtitan's default TP backend).
"""

from . import collectives, copies, gemm, init, slicing, spmd_types  # noqa: F401  (each registers its ops)
from .gemm import QuantizedTransposeView
from .slicing import cat_quantized, check_shardable, chunk_of, shard_boundaries, slice_quantized, zeros_like_quantized

__all__ = [
    "QuantizedTransposeView", "cat_quantized", "check_shardable", "chunk_of", "shard_boundaries",
    "slice_quantized", "zeros_like_quantized",
]
