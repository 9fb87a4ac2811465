#!/usr/bin/env bash
# Issue 18 on the GPU machine in one call (under 8 minutes): the FP8-GEMM and Triton-kernel GPU
# tests, then the quantize and linear_step benchmarks. Logs and JSON go to $OUT (default ./gpu_out).
#
#   bash tests/gpu/run_gemm_gpu.sh          # from the repository root; carry .gpu (TE wheels) and,
#                                           # for the torchao row, .whl (torchao wheel)
#
# Each stage has its own time limit so one slow stage cannot eat the others'; the last lines
# printed are a summary of every stage's exit status and the two benchmark tables.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export NVTE_FRAMEWORK=pytorch PYTHONUNBUFFERED=1
site=/tmp/issue18_site
ao_site=/tmp/issue18_ao_site
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/wheels/*.whl \
    > "$OUT/install_te.log" 2>&1 && echo "TE wheels installed" || echo "TE wheels NOT installed (see install_te.log)"
fi
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ao_site" .whl/torchao-*.whl \
    > "$OUT/install_torchao.log" 2>&1 && echo "torchao wheel installed" || echo "torchao NOT installed (see install_torchao.log)"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/versions.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/versions.txt"

status=()
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 4 "$OUT/$name.log"
}

stage pytest_gemm 170 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/pytest_gemm.xml" \
  tests/gpu/test_gemm_gpu.py tests/gpu/test_triton_gpu.py tests/gpu/test_te_kernels.py tests/gpu/test_master_graph.py
stage quantize 60 python3 -m dtensor_fp8.benchmarks quantize --out "$OUT"
PYTHONPATH="$PYTHONPATH:$ao_site" stage linear_step 230 python3 -m dtensor_fp8.benchmarks linear_step --compile --out "$OUT"

echo
echo "== summary"
printf '%s\n' "${status[@]}"
echo
sed -n '/^| recipe | impl/,/^$/p' "$OUT/quantize.log"
sed -n '/^| variant/,/^$/p' "$OUT/linear_step.log"
grep -E "passed|failed" "$OUT/pytest_gemm.log" | tail -n 2
