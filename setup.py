"""Build script for ckpt_ext.

Builds the extension ``ckpt_ext._C`` with ninja:

* a ``CUDAExtension`` (``csrc/*.cpp`` + ``csrc/cuda/*.cpp`` + ``csrc/cuda/*.cu``) when the
  installed torch was built with CUDA and ``nvcc`` is found;
* a ``CppExtension`` (``csrc/*.cpp``) otherwise.

Knobs (all printed): ``CKPT_EXT_FORCE_CUDA=1`` / ``CKPT_EXT_SKIP_CUDA=1`` override the
decision, ``MAX_JOBS`` caps ninja's parallelism, ``TORCH_CUDA_ARCH_LIST`` picks the GPU
architectures (default "8.0;9.0"), ``CKPT_EXT_DEBUG_INFO=1`` compiles the C++ with debug
information (off by default: it costs a fifth of the compile time). No GPU is queried at
build time.

Progress: the decision and one line per compiled file (``[ckpt_ext build] ...``) go to the
output, which pip shows with ``-v`` only, and always to ``build/ckpt_ext-build.log``, which is
rewritten by each build.

The ``kernels/`` folder is installed as the subpackage ``ckpt_ext.kernels`` (its modules are
copied beside ``ckpt_ext/kernels/__init__.py``); there is never a top-level ``kernels`` package
(PyPI has an unrelated package of that name), and the folder has no ``__init__.py`` so that it
cannot shadow that package from the repository root.

Install with ``pip install --no-build-isolation -v -e .`` (torch must already be installed).
"""
import datetime
import glob
import os
import shutil
import sys
import threading
import time
import warnings

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    with warnings.catch_warnings():
        # numpy is a dependency of ckpt_ext, not of its build: pip may install it after this
        # script ran, and torch's import warns about its absence.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
        from torch.utils.cpp_extension import (CUDA_HOME, BuildExtension, CppExtension,
                                               CUDAExtension)
except ImportError:  # pragma: no cover - explained to the user
    sys.exit(
        "ckpt_ext: torch must be installed before building (the build needs its headers).\n"
        "  pip install torch==2.13.0        # CPU machine\n"
        "  pip install --no-build-isolation -v -e .")

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_LOG = os.path.join(ROOT, "build", "ckpt_ext-build.log")

# What the build decided, printed as it happens and repeated at the top of the build log.
_decisions = []


def _flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _log(msg):
    _decisions.append(msg)
    print(f"[ckpt_ext build] {msg}", flush=True)


def _nvcc():
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


def _want_cuda():
    if _flag("CKPT_EXT_FORCE_CUDA") and _flag("CKPT_EXT_SKIP_CUDA"):
        sys.exit("ckpt_ext: CKPT_EXT_FORCE_CUDA and CKPT_EXT_SKIP_CUDA are both set; pick one")
    if _flag("CKPT_EXT_SKIP_CUDA"):
        return False, "CKPT_EXT_SKIP_CUDA=1"
    torch_cuda = torch.version.cuda
    nvcc = _nvcc()
    if _flag("CKPT_EXT_FORCE_CUDA"):
        if torch_cuda is None or nvcc is None:
            sys.exit(f"ckpt_ext: CKPT_EXT_FORCE_CUDA=1 but torch.version.cuda={torch_cuda} "
                     f"and nvcc={nvcc}; a CUDA build needs both")
        return True, "CKPT_EXT_FORCE_CUDA=1"
    if torch_cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    if nvcc is None:
        return False, f"torch has CUDA {torch_cuda} but nvcc was not found (set CUDA_HOME)"
    return True, f"torch has CUDA {torch_cuda} and nvcc is {nvcc}"


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def extensions():
    use_cuda, why = _want_cuda()
    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    # No -std flag: torch's BuildExtension picks the C++ standard its own headers need
    # (C++17 for torch 2.11, newer for later releases).
    cxx = ["-O3"]
    # Python's CFLAGS, which setuptools passes on, carry -g. Debug information for torch's
    # templates is about a fifth of each file's compile time and nearly all of the extension's
    # size; -g0 (after -g, so it wins) drops it unless asked for.
    if not _flag("CKPT_EXT_DEBUG_INFO"):
        cxx.append("-g0")
    define_macros = []
    # Link the C++ runtime that torch itself loads. An extension that carries its own static
    # copy of libstdc++ (seen on the CUDA build of an H100 image: __cxa_throw defined inside
    # _C.so, no libstdc++.so.6 among its needed libraries) throws every c10::Error with a
    # runtime torch cannot catch from, and the process dies with SIGSEGV on the first bad
    # argument. Named after the objects, so that --as-needed keeps it.
    link = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        define_macros.append(("CKPT_EXT_WITH_CUDA", "1"))
        nvcc = ["-O3", "--use_fast_math", "-lineinfo"]
        _log(f"CUDA build: {why}; TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
        ext = CUDAExtension("ckpt_ext._C", sources, define_macros=define_macros,
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                            extra_link_args=link)
    else:
        _log(f"CPU build (CppExtension): {why}")
        ext = CppExtension("ckpt_ext._C", sources, define_macros=define_macros,
                           extra_compile_args={"cxx": cxx}, extra_link_args=link)
    _log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(ninja default)')}; {len(sources)} sources; "
         f"C++ debug info {'on' if _flag('CKPT_EXT_DEBUG_INFO') else 'off'} "
         f"(CKPT_EXT_DEBUG_INFO)")
    return [ext]


def _clock(seconds):
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


class BuildProgress:
    """The build's progress, on the output and in a log file.

    pip shows a build backend's output only with ``-v``; the log file is written either way.
    Each compiled file is reported when it finishes, read from ninja's own log
    (``<objects>/.ninja_log``, one line per finished output: start and end in ms, the
    output's path), which every ninja release writes and torch's BuildExtension leaves alone.
    """

    def __init__(self, log_path, objects, sources, poll_s=1.0):
        self.log_path = log_path
        self.objects = objects
        self.ninja_log = os.path.join(objects, ".ninja_log")
        # object path (relative to the objects folder, no extension) -> source path
        self.sources = {os.path.splitext(s)[0]: s for s in sources}
        self.total = len(sources)
        self.poll_s = poll_s
        self.done = 0
        self.t0 = time.monotonic()
        self._known = self._entries()  # outputs of earlier builds, already in ninja's log
        self._stop = threading.Event()
        self._thread = None
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self._file = open(log_path, "w", buffering=1)

    def line(self, msg):
        text = f"[ckpt_ext build] {msg}"
        print(text, flush=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
        self._file.write(f"{stamp} +{_clock(time.monotonic() - self.t0)} {text}\n")

    def _entries(self):
        try:
            with open(self.ninja_log) as f:
                return [l for l in f.read().splitlines() if l and not l.startswith("#")]
        except OSError:
            return []

    def source_of(self, output):
        rel = os.path.relpath(output, self.objects) if os.path.isabs(output) else output
        stem = rel
        while True:  # csrc/x.o, csrc/cuda/y.cuda.o
            stem, ext = os.path.splitext(stem)
            if not ext or stem in self.sources:
                break
        return self.sources.get(stem, rel)

    def poll(self):
        """Report the files ninja finished since the last poll."""
        known = set(self._known)
        for entry in self._entries():
            if entry in known:
                continue
            self._known.append(entry)
            fields = entry.split("\t")
            if len(fields) < 4:
                continue
            start, end, output = fields[0], fields[1], fields[3]
            self.done += 1
            took = (int(end) - int(start)) / 1000 if start.isdigit() and end.isdigit() else 0
            self.line(f"compiled {self.source_of(output)} in {took:.1f} s "
                      f"({self.done} of at most {self.total} files)")

    def _watch(self):
        while not self._stop.wait(self.poll_s):
            self.poll()

    def start(self, decisions):
        self._file.write(
            f"# ckpt_ext build, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
            f", in {ROOT}\n# torch {torch.__version__}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        for msg in dict.fromkeys(decisions):  # setup.py may have run more than once
            self._file.write(f"[ckpt_ext build] {msg}\n")
        self.line(f"compiling in {self.objects} (ninja recompiles only what changed); "
                  f"progress in {self.log_path}")
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def finish(self, ok):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        took = _clock(time.monotonic() - self.t0)
        if ok:
            self.line(f"built in {took}: {self.done} files compiled, the rest up to date")
        else:
            self.line(f"FAILED after {took} ({self.done} files compiled); "
                      f"the compiler's errors are in pip's output")
        self._file.close()


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension, compiling into one object folder for every kind of install.

    A wheel build (``pip install .``) compiles into ``build/temp.<platform>-<python>`` in the
    source tree, but setuptools' PEP 660 editable build (``pip install -e .``) compiles into a
    throwaway temporary folder, so every install recompiled every source. Both now use the
    wheel build's folder: ninja then recompiles only what changed (a source, a header it
    includes, or the compile command itself) and reuses the other objects. ``--build-temp``
    still overrides it.
    """

    def finalize_options(self):
        if self.build_temp is None:
            build = self.get_finalized_command("build")
            self.build_temp = os.path.join(
                build.build_base, f"temp.{build.plat_name}-{sys.implementation.cache_tag}")
            _log(f"objects in {self.build_temp}")
        super().finalize_options()

    def run(self):
        sources = [s for ext in self.extensions for s in ext.sources]
        progress = BuildProgress(BUILD_LOG, os.path.abspath(self.build_temp), sources)
        progress.start(_decisions)
        ok = False
        try:
            super().run()
            ok = True
        finally:
            progress.finish(ok)


KERNELS = os.path.join(ROOT, "kernels")


class BuildPy(build_py):
    """setuptools' build_py, plus the top-level ``kernels/`` folder's modules and data files
    copied into the package ``ckpt_ext.kernels`` of a built (non-editable) install.

    The package itself is ``ckpt_ext/kernels/__init__.py``; in a source checkout (editable
    installs included) it adds the ``kernels/`` folder to its search path instead, so an
    editable install copies nothing.
    """

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = os.path.join(self.build_lib, "ckpt_ext", "kernels")
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(KERNELS)):
            if name.endswith((".py", ".json")):
                self.copy_file(os.path.join(KERNELS, name), os.path.join(target, name))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        target = os.path.join(self.build_lib, "ckpt_ext", "kernels")
        return outputs + [os.path.join(target, n) for n in sorted(os.listdir(KERNELS))
                          if n.endswith((".py", ".json"))]


if __name__ == "__main__":
    setup(
        packages=["ckpt_ext", "ckpt_ext.hf", "ckpt_ext.modules", "ckpt_ext.kernels"],
        # the attention choice table (the kernels' data files are copied by BuildPy)
        package_data={"ckpt_ext": ["attention_backends.json"]},
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    )
