"""The state-dict layout torchtitan's checkpointer keeps for FP8 parameters (``torchtitan.py``'s note
on the state dict): each FP8 weight's entry, a dict of planes, flattened into tensors
(``<fqn>.rowwise_data``, ...; the recipe config as a uint8 tensor), and gathered back on loading.
Used by ``FP8ParameterLinear`` (its ``weight``) and the FP8 ``GroupedExperts`` (its 3-D expert
weights)."""

from __future__ import annotations

import re

import torch

from ..entry import RECIPE_KEY, recipe_from_tensor, recipe_tensor


def flatten_fp8_entries(module, state_dict, prefix, local_metadata, *, weights=("weight",)) -> None:
    """State-dict post-hook: the entry (a dict of planes) of each FP8 parameter named in ``weights``
    flattened into tensors (see the module docstring); the recipe as a uint8 tensor.

    Args:
        module, state_dict, prefix, local_metadata: as ``nn.Module.register_state_dict_post_hook`` passes them.
        weights: the module's FP8 parameter names.

    Example:
        >>> module.register_state_dict_post_hook(functools.partial(flatten_fp8_entries, weights=("w1",)))
    """
    for weight in weights:
        key = prefix + weight
        entry = state_dict.get(key)
        if not isinstance(entry, dict):  # high-precision export, or no FP8 weight
            continue
        del state_dict[key]
        for name, value in entry.items():
            state_dict[f"{key}.{name}"] = recipe_tensor(value) if name == RECIPE_KEY else value


def gather_fp8_entries(module, state_dict, prefix, *args, weights=("weight",)) -> None:
    """Load pre-hook, the inverse of :func:`flatten_fp8_entries`.

    Example:
        >>> module.register_load_state_dict_pre_hook(functools.partial(gather_fp8_entries, weights=("w1",)))
    """
    for weight in weights:
        key = prefix + weight
        sub = re.compile(re.escape(key) + r"\.(\w+)$")
        names = {m.group(1): k for k in list(state_dict) if (m := sub.match(k))}
        if not names:
            continue
        entry = {name: state_dict.pop(k) for name, k in names.items()}
        if isinstance(entry.get(RECIPE_KEY), torch.Tensor):
            entry[RECIPE_KEY] = recipe_from_tensor(entry[RECIPE_KEY])
        state_dict[key] = entry
