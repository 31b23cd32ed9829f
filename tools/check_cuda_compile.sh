#!/usr/bin/env bash
# Compile check of the CUDA build's sources, for machines without a GPU (CI runs it as
# `bash tools/check_cuda_compile.sh` whenever nvcc exists).
#
#  1. every csrc/cuda/*.cu is compiled with nvcc for sm_80 and sm_90 (objects go to a temporary
#     directory, warnings are shown, any error fails the script);
#  2. every csrc/cuda/*.cpp (the torch-facing launchers) is syntax-checked with g++ against
#     torch's headers and the CUDA headers, as the CUDA build compiles it (-DCKPT_EXT_WITH_CUDA,
#     torch's C++11 ABI); skipped with a note when torch is not importable.
# No files: nothing to check, success. Knobs: NVCC, CXX, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

nvcc="${NVCC:-}"
if [ -z "$nvcc" ]; then
  if command -v nvcc >/dev/null 2>&1; then nvcc=$(command -v nvcc)
  elif [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc
  else echo "check_cuda_compile: nvcc not found (set NVCC or put it on PATH)" >&2; exit 1
  fi
fi
# CUDA headers for the g++ check: CUDA_HOME, else next to nvcc, else /usr/local/cuda (nvcc on
# PATH may be a wrapper script elsewhere).
cuda_inc=""
for d in "${CUDA_HOME:-}/include" "$(dirname "$(readlink -f "$nvcc")")/../include" \
         /usr/local/cuda/include; do
  if [ -f "$d/cuda_runtime.h" ]; then cuda_inc=$(cd "$d" && pwd); break; fi
done
cxx="${CXX:-g++}"
python="${PYTHON:-python3}"
out=$(mktemp -d /tmp/ckpt_ext_cuda_check.XXXXXX)
trap 'rm -rf "$out"' EXIT

shopt -s nullglob
cu_files=(csrc/cuda/*.cu)
cpp_files=(csrc/cuda/*.cpp)
echo "check_cuda_compile: $("$nvcc" --version | tail -n 1);" \
     "${#cu_files[@]} .cu, ${#cpp_files[@]} .cpp"

fail=0
for f in "${cu_files[@]}"; do
  obj="$out/$(basename "${f%.cu}").o"
  echo "== nvcc $f (sm_80, sm_90)"
  t0=$(date +%s)
  # Same flags as setup.py's CUDA build (its nvcc flags plus those torch's BuildExtension adds:
  # no implicit half/bfloat16 conversions or operators, relaxed constexpr, -fPIC), plus
  # host-compiler warnings.
  if "$nvcc" -std=c++17 -O3 --use_fast_math -lineinfo \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      --expt-relaxed-constexpr -Xcompiler -fPIC \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -Xcompiler -Wall -Xcompiler -Wextra -Icsrc/cuda -c "$f" -o "$obj"; then
    echo "   ok ($(( $(date +%s) - t0 ))s)"
  else
    echo "   FAILED: $f" >&2
    fail=1
  fi
done

if [ ${#cpp_files[@]} -gt 0 ] && [ -z "$cuda_inc" ]; then
  echo "no CUDA include dir with cuda_runtime.h found (set CUDA_HOME):" \
       "${#cpp_files[@]} .cpp launcher(s) not syntax-checked"
elif [ ${#cpp_files[@]} -gt 0 ]; then
  if torch_flags=$("$python" - <<'PY' 2>/dev/null
import torch
import torch.utils.cpp_extension as ext
flags = [f"-isystem{p}" for p in ext.include_paths()]
flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(" ".join(flags))
PY
  ); then
    for f in "${cpp_files[@]}"; do
      echo "== $cxx -fsyntax-only $f"
      # A CPU-only torch lacks the generated c10/cuda/impl/cuda_cmake_macros.h; it only
      # carries the shared-library export switch, which does not matter for a syntax check.
      # shellcheck disable=SC2086
      if "$cxx" -fsyntax-only -std=c++17 -Wall -Wextra -DCKPT_EXT_WITH_CUDA \
          -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE $torch_flags -isystem "$cuda_inc" \
          -Icsrc/cuda "$f"; then
        echo "   ok"
      else
        echo "   FAILED: $f" >&2
        fail=1
      fi
    done
  else
    echo "torch is not importable with $python:" \
         "${#cpp_files[@]} .cpp launcher(s) not syntax-checked"
  fi
fi

if [ "$fail" -ne 0 ]; then
  echo "check_cuda_compile: FAILED" >&2
  exit 1
fi
echo "check_cuda_compile: all sources compiled"
