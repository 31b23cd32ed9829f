#!/usr/bin/env bash
# GPU validation for a session that is lent a device machine (see the GPU validation issue).
# The one prepared call (build, then the issue's parts a-g each under its own timeout, about
# 495 s after the build, at most 8 files under $OUT, a one-screen summary last):
#     OUT=$OUT bash tools/gpu_validate.sh quick
#     bash tools/gpu_validate.sh quick --dry-run    # CPU, tiny sizes (tests/test_gpu_validate.py)
# (tools/gpu_quick.sh, which `quick` runs, says what each part does.)
# The older stages, one or several per call (each call is limited to 10 minutes):
#     OUT=$OUT bash tools/gpu_validate.sh build test      # then, in later calls:
#     OUT=$OUT bash tools/gpu_validate.sh build block kernels
#     OUT=$OUT bash tools/gpu_validate.sh build capacity
#     OUT=$OUT bash tools/gpu_validate.sh build peak
#     OUT=$OUT bash tools/gpu_validate.sh build offload
#     OUT=$OUT bash tools/gpu_validate.sh build demo bundle
# (each call starts with build: a device machine idle for 30 s is given back, and the next
# call gets a bare one).
# Stages: env (always), build (CUDA extension, editable, for this GPU's architecture only),
# test (whole suite on the GPU), block (LLaMA-7B layer, goals), kernels (attention, swiglu,
# lm_head, rowwise), capacity (LLaMA-3.1-8B LoRA step: peak per token of every setup, the
# longest sequence for HF checkpointing and min_memory), peak (the sequence-tiled layer's
# goals: LLaMA-3-8B layer dims, 4 layers, B 1, S 32K, bf16, the step's peak per token of
# every setup, full fine-tune and LoRA), offload (offload="cpu": tests/test_offload.py's CUDA
# tests, pinned memory, side stream, overlap in a profiler trace, TORCH_CUDA_SANITIZER=1, then
# step time and peak with and without offload at LLaMA-3-8B layer dims, 4 layers, S 32K,
# bf16, min_memory and balanced), demo, bundle (a tar of bench/results),
# and bench (= block kernels demo bundle). Times seen on an H100 (2026-11-24): build 72-91 s,
# test 7 min with 12 workers, block 2 min, kernels 4 min, capacity 2 min plus about 100 s per
# search step near 128K tokens. Everything lands in at most 6 files under
# $OUT (the device tool returns at most 8): gpu_env.txt, gpu_build.log, gpu_tests.log,
# gpu_bench.log and gpu_results.tgz (bench/results/*). Without $OUT, under bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = quick ]; then
  shift
  exec bash tools/gpu_quick.sh "$@"
fi
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

status=0
expand=()
for stage in "${stages[@]}"; do
  if [ "$stage" = bench ]; then expand+=(block kernels demo bundle); else expand+=("$stage"); fi
done
for stage in "${expand[@]}"; do
  case "$stage" in
    build)
      # Only this GPU's architecture: half the compile time of the default "8.0;9.0".
      arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
      log "build (CUDA extension, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch})"
      if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS="${MAX_JOBS:-16}" \
          python3 -m pip install --no-build-isolation --no-deps -e . \
          > "$out/gpu_build.log" 2>&1; then
        tail -40 "$out/gpu_build.log"; log "build FAILED"; exit 1
      fi
      grep "ckpt_ext build" "$out/gpu_build.log"
      python3 -c "import ckpt_ext; assert ckpt_ext._C.with_cuda, 'not a CUDA build'; print('CUDA build loaded')" \
          || exit 1
      ;;
    test)
      # Fixed kernel configurations (tests/conftest.py sets CKPT_EXT_AUTOTUNE=0; test_autotune
      # runs the tuned path) and, where pytest-xdist is installed, parallel workers: Triton
      # compiles each kernel specialization the tests meet, which is CPU work.
      workers=()
      python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}")
      log "tests on the GPU ${workers[*]}"
      # bounded, so that a slow run still leaves its log inside the call's 10 minutes
      timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -ra "${workers[@]}" tests \
          > "$out/gpu_tests.log" 2>&1 || status=1
      tail -25 "$out/gpu_tests.log"
      ;;
    block)
      log "LLaMA-7B layer: every preset, HF's own checkpointing, autocast, compiled and LoRA rows"
      python3 bench/block.py --llama7b --amp bfloat16 --compile --lora 16 --reps "${REPS:-10}" 2>&1 \
          | tee -a "$out/gpu_bench.log" || status=1
      ;;
    kernels)
      log "kernel benchmarks"
      # both dQ paths (CKPT_EXT_ATTN_DQ), both SwiGLU grids (CKPT_EXT_SWIGLU_GRID) and both
      # SwiGLU backward epilogues (CKPT_EXT_SWIGLU_EPILOGUE) in one run
      { python3 bench/attention.py --providers triton,triton_atomic,sdpa,eager \
          && python3 bench/lm_head.py --vocab 128256 --tokens 8192 \
          && python3 bench/swiglu.py \
          && CKPT_EXT_SWIGLU_GRID=tiles python3 bench/swiglu.py \
               --out bench/results/swiglu_tiles_gpu.csv \
          && CKPT_EXT_SWIGLU_EPILOGUE=whole python3 bench/swiglu.py \
               --out bench/results/swiglu_whole_epilogue_gpu.csv \
          && python3 bench/rowwise.py; } \
          2>&1 | tee -a "$out/gpu_bench.log" | tail -60 || status=1
      ;;
    capacity)
      log "LLaMA-3.1-8B LoRA step: peak per token, then the longest sequence (untuned kernels)"
      CKPT_EXT_AUTOTUNE=0 python3 bench/capacity.py --seqs 8192,16384 \
          --capacity hf_gc min_memory --time-budget "${CAPACITY_BUDGET:-240}" \
          --deadline "${CAPACITY_DEADLINE:-540}" 2>&1 | tee -a "$out/gpu_bench.log" | tail -30 \
          || status=1
      ;;
    peak)
      log "the step's peak per token at LLaMA-3-8B layer dims, 4 layers, S 32K, bf16"
      python3 bench/peak.py --device cuda --dtype bfloat16 --hidden 4096 --intermediate 14336 \
          --heads 32 --kv-heads 8 --vocab 128256 --layers 4 --seq "${PEAK_SEQ:-32768}" \
          --setups hf_gc torch+fused fast+fused balanced+fused min_memory+fused \
          lora:hf_gc lora:torch+fused lora:min_memory+fused 2>&1 \
          | tee -a "$out/gpu_bench.log" | tail -20 || status=1
      log "the layer's token chunks: step time and peak per chunk cap (1024GiB: one chunk)"
      python3 bench/chunk_overhead.py --device cuda --dtype bfloat16 --hidden 4096 \
          --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 --layers 4 \
          --seq "${PEAK_SEQ:-32768}" --caps 1024GiB 64MiB 256MiB 1GiB --reps 3 2>&1 \
          | tee -a "$out/gpu_bench.log" | tail -8 || status=1
      ;;
    offload)
      log "offload='cpu': the CUDA tests (streams, events, pinned memory, overlap, sanitizer;"
      log "streamed inputs: chunks copied from pinned host memory in the layer's backward)"
      python3 -m pytest -q -ra tests/test_offload.py tests/test_streamed_inputs.py 2>&1 \
          | tee -a "$out/gpu_bench.log" \
          | tail -15 || status=1
      log "offload='cpu': step time and peak with and without, LLaMA-3-8B layer dims, S 32K"
      python3 bench/offload.py --device cuda --dtype bfloat16 --hidden 4096 \
          --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 --layers 4 \
          --seq "${OFFLOAD_SEQ:-32768}" --presets min_memory balanced --repeats 5 2>&1 \
          | tee -a "$out/gpu_bench.log" | tail -12 || status=1
      ;;
    demo)
      log "demo (patched HF Llama)"
      python3 bench/demo.py 2>&1 | tee -a "$out/gpu_bench.log" | tail -30 || status=1
      ;;
    bundle)
      tar czf "$out/gpu_results.tgz" bench/results && log "bench/results bundled"
      ;;
    *) echo "unknown stage '$stage' (quick [--dry-run] alone, or: build, test, block, kernels, capacity, peak, offload, demo, bundle, bench)"
       exit 2 ;;
  esac
done
log "done (status $status: non-zero when a test failed, a goal was missed or a bench broke)"
exit $status
