"""The op tables (dtensor_fp8/op_table.py): one registration style, all of it in dtensor_fp8/ops/,
and a second registration of an op refused with an error naming it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtensor_fp8 as d
from dtensor_fp8.op_table import QUANTIZED_FUNCTIONS, QUANTIZED_OPS, TRANSPOSE_VIEW_OPS, OpTable

aten = torch.ops.aten
PACKAGE = Path(d.__file__).resolve().parent


def test_a_second_registration_is_refused_by_name():
    table = OpTable("Thing")

    @table.implements([aten.clone.default])
    def first(func, args, kwargs):
        return "first"

    with pytest.raises(ValueError, match=r"aten\.clone\.default already has an implementation for Thing.*first"):
        @table.implements([aten.add.Tensor, aten.clone.default])
        def second(func, args, kwargs):
            return "second"

    assert table.lookup(aten.clone.default) is first
    assert table.ops() == [aten.clone.default]  # the refused call registered nothing


def test_the_package_tables_refuse_overrides():
    impl = QUANTIZED_OPS.lookup(aten.clone.default)
    with pytest.raises(ValueError, match="aten.clone.default"):
        QUANTIZED_OPS.implements([aten.clone.default])(lambda func, args, kwargs: None)
    assert QUANTIZED_OPS.lookup(aten.clone.default) is impl
    with pytest.raises(ValueError, match="linear"):
        QUANTIZED_FUNCTIONS.implements([F.linear])(lambda *a, **k: None)


def test_lookup_by_overload_packet_and_missing_ops():
    assert QUANTIZED_OPS.lookup(aten.mm.default) is not None
    assert aten.sin.default not in QUANTIZED_OPS
    q = d.quantize(torch.randn(64, 64), d.MXFP8())
    with pytest.raises(NotImplementedError, match="aten.sin.default is not supported on a QuantizedTensor"):
        torch.sin(q)


def test_every_registration_is_in_the_ops_package():
    """Only files under dtensor_fp8/ops/ register ops, and only with ``TABLE.implements``."""
    tables = {"QUANTIZED_OPS", "QUANTIZED_FUNCTIONS", "TRANSPOSE_VIEW_OPS"}
    outside, other_style = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "implements" and rel != "op_table.py":
                if not rel.startswith("ops/"):
                    outside.append(rel)
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in tables:
                        other_style.append(rel)
    assert outside == [] and other_style == [], (outside, other_style)
    # and the tables are not empty: the ops package filled them
    assert len(QUANTIZED_OPS.ops()) > 20 and F.linear in QUANTIZED_FUNCTIONS and aten.mm.default in TRANSPOSE_VIEW_OPS
