#!/usr/bin/env bash
# Session GPU call 3: rebuild with the libstdc++ link fix, re-run what crashed, swiglu at one shape, capacity.
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
t0=$(date +%s); el() { echo "[+$(( $(date +%s)-t0 ))s] $*"; }
python3 -c "import sysconfig as s; print('LDSHARED', s.get_config_var('LDSHARED')); print('LDCXXSHARED', s.get_config_var('LDCXXSHARED'))" | tee $OUT/link.txt
python3 -m pip install -v --no-build-isolation --no-deps -e . > $OUT/gpu_build.log 2>&1 || { tail -30 $OUT/gpu_build.log; exit 1; }
grep -E " -shared .*_C\." $OUT/gpu_build.log | tail -1 | tr ' ' '\n' | grep -vE "\.o$|^-I|^$" | tr '\n' ' ' | tee -a $OUT/link.txt; echo
readelf -d ckpt_ext/_C*.so | grep NEEDED | tee -a $OUT/link.txt
el built
timeout 75 python3 -m pytest -q -n 14 tests/test_build.py tests/test_ops.py tests/test_checkpoint.py tests/test_cuda_rowwise.py tests/test_blocks.py -k 'error or raise or reject or differ or nondetermin or build' > $OUT/gpu_tests_rerun.log 2>&1; echo "pytest rc=$?"
tail -15 $OUT/gpu_tests_rerun.log
el capacity
left=$(( 470 - ($(date +%s)-t0) )); echo "capacity gets ${left}s"
CKPT_EXT_AUTOTUNE=0 timeout $left python3 bench/capacity.py --seqs 8192,16384 --setups hf_gc hf_gc+fused_loss min_memory balanced fast --capacity hf_gc --time-budget 45 --deadline $(( left - 20 )) > $OUT/capacity.log 2>&1; echo "capacity rc=$?"
tail -25 $OUT/capacity.log; cp bench/results/capacity_*.csv $OUT/ 2>/dev/null
el swiglu
for v in "" "CKPT_EXT_SWIGLU_GRID=persistent" "CKPT_EXT_SWIGLU_EPILOGUE=whole"; do
  left=$(( 545 - ($(date +%s)-t0) )); [ $left -gt 15 ] || break
  echo "== swiglu ${v:-default} (CKPT_EXT_AUTOTUNE=0)"; env $v CKPT_EXT_AUTOTUNE=0 timeout $left python3 bench/swiglu.py --models llama3_8b --tokens 8192 --reps 10 --warmup 3 --out /tmp/sw.csv 2>&1 | tail -5
done > $OUT/swiglu.log; cat $OUT/swiglu.log
el done
