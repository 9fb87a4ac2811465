"""The GPU suite cannot rot unseen: on the CPU, tests/gpu is collected, and every call it makes into
``dtensor_fp8`` binds to the library's current signatures (tests/call_check.py).

tests/gpu's modules skip at import on a machine without CUDA or Transformer Engine, so nothing in
them runs in CPU CI: issue 41 found ten GPU tests that had failed since the library changed under
them (``requantize_from_hp_`` called with an argument it had lost). Why a static check, and not
the alternatives the issue names:

* a type checker (mypy / pyright over the library and tests/gpu) would also see these calls, but
  the library is not annotated for one (it would report thousands of unrelated errors or need a
  configuration to maintain), it is a new tool for CI to install, and it trusts annotations, not
  the signatures Python actually binds;
* CPU twins of the GPU tests' calls would have to be written and kept in step by hand for every
  new GPU test, which is the step that was missed.

This check needs neither: it reads every tests/gpu module with ``ast``, resolves each call to a
``dtensor_fp8`` callable through the module's imports and simple assignments, and binds the
call's arguments to ``inspect.signature`` of the callable as the library defines it now; a name
imported from the library that no longer exists is reported too, and so is a benchmark option or
a test path that the GPU scripts (tests/gpu/*.sh) name and that no longer exists. What it cannot
see (a method reached through a subscript or a fixture) it counts, and the test asserts it
resolved enough calls that it cannot pass by resolving none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from call_check import REPO, Report, check_file, check_shell, check_source

GPU_SUITE = REPO / "tests" / "gpu"
#: What the check bound on tests/gpu when it was written: 175 of the 204 calls it saw rooted in the
#: library, and 20 benchmark commands and test paths of the scripts. A drop well below means it
#: stopped resolving something (or the suite shrank): look before lowering this.
MIN_CHECKED = 150


def _suite_report() -> tuple[Report, dict[str, int]]:
    total, per_file = Report(), {}
    for path in sorted(GPU_SUITE.glob("*.py")):
        report = check_file(path)
        per_file[path.name] = len(report.checked)
        total.merge(report)
    for path in sorted(GPU_SUITE.glob("*.sh")):
        report = check_shell(path.read_text(), str(path.relative_to(REPO)))
        per_file[path.name] = len(report.checked)
        total.merge(report)
    return total, per_file


def test_gpu_suite_calls_match_the_library():
    report, per_file = _suite_report()
    assert not report.problems, "tests/gpu no longer matches the library:\n" + "\n".join(report.problems)
    assert len(report.checked) >= MIN_CHECKED, (len(report.checked), per_file, report.unresolved)
    # Each test module that imports the library has calls the check resolved; each script has
    # commands it checked.
    for name, n in per_file.items():
        if name.startswith("test_") or name.endswith(".sh"):
            assert n > 0, f"{name}: no call or command resolved ({per_file})"


def test_gpu_suite_collects_on_cpu():
    """``pytest --collect-only tests/gpu`` on this machine (no CUDA, no TE here in CI): every module
    imports or skips itself cleanly, none errors (a module that skips at its top is still read
    in full by the call check above)."""
    # a fresh pytest: not one of this session's xdist workers, whatever suite backend this one runs
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTENSOR_FP8_TEST_", "PYTEST_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(GPU_SUITE)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    # 0: tests collected; 5: none (every module skipped itself); 2 / 4 would be collection errors / usage.
    assert proc.returncode in (0, 5), out[-4000:]
    assert "error" not in out.splitlines()[-1].lower(), out[-4000:]


# ---- the checker itself fails where it should -------------------------------------------------------
#: The call tests/gpu/test_te_kernels.py made until issue 41 (requantize_from_hp_ once took a dict of
#: scaling states as its second argument).
OLD_REQUANTIZE_CALL = """
import torch
import dtensor_fp8 as d
from dtensor_fp8.requantize import requantize_from_hp_

def test_requantize():
    q = d.quantize(torch.randn(256, 256), d.DelayedScaling())
    states = {}
    requantize_from_hp_([("w0", q, torch.randn(256, 256))], states)
"""


def test_the_check_fails_on_the_old_requantize_call():
    report = check_source(OLD_REQUANTIZE_CALL, "old.py")
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith("old.py:9: requantize_from_hp_(")
    assert "dtensor_fp8.requantize.requantize_from_hp_(items)" in report.problems[0]
    assert "too many positional arguments" in report.problems[0]
    fixed = check_source(OLD_REQUANTIZE_CALL.replace("], states)", "])"), "fixed.py")
    assert fixed.problems == []
    assert "fixed.py:9 dtensor_fp8.requantize.requantize_from_hp_" in fixed.checked


def test_the_check_follows_imports_assignments_and_return_annotations():
    source = """
import dtensor_fp8
import dtensor_fp8 as d
from dtensor_fp8 import gemm as g
from dtensor_fp8.tensor import Gone

def test_a(w):
    from dtensor_fp8.formats.scaled_mm import SCALE_LAYOUTS, GONE_TOO
    q = d.quantize(w, d.CurrentScaling())           # q: QuantizedTensor (quantize's return annotation)
    q.plane("rowwise", "columnwise")                # QuantizedTensor.plane(self, usage)
    dtensor_fp8.Blockwise(block_dims=2, rows=1)     # no such keyword
    g.fp8_gemms(mode="on")                          # fp8_gemms(m)
    d.no_such_function()
"""
    problems = check_source(source, "t.py").problems
    expected = [
        ("t.py:5:", "dtensor_fp8.tensor.Gone"),
        ("t.py:8:", "dtensor_fp8.formats.scaled_mm.GONE_TOO"),
        ("t.py:10:", "too many positional arguments"),
        ("t.py:11:", "unexpected keyword argument 'rows'"),
        ("t.py:12:", "unexpected keyword argument 'mode'"),
        ("t.py:13:", "has no attribute 'no_such_function'"),
    ]
    assert len(problems) == len(expected), problems
    for (where, what), problem in zip(expected, sorted(problems, key=lambda p: int(p.split(":")[1]))):
        assert problem.startswith(where) and what in problem, (where, what, problem)


def test_the_check_leaves_shadowed_and_rebound_names_alone():
    """A parameter, a loop variable or a second assignment of another kind hides what a name was
    bound to: nothing is checked through it (no false alarm)."""
    source = """
import dtensor_fp8 as d
from dtensor_fp8 import gemm

def test_param(gemm):
    gemm.anything(1, 2, 3)

def test_loop(w):
    for q in [w]:
        q.plane(1, 2, 3)

def test_rebound(w, other):
    q = d.quantize(w, d.CurrentScaling())
    q = other
    q.plane(1, 2, 3)
"""
    report = check_source(source, "t.py")
    assert report.problems == []
    assert [c.split()[1] for c in report.checked] == ["dtensor_fp8.quantize.quantize",
                                                      "dtensor_fp8.formats.per_tensor.CurrentScaling"]


def test_the_script_check_fails_on_unknown_subcommands_options_and_paths():
    script = """#!/usr/bin/env bash
stage q 60 python3 -m dtensor_fp8.benchmarks quantize --out "$OUT" --no-such-option 3 > "$OUT/q.log" 2>&1
python -m dtensor_fp8.benchmarks linear_step \\
  --compile --steps 3 --out "$OUT"
python -m dtensor_fp8.benchmarks no_such_subcommand
python -m pytest -q tests/gpu/test_gemm_gpu.py tests/gpu/test_gone.py::test_x
"""
    report = check_shell(script, "s.sh")
    assert len(report.problems) == 3, report.problems
    assert "quantize: no option '--no-such-option'" in report.problems[0]
    assert "no_such_subcommand: no such subcommand" in report.problems[1]
    assert report.problems[2] == "s.sh: tests/gpu/test_gone.py does not exist"
    assert report.checked == ["s.sh benchmarks quantize", "s.sh benchmarks linear_step", "s.sh tests/gpu/test_gemm_gpu.py"]


@pytest.mark.parametrize("name", ["run_gemm_gpu.sh", "run_multirank.sh"])
def test_the_gpu_scripts_are_read(name):
    """The script check sees the scripts' commands (a parser that saw nothing would pass them)."""
    path = GPU_SUITE / name
    assert check_shell(path.read_text(), name).checked, name

