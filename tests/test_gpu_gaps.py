"""benchmarks/gpu_gaps.py: idle gaps of a Chrome trace and the Python frames each one waited on.

The GPU traces it reads come from the H200 (``linear_step --profile --trace``); here a trace in the
same format (torch.profiler's Kineto export: kernels, runtime launches sharing a correlation id,
python_function events, annotations and aten ops nesting in time) is written out by hand, with gaps whose
lengths and launching stacks are known, and a real CPU trace checks the error for a trace
without GPU activity.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from dtensor_fp8.benchmarks import gpu_gaps

PID, MAIN, ENGINE = 1, 10, 11


def _py(pid_, ts, dur, name, tid=MAIN, parent=None):
    return {"ph": "X", "cat": "python_function", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Python id": pid_, "Python parent id": parent}}


def _kernel(ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _launch(ts, corr, tid=MAIN):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": PID, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def _trace():
    return [
        _py(1, 0, 1000, "train.py(1): step"),
        _py(2, 10, 300, "dtensor_fp8/fsdp.py(374): fsdp_post_all_gather", parent=1),
        _py(3, 20, 30, "dtensor_fp8/te.py(304): from_shard", parent=2),  # returned before the launch at 200
        _py(4, 400, 500, "torch/autograd/graph.py(1): backward", tid=ENGINE),
        _py(5, 410, 300, "dtensor_fp8/gemm.py(9): grad_quantize", tid=ENGINE, parent=4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": PID, "tid": MAIN, "ts": 5, "dur": 3, "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::copy_out", "pid": PID, "tid": MAIN, "ts": 190, "dur": 20,
         "args": {}},
        _launch(8, 1), _kernel(50, 100, 1),          # GPU starts at 50: 45 us after the first CPU event
        _launch(200, 2), _kernel(230, 20, 2),        # gap 150 -> 230 (80 us), launched inside fsdp_post_all_gather
        _kernel(240, 30, 3),                         # overlaps the previous one: no gap
        _launch(600, 4, tid=ENGINE), _kernel(610, 10, 4),  # gap 270 -> 610 (340 us), from the engine thread
        _kernel(630, 5, 5),                          # a 10 us gap: counted, not listed at min_gap_us=20
    ]


def test_gaps_are_measured_and_charged_to_the_launching_frames(tmp_path):
    path = tmp_path / "trace_x.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    report = gpu_gaps.gpu_gaps(gpu_gaps.load_trace(str(path)), min_gap_us=20, depth=2)
    assert report["idle_us"] == pytest.approx(80 + 340 + 10)
    assert report["busy_us"] == pytest.approx(100 + 40 + 10 + 5)
    assert report["span_us"] == pytest.approx(635 - 50)
    assert report["lead_in_us"] == pytest.approx(50)
    assert [(g["us"], g["stack"]) for g in report["gaps"]] == [
        (80, ["train.py(1): step", "dtensor_fp8/fsdp.py(374): fsdp_post_all_gather", "FSDP::copy_out"]),
        (340, ["torch/autograd/graph.py(1): backward", "dtensor_fp8/gemm.py(9): grad_quantize"]),
    ]
    assert report["by_frames"][0] == {"frames": "dtensor_fp8/gemm.py(9): grad_quantize < torch/autograd/graph.py(1): "
                                                "backward", "us": 340, "gaps": 1}
    assert "0.170 | 1 | dtensor_fp8/gemm.py(9)" in gpu_gaps.format_report(report, steps=2, top=5)


def test_command_writes_the_json(tmp_path, capsys):
    path = tmp_path / "trace_y.json"
    path.write_text(json.dumps(_trace()))
    assert gpu_gaps.main([str(path), "--steps", "1", "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "gpu_gaps_trace_y.json").read_text())
    assert saved["idle_us"] == pytest.approx(430) and len(saved["gaps"]) == 2
    assert "idle between its first and last activity 0.43 ms / step" in capsys.readouterr().out


def test_a_trace_without_gpu_activity_is_refused(tmp_path, capsys):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        (torch.randn(32, 32) @ torch.randn(32, 32)).sum()
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    assert gpu_gaps.main([str(path), "--out", str(tmp_path)]) == 2
    assert "no GPU events" in capsys.readouterr().err
