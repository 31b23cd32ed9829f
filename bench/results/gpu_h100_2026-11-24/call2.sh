#!/usr/bin/env bash
# Session GPU call 2: build, C++-throw diagnosis, block + kernel benchmarks.
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
t0=$(date +%s); el() { echo "[+$(( $(date +%s)-t0 ))s] $*"; }
OUT=$OUT bash tools/gpu_validate.sh build || exit 1
el built
objcopy --strip-debug ckpt_ext/_C*.so $OUT/C_stripped.so; ls -la $OUT/C_stripped.so
{
  el diag; c++ --version | head -1; gcc --version | head -1; nvcc --version | tail -1
  python3 -c "import torch; print(torch.__config__.show()); print('cxx11abi', torch.compiled_with_cxx11_abi())"
  ldd ckpt_ext/_C*.so | grep -E "stdc|gcc_s|c10|torch"
  for w in ours_cpu ours_cuda inline; do timeout 120 python3 -X faulthandler .gpuwork/diag_throw.py $w 2>&1 | tail -4; echo "$w rc=$?"; done
} > $OUT/diag.txt 2>&1
cat $OUT/diag.txt | grep -v "^  " | tail -30
el "block"
timeout 230 python3 bench/block.py --llama7b --amp bfloat16 --lora 16 --reps 8 > $OUT/block.log 2>&1; echo "block rc=$?"
tail -45 $OUT/block.log
el "attention"
timeout 110 python3 bench/attention.py --providers triton,triton_atomic,sdpa --seqlens 4096,16384 --head-dims 128 > $OUT/kernels.log 2>&1; echo "attention rc=$?"
el "swiglu"
timeout 60 python3 bench/swiglu.py >> $OUT/kernels.log 2>&1; echo "swiglu rc=$?"
CKPT_EXT_SWIGLU_GRID=persistent timeout 40 python3 bench/swiglu.py --out bench/results/swiglu_persistent_gpu.csv >> $OUT/kernels.log 2>&1; echo "swiglu persistent rc=$?"
CKPT_EXT_SWIGLU_EPILOGUE=whole timeout 40 python3 bench/swiglu.py --out bench/results/swiglu_whole_epilogue_gpu.csv >> $OUT/kernels.log 2>&1; echo "swiglu whole rc=$?"
el "lm_head"
timeout 50 python3 bench/lm_head.py --vocab 128256 --tokens 8192 >> $OUT/kernels.log 2>&1; echo "lm_head rc=$?"
el "rowwise"
timeout 30 python3 bench/rowwise.py --no-compile >> $OUT/kernels.log 2>&1; echo "rowwise rc=$?"
grep -vE "^\s*$" $OUT/kernels.log | tail -70
tar czf $OUT/results.tgz bench/results
el done
