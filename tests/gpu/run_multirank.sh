#!/usr/bin/env bash
# Real shards on one GPU (issue 21), in one call of under ~6 minutes on an H200 with 16 cores:
# the distributed suite over gloo with CUDA tensors (every rank on cuda:0) at world sizes 2 and 4
# (1-D meshes and the 2x2 ones: HSDP, dp x tp) and the TE multi-rank tests, as six pytest sessions
# in parallel (each its own rank pools; all of them share the GPU).
#
#   bash tests/gpu/run_multirank.sh          # logs under $OUT (default ./multirank_out)
#   SUITE_BACKEND=gloo SESSION_S=60 bash tests/gpu/run_multirank.sh    # the plumbing, on a CPU
#
# Writes (8 files): suite_ckpt.log, suite_tp.log, suite_fsdp.log, suite_hf.log, te_modules.log,
# te_training.log (pytest -v: each test's result as it happens), rank_logs.tgz (every rank's log:
# task timeline, tracebacks, faulthandler stacks of hung or killed ranks, SIGTERM reports),
# summary.txt (the machine, then each session's result; also printed last). A session past its limit gets SIGTERM: the test process and
# every rank write their stacks, then pytest prints its summary (tests/rank_logs.py).
set -u
OUT=${OUT:-$PWD/multirank_out}
SESSION_S=${SESSION_S:-300}   # per session; 10 s more before SIGKILL
SUITE_BACKEND=${SUITE_BACKEND:-gloo-cuda}
mkdir -p "$OUT"
RANK_LOGS=$(mktemp -d)
export COLUMNS=200 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 GLOO_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0
# Per-test limit above the pools' task limit, so that the pool reports first (which rank, stacks).
PYTEST=(python -m pytest -v -rfEs -p no:cacheprovider --durations=8 --maxfail=6 -o faulthandler_timeout=200)
if python -c "import pytest_timeout" 2>/dev/null; then
  PYTEST+=(-p timeout --timeout=240 --timeout-method=signal)
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,compute_mode --format=csv,noheader 2>&1
  python - <<'PY' 2>&1
import importlib.util, sys, torch
te = importlib.util.find_spec("transformer_engine") is not None
print("torch", torch.__version__, "| python", sys.version.split()[0], "| cuda", torch.cuda.is_available(),
      "| transformer_engine", "found" if te else "absent",
      "| pytest-timeout", importlib.util.find_spec("pytest_timeout") is not None)
PY
  echo "cores $(nproc) | $(free -g | awk '/Mem:/{print "mem " $2 " GiB"}') | ulimit -n $(ulimit -n)"
  df -h /dev/shm /tmp | tail -n +2
} > "$RANK_LOGS/env.txt" 2>&1

session() {  # name, then environment assignments and the pytest arguments
  local name=$1; shift
  mkdir -p "$RANK_LOGS/$name"
  local t0=$SECONDS
  env DTENSOR_FP8_TEST_LOG_DIR="$RANK_LOGS/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/$name.log"
}
# The suite's distributed files on CUDA tensors, split by cost (CPU timings) into four sessions.
# Left out: the one-process files (formats, tensor ops, recipe configs, gemm, kernels: nothing new
# with ranks on one GPU) and test_torch_compile.py (inductor compiles every graph on every rank).
# Collectives time out after 30 s and a task after 75 s: each such test costs at most that.
SUITE=(DTENSOR_FP8_TEST_BACKEND=$SUITE_BACKEND DTENSOR_FP8_TEST_WORLD_SIZES=2,4 DTENSOR_FP8_TEST_GROUP_TIMEOUT=30
       DTENSOR_FP8_TEST_TASK_TIMEOUT=75 DTENSOR_FP8_TEST_STARTUP_TIMEOUT=150)
TE=(DTENSOR_FP8_TEST_GROUP_TIMEOUT=60 DTENSOR_FP8_TEST_TASK_TIMEOUT=170 DTENSOR_FP8_TEST_STARTUP_TIMEOUT=150)
LIMIT=(timeout -k 10 "$SESSION_S")
session suite_ckpt "${SUITE[@]}" "${LIMIT[@]}" "${PYTEST[@]}" tests/test_checkpoint.py tests/test_compat.py &
session suite_tp "${SUITE[@]}" "${LIMIT[@]}" "${PYTEST[@]}" tests/test_tp.py tests/test_tp_checkpoint.py \
  tests/test_tp_sequence_parallel.py &
session suite_fsdp "${SUITE[@]}" "${LIMIT[@]}" "${PYTEST[@]}" tests/test_fsdp.py tests/test_placement.py \
  tests/test_optim.py tests/test_dist_utils.py &
# Written for 2 ranks (its 256-row weights shard into whole 128-row blocks there): no 4-rank pool.
session suite_hf "${SUITE[@]}" DTENSOR_FP8_TEST_WORLD_SIZES=2 "${LIMIT[@]}" "${PYTEST[@]}" tests/test_hf_llama.py &
session te_modules "${TE[@]}" "${LIMIT[@]}" "${PYTEST[@]}" -s tests/gpu/test_multirank_te_modules.py &
session te_training "${TE[@]}" "${LIMIT[@]}" "${PYTEST[@]}" -s tests/gpu/test_multirank_te_training.py &
wait

tar czf "$OUT/rank_logs.tgz" -C "$RANK_LOGS" . 2>/dev/null
{
  sed 's/^/== /' "$RANK_LOGS/env.txt"
  for name in suite_ckpt suite_tp suite_fsdp suite_hf te_modules te_training; do
    log="$OUT/$name.log"
    result=$(grep -aE '^=+ .*(passed|failed|error|skipped|no tests ran|deselected).* in [0-9.]+s' "$log" | tail -1 | tr -d '=')
    echo "== $name: ${result:-no pytest summary} | $(tail -1 "$log")"
    grep -aE '^(FAILED|ERROR) ' "$log" | cut -c1-240 | head -8
    grep -aq 'KeyboardInterrupt: SIGTERM' "$log" && echo "   stopped by the session limit at: $(grep -aE '^tests/.*::' "$log" | tail -1 | sed "s/ \[rank_logs\].*//" | cut -c1-160)"
  done
  echo "rank logs: rank_logs.tgz ($(du -h "$OUT/rank_logs.tgz" | cut -f1))"
} | tee "$OUT/summary.txt"
