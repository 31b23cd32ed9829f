"""Build script for ckpt_ext.

Builds the extension ``ckpt_ext._C`` with ninja:

* a ``CUDAExtension`` (``csrc/*.cpp`` + ``csrc/cuda/*.cpp`` + ``csrc/cuda/*.cu``) when the
  installed torch was built with CUDA and ``nvcc`` is found;
* a ``CppExtension`` (``csrc/*.cpp``) otherwise.

Knobs (all printed): ``CKPT_EXT_FORCE_CUDA=1`` / ``CKPT_EXT_SKIP_CUDA=1`` override the
decision, ``MAX_JOBS`` caps ninja's parallelism, ``TORCH_CUDA_ARCH_LIST`` picks the GPU
architectures (default "8.0;9.0"). No GPU is queried at build time.

The ``kernels/`` folder is installed as the subpackage ``ckpt_ext.kernels``; there is
never a top-level ``kernels`` package (PyPI has an unrelated package of that name).

Install with ``pip install --no-build-isolation -e .`` (torch must already be installed).
"""
import glob
import os
import shutil
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit(
        "ckpt_ext: torch must be installed before building (the build needs its headers).\n"
        "  pip install torch==2.13.0        # CPU machine\n"
        "  pip install --no-build-isolation -e .")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _log(msg):
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
    _log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(ninja default)')}; {len(sources)} sources")
    return [ext]


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


setup(
    packages=["ckpt_ext", "ckpt_ext.hf", "ckpt_ext.modules", "ckpt_ext.kernels"],
    package_dir={"ckpt_ext": "ckpt_ext", "ckpt_ext.kernels": "kernels"},
    package_data={"ckpt_ext": ["attention_backends.json"]},  # the attention choice table
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
)
