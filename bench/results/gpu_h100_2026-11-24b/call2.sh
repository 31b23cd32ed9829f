#!/usr/bin/env bash
# GPU session 2, call 2: rebuild; the test files whose cases failed in call 1, after the fixes;
# the LoRA dot precision; the peak model's cuda path; the LLaMA-7B layer with the compiled rows.
export PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); el() { echo "[+$(( $(date +%s)-t0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s)-t0) )); }
OUT=$OUT bash tools/gpu_validate.sh build || exit 1
el tests
timeout $(left 230) python3 -m pytest -q -ra -n 12 tests/test_memory.py tests/test_triton_swiglu.py \
    tests/test_triton_attention.py tests/test_linear_cross_entropy.py > $OUT/call2_tests.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/call2_tests.log | tail -12
el lora precision
timeout $(left 300) python3 bench/results/gpu_h100_2026-11-24b/lora_precision.py > $OUT/call2_lora_precision.log 2>&1
echo "rc=$?"; cat $OUT/call2_lora_precision.log | tail -30
el peak
{ timeout $(left 350) python3 bench/peak.py --device cuda --dtype bfloat16 --seq 4096
  timeout $(left 420) python3 bench/peak.py --device cuda --dtype bfloat16 --layers 2 --hidden 4096 \
      --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 --seq 8192; } > $OUT/call2_peak.log 2>&1
cat $OUT/call2_peak.log
el block
timeout $(left 575) python3 bench/block.py --llama7b --amp bfloat16 --compile --lora 16 --reps 10 > $OUT/call2_block.log 2>&1
echo "rc=$?"; tail -40 $OUT/call2_block.log
el done
cp bench/results/block_*gpu*.csv bench/results/block_llama7b*.csv $OUT/ 2>/dev/null; ls -la $OUT
