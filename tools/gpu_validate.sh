#!/usr/bin/env bash
# GPU validation for a session that is lent a device machine (see the GPU validation issue).
# Run on the device machine from the repository root, one stage or several per call (each call
# is limited to 10 minutes):
#     OUT=$OUT bash tools/gpu_validate.sh build test      # then, in a second call:
#     OUT=$OUT bash tools/gpu_validate.sh bench
# Stages: env (always), build (CUDA extension, editable), test (whole suite on the GPU),
# bench (block, attention, swiglu, rowwise, demo). Everything lands in at most 6 files under
# $OUT (the device tool returns at most 8): gpu_env.txt, gpu_build.log, gpu_tests.log,
# gpu_bench.log and gpu_results.tgz (bench/results/*). Without $OUT, under bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
log() { echo "[gpu_validate $(date -u +%H:%M:%S)] $*"; }
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build test bench)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__)"
  nvcc --version | tail -2
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); date: $(date -u '+%Y-%m-%d %H:%M UTC')"
} > "$out/gpu_env.txt" 2>&1
cat "$out/gpu_env.txt"

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      log "build (CUDA extension)"
      if ! MAX_JOBS="${MAX_JOBS:-16}" python3 -m pip install --no-build-isolation --no-deps -e . \
          > "$out/gpu_build.log" 2>&1; then
        tail -40 "$out/gpu_build.log"; log "build FAILED"; exit 1
      fi
      grep "ckpt_ext build" "$out/gpu_build.log"
      python3 -c "import ckpt_ext; assert ckpt_ext._C.with_cuda, 'not a CUDA build'; print('CUDA build loaded')"
      ;;
    test)
      log "tests on the GPU"
      python3 -m pytest -q -ra tests > "$out/gpu_tests.log" 2>&1
      tail -25 "$out/gpu_tests.log"
      ;;
    bench)
      log "benchmarks"
      {
        python3 bench/block.py --device cuda --dtype bfloat16 --hidden 4096 --heads 32 \
            --kv-heads 32 --intermediate 11008 --seq 4096 --batch 1
        python3 bench/attention.py
        python3 bench/swiglu.py
        python3 bench/rowwise.py
        python3 bench/demo.py
      } > "$out/gpu_bench.log" 2>&1
      tail -60 "$out/gpu_bench.log"
      tar czf "$out/gpu_results.tgz" bench/results
      ;;
    *) echo "unknown stage '$stage' (env, build, test, bench)"; exit 2 ;;
  esac
done
log "done"
