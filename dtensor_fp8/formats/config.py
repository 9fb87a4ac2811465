"""A recipe's identity in a checkpoint: a versioned config of plain values.

[Note: recipe configs]
A checkpoint names the recipe of each FP8 weight by a JSON object of plain values, e.g.
``{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e4m3fn"}``: ``recipe`` is the class,
``format`` the version of this config layout, and every other key a field of the recipe
(dataclass fields; dtypes by their torch name). Nothing in it runs code when read.

Newer code reads older checkpoints: a field an older checkpoint lacks (a field added to a recipe
since) takes the value it implicitly had then, from :data:`IMPLICIT_BEFORE_FIELD_EXISTED`, else
the field's default; format 0 is the ``repr`` string written by dtensor_fp8 before the configs
(``"MXFP8(fp8_dtype=torch.float8_e4m3fn)"``), parsed without ``eval``. A checkpoint newer than the
code (an unknown recipe, field or format) is refused with the fix: upgrade dtensor_fp8.
"""

from __future__ import annotations

import ast
import dataclasses
import json

import torch

from .base import Recipe, RecipeError
from .experts import PerExpert
from .registry import RECIPE_CLASSES

#: the config layout written now
CONFIG_FORMAT = 1
#: Recipes that wrap another one (``PerExpert``: a registered recipe applied to each expert of a 3-D
#: weight) store it as a nested config object in their field (``{"recipe": "PerExpert", "format": 1,
#: "base": {"recipe": "MXFP8", ...}, "expert_rows": 256}``).
_WRAPPERS: tuple[type, ...] = (PerExpert,)
_CLASSES: dict[str, type] = {c.__name__: c for c in (*RECIPE_CLASSES, *_WRAPPERS)}
#: (recipe class name, field) -> the value a checkpoint written before the field existed implies.
#: Add an entry whenever a field is added whose default differs from the behaviour before it.
IMPLICIT_BEFORE_FIELD_EXISTED: dict[tuple[str, str], object] = {}


def _plain(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Recipe):  # a wrapped recipe: its own config, nested
        return json.loads(recipe_config(value))
    return value


def _typed(field: dataclasses.Field, value, where: str):
    if isinstance(value, dict):  # a nested recipe config (a wrapper's base)
        if field.type not in ("Recipe", Recipe):
            raise RecipeError(f"{where}: field {field.name} holds an object, which only a recipe field may")
        return recipe_from_config(json.dumps(value))
    if field.type in ("torch.dtype", torch.dtype) or isinstance(field.default, torch.dtype):
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype):
            raise RecipeError(f"{where}: field {field.name}={value!r} is not a torch dtype name")
        return dtype
    return value


def recipe_config(recipe: Recipe) -> str:
    """The JSON config a checkpoint stores for ``recipe`` (see the note).

    Args:
        recipe: a recipe object.

    Example:
        >>> recipe_config(MXFP8())
        '{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e4m3fn"}'
    """
    fields = {f.name: _plain(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)}
    return json.dumps({"recipe": type(recipe).__name__, "format": CONFIG_FORMAT, **fields})


def recipe_from_config(config: str) -> Recipe:
    """The recipe a checkpoint's config (any format up to :data:`CONFIG_FORMAT`) names.

    Args:
        config: what :func:`recipe_config` wrote, or a format-0 ``repr`` string.

    Example:
        >>> recipe_from_config(recipe_config(Blockwise(block_dims=1))) == Blockwise(block_dims=1)
        True
    """
    if not isinstance(config, str):
        raise RecipeError(f"recipe config must be a string, got {type(config).__name__}")
    if config.lstrip().startswith("{"):
        try:
            values = json.loads(config)
        except json.JSONDecodeError as err:
            raise RecipeError(f"recipe config {config[:200]!r} is not valid JSON ({err})") from None
        fmt = values.pop("format", None)
        name = values.pop("recipe", None)
        if not isinstance(fmt, int) or fmt > CONFIG_FORMAT or fmt < 1:
            raise RecipeError(f"recipe config {config[:200]!r} has format {fmt!r}; this dtensor_fp8 reads formats up to "
                              f"{CONFIG_FORMAT}. Upgrade dtensor_fp8 to read this checkpoint.")
    else:
        name, values = _parse_repr(config)
    cls = _CLASSES.get(name)
    if cls is None:
        raise RecipeError(f"recipe config names an unknown recipe {name!r} (known: {sorted(_CLASSES)}); it was written "
                          "by a newer dtensor_fp8: upgrade to read it")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise RecipeError(f"recipe config {config[:200]!r} has fields {unknown} that {name} does not know; it was "
                          "written by a newer dtensor_fp8: upgrade to read it")
    kwargs = {k: _typed(fields[k], v, name) for k, v in values.items()}
    for field in fields:
        if field not in kwargs and (name, field) in IMPLICIT_BEFORE_FIELD_EXISTED:
            kwargs[field] = IMPLICIT_BEFORE_FIELD_EXISTED[(name, field)]
    return cls(**kwargs)


def _parse_repr(text: str) -> tuple[str, dict]:
    """``Name(field=value, ...)`` (format 0) as ``(name, fields)``: literals and ``torch.<dtype>`` only."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        node = None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise RecipeError(f"recipe config {text[:200]!r} is neither a JSON config nor a recipe repr")
    values = {}
    for kw in node.keywords:
        v = kw.value
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "torch":
            values[kw.arg] = v.attr
        else:
            try:
                values[kw.arg] = ast.literal_eval(v)
            except ValueError:
                raise RecipeError(f"recipe config {text[:200]!r}: {kw.arg} is not a literal") from None
    return node.func.id, values
