"""Recipe identity in checkpoints: versioned configs of plain values that newer code reads."""

import json

import pytest
import torch

import dtensor_fp8 as d
from dtensor_fp8.formats import config

ALL = list(d.RECIPES.values()) + [d.DelayedScaling(fp8_dtype=torch.float8_e5m2, margin=1, amax_history_len=16,
                                                   amax_compute_algo="most_recent"),
                                  d.CurrentScaling(force_pow_2_scales=True, amax_epsilon=1e-6),
                                  d.Blockwise(block_dims=1, force_pow_2_scales=False)]


@pytest.mark.parametrize("recipe", ALL, ids=repr)
def test_config_is_plain_json_and_round_trips(recipe):
    text = config.recipe_config(recipe)
    values = json.loads(text)  # plain values only: nothing to unpickle or eval
    assert values["recipe"] == type(recipe).__name__ and values["format"] == config.CONFIG_FORMAT
    assert all(isinstance(v, (str, int, float, bool)) for v in values.values())
    assert config.recipe_from_config(text) == recipe


@pytest.mark.parametrize("recipe", ALL, ids=repr)
def test_reads_the_repr_strings_of_older_checkpoints(recipe):
    """Format 0: what dtensor_fp8 wrote before configs (``repr(recipe)``), parsed without eval."""
    assert config.recipe_from_config(repr(recipe)) == recipe


def test_a_field_missing_from_an_older_config_takes_its_implicit_value(monkeypatch):
    old = json.dumps({"recipe": "DelayedScaling", "format": 1, "fp8_dtype": "float8_e4m3fn"})
    assert config.recipe_from_config(old) == d.DelayedScaling()  # absent fields: their defaults
    # A field added later whose default differs from the old behaviour: the recorded old value wins.
    monkeypatch.setitem(config.IMPLICIT_BEFORE_FIELD_EXISTED, ("DelayedScaling", "amax_history_len"), 1)
    assert config.recipe_from_config(old) == d.DelayedScaling(amax_history_len=1)


@pytest.mark.parametrize("text,match", [
    ('{"recipe": "MXFP8", "format": 99, "fp8_dtype": "float8_e4m3fn"}', "format 99.*Upgrade dtensor_fp8"),
    ('{"recipe": "NVFP4", "format": 1}', "unknown recipe 'NVFP4'.*upgrade"),
    ('{"recipe": "MXFP8", "format": 1, "swizzle": true}', r"fields \['swizzle'\].*upgrade"),
    ('{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e9m9"}', "not a torch dtype"),
    ('{"recipe": "CurrentScaling", "format": 1, "fp8_dtype": "int8"}', "fp8_dtype must be one of"),
    ("__import__('os').system('true')", "neither a JSON config nor a recipe repr"),
    ("MXFP8(fp8_dtype=__import__('os'))", "not a literal"),
])
def test_unreadable_configs_name_the_problem(text, match):
    with pytest.raises(d.RecipeError, match=match):
        config.recipe_from_config(text)
