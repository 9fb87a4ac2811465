"""What an integration adds to the fix an error of the core names.

The storage and op code (``tensor.py``) names the library's own fix (build a
``MasterWeightOptimizer``, call ``finish_init_``) and knows no integration; an integration that
trains FP8 weights its own way registers the line its users need (torchtitan's: the job config's
optimizer) when it is imported, and the error appends it. A leaf: it imports nothing.
"""

from __future__ import annotations

#: the topic of the fix "train FP8 weights through high-precision masters, whose optimizer makes
#: and updates their bytes" (a meta-built weight's pending bytes; an optimizer writing in place)
MASTER_WEIGHTS = "master weights"
#: the topic of the fix "shard an expert weight over its experts (dim 0), not inside each expert"
EXPERT_SHARDING = "expert sharding"

_HINTS: dict[str, dict[str, str]] = {}


def register_fix_hint(topic: str, integration: str, text: str) -> None:
    """Add ``text`` (one or two sentences, in ``integration``'s own words) to every error of the
    core whose fix is ``topic``; registering the same integration again replaces its text.

    Args:
        topic: the fix's topic (:data:`MASTER_WEIGHTS`, :data:`EXPERT_SHARDING`).
        integration: the integration's name (one text per integration and topic).
        text: what its users do instead.

    Example:
        >>> register_fix_hint(MASTER_WEIGHTS, "torchtitan", "In torchtitan, set the job config's optimizer to ...")
    """
    _HINTS.setdefault(topic, {})[integration] = text


def fix_hints(topic: str) -> str:
    """The registered texts of ``topic``, each after a space ("" when none is registered).

    Example:
        >>> "dtensor_fp8.finish_init_(model) before the first forward." + fix_hints(MASTER_WEIGHTS)
    """
    return "".join(" " + text for text in _HINTS.get(topic, {}).values())


__all__ = ["EXPERT_SHARDING", "MASTER_WEIGHTS", "register_fix_hint", "fix_hints"]
