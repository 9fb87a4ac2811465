"""torchtitan's routed MoE experts (``GroupedExperts``) with FP8 expert weights.

[Note: FP8 expert weights in torchtitan]
``FP8ParameterConverter.Config(targets="experts" | "both")`` swaps each ``GroupedExperts.Config`` of
a model config (DeepSeek-V3, Qwen3 MoE, ...) for the config of :func:`fp8_grouped_experts_cls`'s
subclass, as torchtitan's own ``Float8GroupedExpertsConverter`` does. The subclass:

* makes its 3-D weights (``w1_EFD``, ``w2_EDF``, ``w3_EFD``: ``[experts, out, in]``) FP8 parameters
  quantized per expert (``dtensor_fp8/formats/experts.py``) with
  ``quantize_module_(..., experts=...)``, when torchtitan builds the model on the meta device; the
  model's ``param_init`` writes their values and the ``MasterWeightOptimizer`` makes the bytes;
* overrides the ``_grouped_mm`` seam with :func:`dtensor_fp8.grouped_mm.grouped_mm`: the forward
  GEMM reads the rowwise plane FSDP2 gathered, the input gradient the columnwise plane (torch's
  scaled grouped GEMM where ``grouped_fp8.py`` has one, else emulated: planes dequantized, then
  ``torch._grouped_mm``).

* keeps torchtitan's checkpointer's state-dict layout: each expert weight's entry flattened into
  tensors (``torchtitan_state_dict.py``), as ``FP8ParameterLinear``'s.

Tested through torchtitan's own functions (tests/torchtitan_moe.py), DeepSeek-V3 and Qwen3 MoE,
every recipe: FSDP2 at 2 and 4 ranks; expert parallelism, EP 2 x FSDP2 2 at 4 ranks (torchtitan's
``distribute_tensor`` ``Shard(0)`` on ``ep``, then ``fully_shard`` over ``efsdp``: the expert DTensor is
``(_StridedShard(0), Shard(0))`` over whole experts, which the owner record places, gathers,
completes and checkpoints as any ``Shard(0)``); PP 2 x FSDP2 2 through ``pipeline_llm``; resume
through ``CheckpointManager`` and FSDP2 <-> EP reshard, byte-exact.

Tensor parallelism (``tensor_parallel_degree`` without EP): torchtitan shards ``w1`` / ``w3``
``Shard(1)`` and ``w2`` ``Shard(2)`` on ``tp``; a ``Shard(1)`` piece is an expert weight of its own
(``ops/expert_rows.py``), so the seam and FSDP2 over the experts run on it unchanged (TP 2 x FSDP2 2;
with EP on, torchtitan 0.3 shards the experts over ``ep`` only, EP 2 x TP 2 included). Hugging Face
starts go through ``FP8CheckpointManager``'s ``initial_load_in_hf`` and the model's own adapter.

What is not done yet (issue 48's next slices): FSDP2's ``Shard(1)`` of expert weights (torchtitan
picks it when ``efsdp * ep`` exceeds the expert count: refused by the slicing ops where it cuts
inside blocks, naming the fix); TP pieces that split an expert's blocks; torchtitan runs on CUDA
(the scaled grouped GEMM, ``grouped_fp8.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from torchtitan.models.common.moe import GroupedExperts

from ..fix_hints import EXPERT_SHARDING, register_fix_hint
from ..formats.registry import recipe_named
from ..formats.base import RecipeError
from ..formats.experts import per_expert
from ..grouped_mm import grouped_mm
from ..module import quantize_module_
from .torchtitan_state_dict import flatten_fp8_entries, gather_fp8_entries


def _expert_weights(module) -> tuple[str, ...]:
    """Names of the module's own 3-D parameters: its expert weights."""
    return tuple(n for n, p in module.named_parameters(recurse=False) if p.dim() == 3)


@functools.cache
def fp8_grouped_experts_cls(base: type) -> type:
    """The subclass of torchtitan's ``GroupedExperts`` class ``base`` with FP8 expert weights (see
    the note); one per base class.

    Args:
        base: ``GroupedExperts`` or a subclass of it.

    Example:
        >>> cls = fp8_grouped_experts_cls(GroupedExperts)
        >>> with torch.device("meta"):
        ...     experts = cls.Config(dim=256, hidden_dim=256, num_experts=8, recipe="mxfp8").build()
    """
    class FP8GroupedExperts(base):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):  # type: ignore[misc, name-defined]
            recipe: str = "mxfp8"
            """dtensor_fp8 recipe name: delayed, current, mxfp8, blockwise1d or blockwise2d."""

        def __init__(self, config):
            super().__init__(config)
            names = _expert_weights(self)
            # torchtitan's checkpointer keeps tensors only: each FP8 expert weight's entry flattened, as
            # FP8ParameterLinear's (registered before quantize_module_'s hooks on loading, after on saving)
            self.register_load_state_dict_pre_hook(functools.partial(gather_fp8_entries, weights=names))
            quantize_module_(self, recipe_named(config.recipe, "FP8ParameterConverter"), filter_fn=lambda m, fqn: False,
                             experts=lambda m, fqn: names if m is self else ())
            self.register_state_dict_post_hook(functools.partial(flatten_fp8_entries, weights=names))

        def _grouped_mm(self, *, A, B_t, offs):
            return grouped_mm(A, B_t, offs)

    FP8GroupedExperts.__name__ = FP8GroupedExperts.__qualname__ = f"FP8Parameter{base.__name__}"
    FP8GroupedExperts.Config.__qualname__ = f"FP8Parameter{base.__name__}.Config"
    return FP8GroupedExperts


def convert_grouped_experts(model_config, recipe_name: str, recipe, skip=()):
    """``model_config`` with every ``GroupedExperts.Config`` whose FQN contains none of ``skip``
    swapped for the FP8 one (see the note), or a :class:`RecipeError` listing every one whose
    shapes ``recipe`` cannot hold per expert (nothing is swapped then).

    Args:
        model_config: a torchtitan model config.
        recipe_name: the recipe's name (stored in the new configs).
        recipe: the recipe object.
        skip: FQN substrings to keep in high precision.

    Example:
        >>> config = convert_grouped_experts(config, "mxfp8", dtensor_fp8.MXFP8())
    """
    found = list(model_config.traverse(GroupedExperts.Config))
    targets, problems = [], []
    for fqn, config, parent, attr in found:
        if any(s in fqn for s in skip):
            continue
        if isinstance(type(config)._owner, type) and type(config)._owner.__name__.startswith(("FP8Parameter", "Float8", "MXFP8")):
            problems.append(f"{fqn}: already converted by another FP8 converter ({type(config).__qualname__})")
            continue
        e, hidden, dim = config.num_experts, config.hidden_dim, config.dim
        try:
            for shape in ((e, hidden, dim), (e, dim, hidden)):
                per_expert(recipe, shape)
        except RecipeError as err:
            problems.append(f"{fqn}: {err}")
            continue
        targets.append((fqn, config, parent, attr))
    if problems:
        raise RecipeError(f"FP8ParameterConverter({recipe_name!r}): nothing was converted; {len(problems)} GroupedExperts "
                          "cannot hold FP8 expert weights:\n  " + "\n  ".join(problems) +
                          "\nKeep them in high precision with filter_fqns=[...] or targets='dense'.")
    for _, config, parent, attr in targets:
        cls = fp8_grouped_experts_cls(type(config)._owner)
        new = cls.Config(**{f.name: getattr(config, f.name) for f in fields(config)}, recipe=recipe_name)
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


# torchtitan's fully_shard cuts inside each expert (Shard(1)) once its ranks outnumber the experts,
# which FP8 expert weights refuse (ops/slicing.py): the refusal names torchtitan's own knobs.
register_fix_hint(EXPERT_SHARDING, "torchtitan", (
    "In torchtitan, keep efsdp x ep (the ranks the routed experts are sharded over in the MoE layers' "
    "mesh) at or below the number of routed experts, so that FSDP2 shards whole experts."))
