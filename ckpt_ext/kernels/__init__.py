"""Triton kernels of ckpt_ext: the subpackage ``ckpt_ext.kernels``.

Kernels and their launchers only: no autograd and no tests live here. The launchers have
the signatures of the ``torch.ops.ckpt_ext`` kernel ops and are registered as their CUDA
implementation (and CPU one under the backend setting "triton") by ``ckpt_ext._backend``.
Their settings (autotuning, kernel variants) come from ``ckpt_ext.config``.
Importing this package does not import triton; the kernel modules do.

Where the modules live: in an installed ckpt_ext (a wheel, ``pip install .``) they lie beside
this file. In a source checkout (an editable install, or ``PYTHONPATH`` at the checkout) they
are the repository's top-level ``kernels/`` folder, which this file adds to the package's
search path. That folder has no ``__init__.py`` on purpose: PyPI has an unrelated package
named ``kernels`` (a dependency of transformers), and a regular package of that name in the
repository root would shadow it for every ``python -m ...``, ``python -c`` or REPL started
there, since Python puts the working folder first on ``sys.path``. Without one, Python finds a
regular ``kernels`` package anywhere on the path before it (the folder is at most an empty
namespace portion), so ``import kernels`` never runs this repository's code.
"""
import os as _os


def _source_folder():
    """The checkout's top-level ``kernels/`` folder when this package runs from a source
    checkout (its kernel modules are not beside this file), else None."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.isfile(_os.path.join(here, "_launch.py")):
        return None  # installed: the modules were copied here
    root = _os.path.dirname(_os.path.dirname(here))
    folder = _os.path.join(root, "kernels")
    # setup.py beside it tells a checkout from site-packages, whose ``kernels`` is PyPI's
    if _os.path.isfile(_os.path.join(root, "setup.py")) and _os.path.isfile(
            _os.path.join(folder, "_launch.py")):
        return folder
    return None


_folder = _source_folder()
if _folder is not None:
    __path__.append(_folder)  # noqa: F821  (a package's __path__ is set before its init runs)
del _folder


def autotune_enabled() -> bool:
    """Whether the GPU launchers autotune (the default) or launch one fixed configuration:
    the ``autotune`` setting of ``ckpt_ext.config`` (``CKPT_EXT_AUTOTUNE``).

    Off, the launchers launch the first candidate that fits the device, with no timing runs.
    The test suite turns it off on a GPU, where correctness does not depend on tile sizes and
    tuning every shape it tries would cost minutes of compilation.
    """
    from ..config import current
    return current().autotune
