"""The on-disk entry of one FP8 weight: its key grammar, in one place.

An FP8 weight's state-dict entry (written by ``state_dict.py``'s hook, one dict per weight) is::

    "<fqn>": {
        "recipe":                 the recipe's config string (RECIPE_KEY)
        "<usage>_data":           the FP8 bytes of a stored plane, usage "rowwise" / "columnwise"
        "<usage>_scale_inv":      its scales (E8M0 ones as their bytes)
        "<usage>_<field>":        the weight scaling state of that plane (delayed: amax_history, scale)
        "<operand>_<field>":      an activation's / gradient's scaling state (operand "input" / "grad")
    }

DCP flattens it to ``"<fqn>.<name>"`` keys; torchtitan's checkpointer keeps them flat in the model's
state dict, with the recipe as a fixed-size uint8 tensor (:func:`recipe_tensor`: its state dicts
hold tensors only). The optimizer's state for the weight holds ``"master"`` (:data:`MASTER_KEY`)
beside the inner optimizer's own keys; torch names modules' opaque state ``"_extra_state"``.

Every reader and writer of these names asks this module: the state-dict hook, the owner record's
scaling state, the optimizer's load, the DCP loader (old layouts included), the high-precision
loaders and torchtitan's flattening. To add a field to the entry: write it in
``state_dict.plane_entries`` (or the owner record's ``scaling.entries()``), and if a checkpoint written before
it lacks it, teach :func:`is_scaling_state_entry` (or its own predicate here) so loads name it
missing instead of torn.
"""

from __future__ import annotations

import torch

from .formats.base import USAGES, RecipeError

#: the recipe's config string in a weight's entry
RECIPE_KEY = "recipe"
#: the plane tensors of a weight's entry, ``"<usage>_<field>"``; its other ``"<usage>_<field>"`` entries
#: are the weight scaling state's
PLANE_FIELDS = ("data", "scale_inv")
#: the GEMM operands whose scaling state a weight's owner record keeps: activations and output gradients
OPERANDS = ("input", "grad")
#: the optimizer state's key of an FP8 parameter's master
MASTER_KEY = "master"
#: torch's key suffix for ``Module.get_extra_state()`` (a module's opaque state, set through
#: ``set_extra_state``, never written in place; TE keeps its FP8 metadata there as a pickled uint8
#: tensor whose length changes)
EXTRA_STATE_SUFFIX = "_extra_state"
#: bytes of :func:`recipe_tensor`: fixed, so every checkpoint's entry has one shape
RECIPE_FIELD_BYTES = 256


def plane_key(usage: str, field: str) -> str:
    """The entry name of a plane's tensor.

    Args:
        usage: ``"rowwise"`` or ``"columnwise"``.
        field: one of :data:`PLANE_FIELDS`.

    Example:
        >>> plane_key("rowwise", "scale_inv")
        'rowwise_scale_inv'
    """
    return f"{usage}_{field}"


def _name(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def weight_key(key: str) -> str:
    """The weight's key of a flat entry key (``"layer.weight.rowwise_data"`` -> ``"layer.weight"``).

    Args:
        key: a flattened ``"<fqn>.<name>"`` key.

    Example:
        >>> weight_key("w.recipe")
        'w'
    """
    return key.rsplit(".", 1)[0]


def is_recipe_key(key: str) -> bool:
    """Whether a flat key is a weight entry's recipe: each FP8 weight of a checkpoint has one.

    Args:
        key: a flattened state-dict key.

    Example:
        >>> is_recipe_key("layers.0.w1.weight.recipe"), is_recipe_key("layers.0.norm.weight")
        (True, False)
    """
    return key.endswith("." + RECIPE_KEY)


def is_master_key(key: str) -> bool:
    """Whether a flat optimizer-state key is an FP8 parameter's master (``"state.<fqn>.master"``).

    Args:
        key: a flattened state-dict key.

    Example:
        >>> is_master_key("optim.state.w.master")
        True
    """
    return key.endswith("." + MASTER_KEY)


def is_extra_state(key: str) -> bool:
    """Whether a state-dict key is a module's extra state (``Module.get_extra_state``).

    Args:
        key: a state-dict key.

    Example:
        >>> is_extra_state("layers.0.mlp._extra_state")
        True
    """
    return key == EXTRA_STATE_SUFFIX or key.endswith("." + EXTRA_STATE_SUFFIX)


def is_operand_state_entry(key: str) -> bool:
    """Whether a state-dict key (``...weight.input_amax_history``) is an operand scaling state's: an
    entry a checkpoint written before these were saved lacks (see ``state_dict.py``).

    Args:
        key: a flattened state-dict key.

    Example:
        >>> is_operand_state_entry("w.grad_scale")
        True
    """
    return _name(key).split("_", 1)[0] in OPERANDS


def is_weight_state_entry(key: str) -> bool:
    """Whether a state-dict key (``...weight.rowwise_amax_history``) is a weight scaling state's
    (``"<usage>_<field>"`` other than the plane tensors): saved in the weight's model entry, and
    under the optimizer's state by checkpoints written before (``checkpoint/save_load.py`` reads
    those where the model entry asks for them).

    Args:
        key: a flattened state-dict key.

    Example:
        >>> is_weight_state_entry("w.rowwise_scale"), is_weight_state_entry("w.rowwise_scale_inv")
        (True, False)
    """
    usage, _, name = _name(key).partition("_")
    return usage in USAGES and name not in PLANE_FIELDS


def is_scaling_state_entry(key: str) -> bool:
    """An operand's or the weight's scaling state entry: what a checkpoint written before such
    states were saved in the model's entry lacks (``load_checkpoint(..., strict=False)`` names it
    missing and it starts afresh).

    Args:
        key: a flattened state-dict key.

    Example:
        >>> is_scaling_state_entry("w.input_scale"), is_scaling_state_entry("w.rowwise_data")
        (True, False)
    """
    return is_operand_state_entry(key) or is_weight_state_entry(key)


def recipe_tensor(config: str) -> torch.Tensor:
    """A recipe config as a ``(RECIPE_FIELD_BYTES,)`` uint8 tensor, zero-padded: for state dicts
    that hold tensors only (torchtitan's checkpointer).

    Args:
        config: the entry's recipe string (``formats.config.recipe_config``).

    Example:
        >>> recipe_from_tensor(recipe_tensor('{"recipe": "MXFP8"}'))
        '{"recipe": "MXFP8"}'
    """
    raw = config.encode()
    if len(raw) > RECIPE_FIELD_BYTES:
        raise RecipeError(f"recipe config of {len(raw)} bytes does not fit the {RECIPE_FIELD_BYTES}-byte "
                         f"checkpoint field: {config!r}")
    out = torch.zeros(RECIPE_FIELD_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def recipe_from_tensor(value: torch.Tensor) -> str:
    """The recipe config held by :func:`recipe_tensor`'s tensor.

    Args:
        value: the ``<fqn>.weight.recipe`` entry.

    Example:
        >>> recipe_tensor('{"recipe": "MXFP8"}').shape
        torch.Size([256])
    """
    return bytes(value.cpu().tolist()).rstrip(b"\0").decode()
