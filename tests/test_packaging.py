"""The repository's top-level ``kernels/`` folder never shadows PyPI's ``kernels`` package.

transformers 5.25 depends on PyPI's ``kernels`` and imports it when a model class loads.
``python -m pytest``, ``python -c`` and a REPL put the working folder first on ``sys.path``, so
from the repository root a regular package named ``kernels`` there would be found instead of
the real one (``ImportError: cannot import name 'CUDAProperties' from 'kernels'``). The folder
therefore has no ``__init__.py``; ``ckpt_ext/kernels/__init__.py`` adds it to the package's path
in a checkout, and setup.py's build_py copies its modules into a built install.
"""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, cwd, env=None):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def _pypi_kernels_installed():
    try:
        importlib.metadata.distribution("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_kernels_folder_is_not_a_regular_package():
    assert os.path.isdir(os.path.join(ROOT, "kernels"))
    assert not os.path.exists(os.path.join(ROOT, "kernels", "__init__.py")), (
        "kernels/__init__.py makes the folder a regular package that shadows PyPI's 'kernels' "
        "from the repository root")


def test_transformers_loads_a_model_class_from_the_repository_root():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed: its hub-kernels import cannot be tried")
    run = _run("from transformers import LlamaForCausalLM; print('ok')", cwd=ROOT)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_import_kernels_from_the_repository_root_runs_no_repository_code():
    code = ("import importlib.util, json\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(json.dumps(None if spec is None else [spec.origin, "
            "list(spec.submodule_search_locations or [])]))\n")
    run = _run(code, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)  # null, or [origin, search locations]
    if _pypi_kernels_installed():
        assert found is not None and found[0] is not None, found
        assert not os.path.abspath(found[0]).startswith(ROOT + os.sep), (
            f"'import kernels' from {ROOT} found {found[0]}, not PyPI's package")
    elif found is not None:
        # Without PyPI's package the folder can only be an empty namespace portion: no module
        # of this repository runs on 'import kernels'.
        assert found[0] is None, f"'import kernels' would run {found[0]}"


def test_ckpt_ext_kernels_resolves_to_the_checkout_folder():
    import ckpt_ext.kernels
    from ckpt_ext.kernels import _launch
    assert os.path.dirname(os.path.abspath(_launch.__file__)) in (
        os.path.join(ROOT, "kernels"), os.path.dirname(os.path.abspath(ckpt_ext.kernels.__file__)))
    assert callable(ckpt_ext.kernels.autotune_enabled)


def test_build_py_copies_the_kernels_into_the_subpackage(tmp_path):
    """A built install (wheel) holds the kernel modules and data in ckpt_ext/kernels and no
    top-level 'kernels'; the package then reads them from beside its __init__."""
    lib = tmp_path / "lib"
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (lib / "kernels").exists(), sorted(os.listdir(lib))
    built = sorted(os.listdir(lib / "ckpt_ext" / "kernels"))
    source = sorted(n for n in os.listdir(os.path.join(ROOT, "kernels"))
                    if n.endswith((".py", ".json")))
    assert source and set(source) <= set(built), (source, built)
    assert "__init__.py" in built
    # The built package finds its modules beside it, not in a checkout.
    spec = importlib.util.spec_from_file_location(
        "built_kernels_init", lib / "ckpt_ext" / "kernels" / "__init__.py",
        submodule_search_locations=[])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [str(p) for p in module.__path__] == [str(lib / "ckpt_ext" / "kernels")], module.__path__


def test_test_extra_bounds_the_libraries_the_suite_checks():
    """A new release of these must not turn the README's test command red overnight: the test
    extra names an upper bound for each (raised after the suite passed on the new release)."""
    import re
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extra = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower(): r
             for r in project["optional-dependencies"]["test"]}
    for name in ("transformers", "peft", "accelerate", "deepspeed", "trl", "bitsandbytes"):
        assert name in extra and "<" in extra[name], f"the test extra: {name} unbounded ({extra})"
    assert not any("<" in r for r in project["dependencies"]), project["dependencies"]


def test_license_is_an_spdx_expression():
    """setuptools deprecates the ``license = {text = ...}`` table (its build prints the
    deprecation, a hard error from 2027-02-18); the SPDX string needs setuptools 77, which the
    build requires (torch 2.13 itself requires 77.0.3)."""
    import re
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        toml = tomllib.load(f)
    assert toml["project"]["license"] == "BSD-3-Clause", toml["project"]["license"]
    assert toml["project"]["license-files"] == ["LICENSE"]
    assert os.path.isfile(os.path.join(ROOT, "LICENSE"))
    setuptools = next(r for r in toml["build-system"]["requires"] if r.startswith("setuptools"))
    least = re.search(r">=\s*([\d.]+)", setuptools)
    assert least and tuple(int(x) for x in least.group(1).split(".")[:2]) >= (77, 0), setuptools
