"""The built extension links the C++ runtime that torch loads.

An extension with its own static copy of libstdc++ throws every ``c10::Error`` through a
runtime that torch's frames cannot catch from: the first bad argument kills the process with
SIGSEGV instead of raising (seen on a CUDA build). The symptom test calls an op with a bad
argument; the cause test reads the extension's dynamic symbol table.
"""
import shutil
import subprocess
import sys

import pytest
import torch

import ckpt_ext


def test_bad_argument_raises_in_a_fresh_process():
    # A fresh interpreter: a crash must fail this test, not take the test session down.
    code = ("import torch, ckpt_ext\n"
            "try:\n"
            "    torch.ops.ckpt_ext.rms_norm_fwd(torch.ones(4, 64), torch.ones(32), 1e-6)\n"
            "except ValueError as e:\n"
            "    print('raised:', str(e).splitlines()[0])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stderr[-2000:]}"
    assert "raised: rms_norm_fwd: weight must have shape (64,)" in run.stdout, run.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF symbol check: Linux only")
def test_extension_does_not_define_the_cxx_runtime():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed: the dynamic symbol table cannot be read")
    so = ckpt_ext._C.__file__
    defined = subprocess.run([nm, "-D", "--defined-only", so], capture_output=True, text=True,
                             check=True).stdout.split()
    own_runtime = sorted({s for s in defined if s in ("__cxa_throw", "__gxx_personality_v0",
                                                      "__cxa_begin_catch")})
    assert not own_runtime, (f"{so} defines {own_runtime}: it carries a static libstdc++; "
                             f"torch {torch.__version__} cannot catch its exceptions")
