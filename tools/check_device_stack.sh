#!/usr/bin/env bash
# Build and test ckpt_ext against the GPU machine's Python stack, on a CPU machine.
#
# The GPU machines this project is lent run torch 2.11.0+cu130, triton 3.6.0 and transformers
# 5.17.0 (Python 3.12); this machine and CI run torch 2.13.0+cpu and the newest triton. This
# script puts the GPU machine's versions in a virtualenv (torch's CUDA wheel and its CUDA
# libraries: several GB, fetched once), builds the *CUDA* extension against them with the local
# nvcc (compile and link only: nothing CUDA runs here), and runs the test suite on the CPU,
# the Triton kernels through triton 3.6's interpreter. A copy of the working tree is built, so
# the checkout's own build is left alone.
#
#     bash tools/check_device_stack.sh            # venv in /tmp/ckpt_ext_device_stack
#     VENV=/path/venv KEEP=1 bash tools/check_device_stack.sh
#
# numpy is held below 2.4 here: triton 3.6's interpreter cannot run with a newer one (see
# kernels/_interpreter.py). The GPU machine's numpy 2.5 is no problem there, where Triton
# compiles instead of interpreting. Not part of CI (the download is too large).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-/tmp/ckpt_ext_device_stack}"
work="$(mktemp -d)/ckpt_ext"
stamp() { echo "[device-stack $(date -u +%H:%M:%S)] $*"; }
echo "# tools/check_device_stack.sh at $(git rev-parse --short HEAD)$(git diff --quiet || \
echo ' + uncommitted changes'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -m), $(nproc) cores"

if [ ! -x "$venv/bin/python" ]; then
  stamp "virtualenv $venv: torch 2.11.0 (CUDA 13.0 wheel), triton 3.6.0, transformers 5.17.0"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" \
      pytest ninja setuptools wheel
fi
"$venv/bin/python" -c "import torch, triton, transformers, numpy; print('torch', torch.__version__, \
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', \
transformers.__version__, '| numpy', numpy.__version__)"

stamp "copy of the working tree in $work"
mkdir -p "$work"
git ls-files -z --cached --others --exclude-standard | \
  (while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) | \
  tar --null -T - -cf - | tar -xf - -C "$work"

stamp "CUDA build against torch 2.11 (MAX_JOBS=${MAX_JOBS:=2}); compiler warnings, if any:"
# build_ext --inplace shows the compiler's output (pip hides it); the throwaway copy then maps
# ckpt_ext.kernels onto kernels/ with a link, as an install does.
(cd "$work" && CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="$MAX_JOBS" \
  "$venv/bin/python" setup.py build_ext --inplace > build.log 2>&1) || { tail -40 "$work/build.log"; exit 1; }
grep -E "\[ckpt_ext build\]|warning:" "$work/build.log" || true
ln -s ../kernels "$work/ckpt_ext/kernels"
(cd "$work" && "$venv/bin/python" -c "import ckpt_ext; assert ckpt_ext._C.with_cuda, \
'not a CUDA build'; print('CUDA build of ckpt_ext loads under torch', __import__('torch').__version__)")

stamp "test suite (CPU; Triton through the 3.6 interpreter)"
status=0
(cd "$work" && "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider \
  -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" tests) || status=$?
[ -n "${KEEP:-}" ] && stamp "kept $work" || rm -rf "$(dirname "$work")"
stamp "done (pytest status $status)"
exit $status
