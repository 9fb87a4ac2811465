"""dtensor_fp8/settings.py: the kernel and GEMM switches, parsed from the environment once and
overridden in-process without writing the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtensor_fp8 as d
from dtensor_fp8 import gemm, settings
from dtensor_fp8.formats import te_kernels, triton_kernels
from dtensor_fp8.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_when_nothing_is_set():
    assert Settings.from_environ({}) == Settings(fp8_gemms="auto", te_kernels=True, triton=True,
                                                 triton_software_cast=False, triton_interpret=False)
    # An empty variable counts as unset.
    assert Settings.from_environ({"DTENSOR_FP8_GEMMS": "", "DTENSOR_FP8_TRITON": ""}) == Settings()


def test_every_variable_is_parsed():
    env = {"DTENSOR_FP8_GEMMS": "off", "DTENSOR_FP8_TE_KERNELS": "0", "DTENSOR_FP8_TRITON": "0",
           "DTENSOR_FP8_TRITON_SOFTWARE_CAST": "1", "TRITON_INTERPRET": "1"}
    assert Settings.from_environ(env) == Settings(fp8_gemms="off", te_kernels=False, triton=False,
                                                  triton_software_cast=True, triton_interpret=True)
    assert Settings.from_environ({"DTENSOR_FP8_GEMMS": "on"}).fp8_gemms == "on"
    # TRITON_INTERPRET is Triton's: read as Triton reads it (1 / true / on, any case), never refused.
    assert [Settings.from_environ({"TRITON_INTERPRET": v}).triton_interpret for v in ("True", "on", "0", "no")] == [
        True, True, False, False]


@pytest.mark.parametrize("name,value,allowed", [
    ("DTENSOR_FP8_GEMMS", "yes", "auto, on, off"),
    ("DTENSOR_FP8_TE_KERNELS", "false", "1 (on) or 0 (off)"),
    ("DTENSOR_FP8_TRITON", "2", "1 (on) or 0 (off)"),
    ("DTENSOR_FP8_TRITON_SOFTWARE_CAST", "on", "1 (on) or 0 (off)"),
])
def test_a_bad_value_names_the_variable_and_the_allowed_values(name, value, allowed):
    with pytest.raises(ValueError) as e:
        Settings.from_environ({name: value})
    assert f"{name}={value!r}" in str(e.value) and allowed in str(e.value), e.value


def test_the_suite_environment_is_read_after_conftest_sets_it():
    # tests/conftest.py sets DTENSOR_FP8_GEMMS (default "off") before the package reads anything.
    assert settings.current() == Settings.from_environ(os.environ)
    assert gemm.mode() == os.environ["DTENSOR_FP8_GEMMS"]


def test_override_applies_within_the_block_and_restores():
    before = settings.current()
    with settings.override(fp8_gemms="on", te_kernels=False) as inside:
        assert settings.current() is inside and inside.fp8_gemms == "on" and not inside.te_kernels
        assert gemm.mode() == "on"
        with settings.override(triton=False):  # nested: changes only what it names
            assert (settings.current().fp8_gemms, settings.current().triton) == ("on", False)
        assert settings.current() is inside
    assert settings.current() is before
    with pytest.raises(RuntimeError, match="boom"):
        with settings.override(fp8_gemms="off"):
            raise RuntimeError("boom")
    assert settings.current() is before  # restored after an exception too


def test_override_refuses_bad_values_before_changing_anything():
    before = settings.current()
    with pytest.raises(ValueError, match="fp8_gemms='yes'"):
        with settings.override(fp8_gemms="yes"):
            pass
    with pytest.raises(ValueError, match="triton=1"):
        with settings.override(triton=1):
            pass
    with pytest.raises(TypeError):
        with settings.override(gemms="on"):  # not a field
            pass
    assert settings.current() is before


def test_switches_reach_the_kernel_choice_without_touching_the_environment():
    env_before = dict(os.environ)
    t = torch.ones(4, 4)
    with settings.override(triton_interpret=True, triton_software_cast=False):
        assert triton_kernels.interpreting() and triton_kernels.software_cast()  # the interpreter casts in software
        with te_kernels.reference_only():
            assert not settings.current().triton and not settings.current().te_kernels
            assert not triton_kernels.usable(t)
        with te_kernels.kernel_paths(te=True, triton=True):
            assert settings.current().triton and settings.current().te_kernels
    with gemm.fp8_gemms("on"):
        assert settings.current().fp8_gemms == "on"
    assert dict(os.environ) == env_before


def test_the_environment_is_read_once_at_first_use():
    """A fresh process: a malformed variable fails the first use (not the import), naming it; once
    parsed, later changes to the environment change nothing (in-process changes go through
    override)."""
    code = (
        "import os, dtensor_fp8 as d\n"
        "try:\n"
        "    d.settings.current()\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
        "os.environ['DTENSOR_FP8_TE_KERNELS'] = '0'\n"
        "first = d.settings.current()\n"
        "assert not first.te_kernels and first.fp8_gemms == 'off', first\n"
        "os.environ['DTENSOR_FP8_GEMMS'] = 'on'\n"
        "os.environ['DTENSOR_FP8_TRITON'] = 'maybe'\n"
        "assert d.settings.current() is first and d.gemm.mode() == 'off', d.settings.current()\n"
        "print('read once')\n"
    )
    env = {**os.environ, "DTENSOR_FP8_GEMMS": "off", "DTENSOR_FP8_TE_KERNELS": "yes", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "refused: DTENSOR_FP8_TE_KERNELS='yes': must be 1 (on) or 0 (off) (unset: 1)", "read once"], out.stdout


def test_settings_is_the_packages_settings_module():
    assert d.settings is settings
