#!/usr/bin/env bash
# GPU session 2, call 3: rebuild; the cases that failed in call 1, after the fixes (call 2's test
# run hit its time limit); the LoRA dot precision (time at LLaMA-3-8B dims, then accuracy);
# the ahead-of-time compile report under the device's own triton (spills against the models).
export PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); el() { echo "[+$(( $(date +%s)-t0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s)-t0) )); }
OUT=$OUT bash tools/gpu_validate.sh build || exit 1
el tests
timeout $(left 210) python3 -m pytest -q -ra -n 14 -p no:benchmark tests/test_memory.py \
  "tests/test_linear_cross_entropy.py::test_frozen_head_forms_no_weight_gradient" \
  "tests/test_triton_swiglu.py::test_matches_fp64_reference" \
  "tests/test_triton_swiglu.py::test_lora_matches_fp64_reference" \
  "tests/test_triton_attention.py::test_dq_modes" "tests/test_triton_attention.py::test_accuracy" \
  "tests/test_triton_attention.py::test_segments_and_window" > $OUT/call3_tests.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error:" $OUT/call3_tests.log | tail -15
el lora precision
CKPT_EXT_AUTOTUNE=0 timeout $(left 340) python3 bench/results/gpu_h100_2026-11-24b/lora_precision.py > $OUT/call3_lora_precision.log 2>&1
echo "rc=$?"; cat $OUT/call3_lora_precision.log
el aot
timeout $(left 500) python3 tools/check_triton_compile.py --arch 90 --quick --jobs 2 --allow-spills \
  --out $OUT/call3_triton_compile_quick_sm90_triton3.6.txt > $OUT/call3_aot.log 2>&1
echo "rc=$?"; grep -E "RESULT|spill|wall time" $OUT/call3_aot.log | tail -15
el done
