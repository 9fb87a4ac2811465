"""The step benchmarks' model shapes (benchmarks/shapes.py) and ``linear_step`` run end to end on
the CPU at the ``toy`` shape: the Llama3-8B preset has Llama's weights (checked against
``transformers``' own Llama built from the same numbers), the plain-torch block computes
grouped-query attention as torch's SDPA does, and the JSON's tokens/s, MFU and rows follow from
what was timed. The GPU shapes themselves run on the H200 (docs/benchmarks.md)."""

import json

import pytest
import torch

from dtensor_fp8.benchmarks import linear_step
from dtensor_fp8.benchmarks.shapes import PRESETS, ModelShape, mfu, tokens_per_s
from dtensor_fp8.benchmarks.te_step import _parse as te_step_parse
from dtensor_fp8.benchmarks.te_step.variants import StepConfig, transformer_layer_kwargs


def test_llama3_8b_preset_has_the_weights_of_transformers_llama():
    transformers = pytest.importorskip("transformers")
    shape = PRESETS["llama3-8b"]
    config = transformers.LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                      num_hidden_layers=1, vocab_size=128, mlp_bias=shape.bias,
                                      attention_bias=shape.bias)
    with torch.device("meta"):
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, layer_idx=0)
    hf = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert hf == shape.gemm_params // shape.layers
    assert not any(m.bias is not None for m in layer.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_block_weights_are_the_shapes_gemm_params(name):
    shape = PRESETS[name]
    model = linear_step.Model(shape, "meta")
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 4 * shape.layers
    assert sum(w.numel() for w in weights) == shape.gemm_params
    assert all((m.bias is not None) == shape.bias for m in model.modules() if isinstance(m, torch.nn.Linear))
    norm = torch.nn.RMSNorm if shape.norm == "rmsnorm" else torch.nn.LayerNorm
    assert isinstance(model.layers[0].ln1, norm)
    # torchtitan's count: 6 FLOPs per weight per token, 12 * layers * heads * head_dim * seq for attention
    attention = 12 * shape.layers * shape.hidden * shape.seq
    assert shape.flops_per_token == 6 * sum(w.numel() for w in weights) + attention


def test_grouped_query_attention_matches_sdpa_enable_gqa():
    shape = PRESETS["toy"]
    torch.manual_seed(0)
    block = linear_step.Block(shape, "cpu", torch.float32)
    x = torch.randn(shape.seq, shape.batch, shape.hidden)
    s, b, h, d = shape.seq, shape.batch, shape.hidden, shape.head_dim
    kv = shape.kv_heads * d
    q, k, v = block.qkv(block.ln1(x)).split([h, kv, kv], dim=-1)
    q, k, v = (t.reshape(s, b, -1, d).permute(1, 2, 0, 3) for t in (q, k, v))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x1 = x + block.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
    gate, up = block.fc1(block.ln2(x1)).chunk(2, dim=-1)
    want = x1 + block.fc2(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(block(x), want)


def test_shape_options_override_the_preset_and_refuse_bad_shapes(capsys):
    args, _, _ = te_step_parse(["--shape", "llama3-8b", "--layers", "2", "--seq", "4096"])
    assert args.model_shape == ModelShape(**{**vars(PRESETS["llama3-8b"]), "layers": 2, "seq": 4096})
    assert StepConfig(model_shape=args.model_shape).model_shape == args.model_shape
    assert transformer_layer_kwargs(args.model_shape) == {"num_gqa_groups": 8, "normalization": "RMSNorm",
                                                         "activation": "swiglu", "bias": False}
    assert StepConfig().model_shape == PRESETS["te-default"]  # earlier runs' shape stays the default
    with pytest.raises(SystemExit):
        te_step_parse(["--shape", "llama3-8b", "--kv-heads", "5"])
    assert "heads 32 must be a multiple of kv_heads 5" in capsys.readouterr().err


def test_linear_step_runs_the_toy_shape_on_cpu(tmp_path, capsys):
    rc = linear_step.main(["--shape", "toy", "--device", "cpu", "--steps", "2", "--warmup", "1",
                           "--variants", "bf16,current_bf16_masters,te_current", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "linear_step.json").read_text())
    shape = PRESETS["toy"]
    assert report["meta"]["config"]["kv_heads"] == shape.kv_heads
    assert report["meta"]["gemm_params"] == shape.gemm_params
    rows = {r["variant"]: r for r in report["results"]}
    for name in ("bf16", "current_bf16_masters"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert len(r["step_ms"]) == 2 and r["median_ms"] > 0 and r["losses_finite"]
        assert r["tokens_per_s"] == pytest.approx(tokens_per_s(shape, r["median_ms"]))
        assert r["mfu"] is None  # no known peak for a CPU
    assert rows["current_bf16_masters"]["fp8_weights"] == f"{4 * shape.layers}/{4 * shape.layers}"
    assert "warning" not in rows["current_bf16_masters"]  # the CPU runs the emulated linear by default
    assert rows["te_current"]["status"] == "not run"
    assert "| current_bf16_masters |" in report["table_markdown"]
    assert "tokens/s" in capsys.readouterr().out


def test_mfu_is_model_flops_over_the_peak():
    shape = PRESETS["llama3-8b"]
    assert mfu(shape, 100.0, None) is None
    assert mfu(shape, 100.0, 989e12) == pytest.approx(shape.flops_per_token * shape.tokens * 10 / 989e12)


def test_linear_step_counts_the_fp8_gemms_that_ran(tmp_path):
    """The count comes from the profiler at run time: 3 scaled GEMMs per linear where torch's CPU
    kernel runs them (``fp8_gemms("on")``), none where the emulated linear runs (the default)."""
    from dtensor_fp8 import gemm

    args = ["--shape", "toy", "--device", "cpu", "--layers", "1", "--seq", "16", "--batch", "1", "--steps", "1",
            "--warmup", "2", "--variants", "current_bf16_masters"]
    counts = {}
    for mode in ("on", "auto"):
        with gemm.fp8_gemms(mode):
            assert linear_step.main(args + ["--out", str(tmp_path / mode)]) == 0
        (row,) = json.loads((tmp_path / mode / "linear_step.json").read_text())["results"]
        assert row["status"] == "ok" and "warning" not in row, row
        counts[mode] = row["fp8_gemms_per_step"]
    assert counts == {"on": 3 * 4, "auto": 0}
