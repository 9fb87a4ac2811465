#!/usr/bin/env bash
# The GPU suites on one GPU in one call of under 9 minutes, the parts at once (the GPU has room for
# them; the test sessions run niced, so the host-bound benchmark keeps its core):
#   gpu_suite    tests/gpu (TE, Triton, CUDA graphs, FP8 GEMMs)
#   nccl_suite   the distributed suite over NCCL at one rank per GPU (the README's command)
#   gloo_cuda    the schedule / pipeline / owner-write / split-block / expert files with CUDA tensors at world sizes 2 and 4 (8),
#                every rank on cuda:0 (collectives staged through host memory, tests/staging_backend.py)
#   convergence  the convergence benchmark (docs/benchmarks.md)
#   speed        linear_step's step time: the 102 M byte-lm shape, then the Llama3-8B shape with memory at
#                peak (not in the default PARTS: run it alone, PARTS=speed, or its timings are shared-machine ones)
#
#   export PYTHONPATH=$PWD/.gpu/site:$PWD NVTE_FRAMEWORK=pytorch   # TE on the path
#   PARTS="gpu_suite nccl_suite" bash tests/gpu/run_gpu_suites.sh   # from the repository root; results under $OUT
#
# PARTS defaults to all four. A torchao wheel in .whl/ (torchao-*.whl) is installed into /tmp for the
# benchmark's torchao row. Writes to $OUT (default ./gpu_out): <part>.log (and .xml for the test
# parts: junit XML), convergence.{json,png}, summary.txt (the machine, each part's exit status and
# time, failures, the convergence table and target; also printed last). A part past its limit gets
# SIGTERM: pytest prints its summary of what ran (tests/rank_logs.py), the benchmark keeps the runs
# it finished (queued seed by seed) in its JSON, from which the tables, target and plot are then made.
set -u
OUT=${OUT:-$PWD/gpu_out}
PARTS=${PARTS:-gpu_suite nccl_suite gloo_cuda convergence}
wants() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
SUITE_S=${SUITE_S:-480}      # each test session
BENCH_S=${BENCH_S:-480}      # the convergence benchmark
SPEED_S=${SPEED_S:-270}      # each speed shape
# BENCH_ARGS: more convergence options, after the defaults (the last given wins), e.g. to check the
# plumbing on a CPU: SUITE_S=30 BENCH_S=120 BENCH_ARGS="--device cpu --shape toy --steps 8" bash ...
read -r -a BENCH_EXTRA <<< "${BENCH_ARGS:-}"
export PYTHONUNBUFFERED=1 COLUMNS=200 NCCL_NVLS_ENABLE=0 NVTE_FRAMEWORK=${NVTE_FRAMEWORK:-pytorch}
T0=$SECONDS
{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  echo "cores $(env -u OMP_NUM_THREADS nproc); commit $(git log --oneline -1 2>/dev/null || echo unknown)"
} > "$OUT/summary.txt"

if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .whl/torchao-*.whl > /tmp/install_torchao.log 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "torchao: installed from $(ls .whl/torchao-*.whl)" >> "$OUT/summary.txt"
  else
    { echo "torchao: install FAILED"; tail -n 5 /tmp/install_torchao.log; } >> "$OUT/summary.txt"
  fi
fi
python3 - >> "$OUT/summary.txt" 2>&1 <<'PY'
import importlib, importlib.util, sys, torch
def version(name):
    try:
        return importlib.import_module(name).__version__
    except Exception as e:  # noqa: BLE001
        return f"absent ({type(e).__name__})"
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "",
      "| transformer_engine", "found" if importlib.util.find_spec("transformer_engine") else "absent",
      "| torchao", version("torchao"), "| accelerate", version("accelerate"),
      "| xdist", "found" if importlib.util.find_spec("xdist") else "absent")
PY

part() {  # part NAME LIMIT CMD...: runs CMD with its output in $OUT/NAME.log, its status appended to it
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/$name.log"
}
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=300)
TESTS_ENV=(env OMP_NUM_THREADS=2 DTENSOR_FP8_TEST_TASK_TIMEOUT=200)

wants gpu_suite && part gpu_suite "$SUITE_S" nice -n 10 "${TESTS_ENV[@]}" "${PYTEST[@]}" -n 6 --dist loadfile \
  --junitxml="$OUT/gpu_suite.xml" tests/gpu &
wants nccl_suite && part nccl_suite "$SUITE_S" nice -n 10 "${TESTS_ENV[@]}" DTENSOR_FP8_TEST_BACKEND=nccl DTENSOR_FP8_TEST_WORLD_SIZES=1 \
  "${PYTEST[@]}" -n 8 --junitxml="$OUT/nccl_suite.xml" tests --ignore=tests/gpu &
wants gloo_cuda && part gloo_cuda "$SUITE_S" nice -n 10 "${TESTS_ENV[@]}" DTENSOR_FP8_TEST_BACKEND=gloo-cuda \
  DTENSOR_FP8_TEST_WORLD_SIZES=2,4 "${PYTEST[@]}" -n 4 --dist loadfile --junitxml="$OUT/gloo_cuda.xml" \
  tests/test_pipeline.py tests/test_pipeline_checkpoint.py tests/test_schedules.py tests/test_owner_writes.py \
  tests/test_split_blocks.py tests/test_tp_split_blocks.py tests/test_layouts_benchmark.py \
  tests/test_experts_fsdp.py tests/test_experts_optim.py &
# The benchmark's defaults are the GPU run (6 rows x seeds 0,1,2 on 6 worker processes sharing the GPU and the cores):
# run it alone (PARTS=convergence) for its figures; beside the test parts it competes with them for the cores.
wants convergence && part convergence "$BENCH_S" python3 -m dtensor_fp8.benchmarks convergence \
  --variants bf16,current,delayed,blockwise2d,mxfp8_emulated,torchao_compiled --seeds 0,1,2 --out "$OUT" \
  ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} &
wait

# After the other parts (its timings need the GPU and the cores to itself): compiled rows first, then
# the references; each row's JSON is written as it finishes, so a cut keeps the rows done.
SPEED_ROWS=current_bf16_masters_compiled,blockwise2d_bf16_masters_compiled,bf16,bf16_compiled,torchao_compiled
wants speed && part speed_byte_lm "$SPEED_S" python3 -m dtensor_fp8.benchmarks linear_step --shape byte-lm \
  --variants "$SPEED_ROWS" --steps 8 --warmup 4 --out "$OUT/speed_byte_lm"
wants speed && part speed_llama3_8b "$SPEED_S" python3 -m dtensor_fp8.benchmarks linear_step --shape llama3-8b \
  --variants "$SPEED_ROWS" --steps 5 --warmup 3 --memory-at-peak --out "$OUT/speed_llama3_8b"

if wants convergence && ! grep -q "^target:" "$OUT/convergence.log" && [ -f "$OUT/convergence.json" ]; then  # cut short: its finished rows
  python3 -m dtensor_fp8.benchmarks convergence --from-json "$OUT/convergence.json" --out "$OUT" >> "$OUT/convergence.log" 2>&1
fi

{
  for name in gpu_suite nccl_suite gloo_cuda; do
    wants "$name" || continue
    log="$OUT/$name.log"
    result=$(grep -aE '^=*.*([0-9]+ (passed|failed|error|errors|skipped)).* in [0-9.]+s' "$log" | tail -1 | tr -d '=')
    echo "== $name: ${result:-no pytest summary} | $(tail -1 "$log")"
    [ -z "$result" ] && grep -a -m 3 -E "[Ee]rror" "$log" | cut -c1-240
    grep -aE '^(FAILED|ERROR) ' "$log" | cut -c1-240 | head -25
    grep -aq 'KeyboardInterrupt: SIGTERM' "$log" && echo "   stopped by the time limit (${SUITE_S} s)"
  done
  if wants convergence; then
    status=$(grep -a '^exit [0-9]* after' "$OUT/convergence.log" | tail -1)
    echo "== convergence: $status"
    case $status in "exit 124 "* | "exit 137 "*) echo "   cut short by its limit (${BENCH_S} s): the rows it finished";; esac
    grep -a -E '^# |^  [a-z0-9_]+ +seed |^stopped:|^wrote .*json after' "$OUT/convergence.log" | cut -c1-240
    sed -n '/^| row /,/^target:/{/^target:/!p}' "$OUT/convergence.log"   # the table and the per-seed table
    sed -n '/^target:/,/^$/p' "$OUT/convergence.log"
  fi
  if wants speed; then
    for name in speed_byte_lm speed_llama3_8b; do
      echo "== $name: $(tail -1 "$OUT/$name.log")"
      sed -n '/^| variant/,/^$/p' "$OUT/$name.log"
    done
  fi
  echo "== total $((SECONDS - T0)) s"
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
