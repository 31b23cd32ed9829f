"""The build: what it links, and what it tells the user while it runs.

An extension with its own static copy of libstdc++ throws every ``c10::Error`` through a
runtime that torch's frames cannot catch from: the first bad argument kills the process with
SIGSEGV instead of raising (seen on a CUDA build). The symptom test calls an op with a bad
argument; the cause test reads the extension's dynamic symbol table.

setup.py prints its CPU/CUDA decision and one line per compiled file, and writes them to
build/ckpt_ext-build.log (pip shows a build's output only with -v); the progress tests drive
that reporter with a hand-written ninja log, without compiling anything.
"""
import importlib.util
import os
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its helpers, without running setup() (it runs as __main__ only)."""
    spec = importlib.util.spec_from_file_location("ckpt_ext_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_prints_the_cpu_cuda_decision(setup_py, monkeypatch, capsys):
    monkeypatch.setenv("CKPT_EXT_SKIP_CUDA", "1")
    monkeypatch.setenv("MAX_JOBS", "2")
    monkeypatch.delenv("CKPT_EXT_DEBUG_INFO", raising=False)
    (ext,) = setup_py.extensions()
    out = capsys.readouterr().out
    assert "[ckpt_ext build] CPU build (CppExtension): CKPT_EXT_SKIP_CUDA=1" in out, out
    n = len(ext.sources)
    assert f"[ckpt_ext build] MAX_JOBS=2; {n} sources; C++ debug info off" in out, out
    assert "-g0" in ext.extra_compile_args["cxx"]
    monkeypatch.setenv("CKPT_EXT_DEBUG_INFO", "1")
    (ext,) = setup_py.extensions()
    assert "-g0" not in ext.extra_compile_args["cxx"]
    assert "C++ debug info on" in capsys.readouterr().out


def _ninja_line(start_ms, end_ms, output):
    return f"{start_ms}\t{end_ms}\t1795778686302126555\t{output}\t9ba7dd56d9aa2209\n"


def test_build_progress_reports_each_compiled_file(setup_py, tmp_path, capsys):
    objects = tmp_path / "temp.linux-x86_64-cpython-311"
    objects.mkdir()
    ninja_log = objects / ".ninja_log"
    # An earlier build's entry: up to date, not compiled by this build, not reported.
    ninja_log.write_text("# ninja log v7\n" + _ninja_line(0, 9000, f"{objects}/csrc/old.o"))
    log = tmp_path / "ckpt_ext-build.log"
    sources = ["csrc/old.cpp", "csrc/checkpoint.cpp", "csrc/cuda/rms_norm.cu"]
    progress = setup_py.BuildProgress(str(log), str(objects), sources, poll_s=0.05)
    progress.start(["CPU build (CppExtension): torch 2.13.0+cpu has no CUDA",
                    "CPU build (CppExtension): torch 2.13.0+cpu has no CUDA"])
    with ninja_log.open("a") as f:  # ninja finishing two files
        f.write(_ninja_line(0, 41250, f"{objects}/csrc/checkpoint.o"))
        f.write(_ninja_line(10, 63000, f"{objects}/csrc/cuda/rms_norm.cuda.o"))
    progress.finish(ok=True)

    text = log.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# ckpt_ext build, "), text
    assert "load average" in lines[1], text
    assert text.count("CPU build (CppExtension): torch 2.13.0+cpu has no CUDA") == 1, text
    assert f"progress in {log}" in text
    assert "compiled csrc/checkpoint.cpp in 41.2 s (1 of at most 3 files)" in text, text
    assert "compiled csrc/cuda/rms_norm.cu in 63.0 s (2 of at most 3 files)" in text, text
    assert "old" not in text
    assert "built in 0m0" in text and "2 files compiled, the rest up to date" in text, text
    # Each line of the log (after the header) carries the time of day and the elapsed time.
    assert all(l.split()[1].startswith("+") for l in lines[3:]), text
    out = capsys.readouterr().out  # what pip -v shows
    assert "[ckpt_ext build] compiled csrc/checkpoint.cpp in 41.2 s" in out, out
    assert "[ckpt_ext build] built in" in out, out


def test_build_progress_reports_a_failure(setup_py, tmp_path, capsys):
    objects = tmp_path / "objects"  # no ninja log yet: a first build
    log = tmp_path / "build" / "ckpt_ext-build.log"
    progress = setup_py.BuildProgress(str(log), str(objects), ["csrc/a.cpp"], poll_s=0.05)
    progress.start([])
    progress.finish(ok=False)
    assert "FAILED after 0m0" in log.read_text()
    assert "the compiler's errors are in pip's output" in capsys.readouterr().out
