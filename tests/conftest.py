"""Test setup shared by every test module.

Triton kernels run on the CPU through Triton's interpreter when no CUDA GPU is present;
TRITON_INTERPRET must be set before triton is first imported, hence here. On a GPU the
kernels launch untimed fixed configurations (CKPT_EXT_AUTOTUNE=0) unless the environment says
otherwise.
"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # One untimed configuration per kernel specialization: the tests check results, and
    # autotuning every shape they use would compile each kernel's candidates many times over.
    # tests/test_autotune.py runs the autotuned path.
    os.environ.setdefault("CKPT_EXT_AUTOTUNE", "0")

import pytest  # noqa: E402

# Under pytest-xdist (the README's `-n 2`) the workers share the machine's cores: one intra-op
# thread each, so that two workers do not fight over the same cores with two threads apiece.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (optionally ``gpu(reason=...)``) skip without a CUDA device, with
    their reason printed in the summary (``-ra``)."""
    if torch.cuda.is_available():
        return
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=marker.kwargs.get("reason",
                                                                      "needs a CUDA GPU")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _kernel_settings():
    """The kernel settings a test changed with ckpt_ext.config.update (the chunk cap) come
    back after it."""
    from ckpt_ext import config
    before, pinned = config.current(), config.chunk_bytes_pinned()
    yield
    if config.current() != before or config.chunk_bytes_pinned() != pinned:
        restore = {f.name: getattr(before, f.name) for f in dataclasses.fields(before)}
        if not pinned:   # the default cap, not pinned (tests/test_config.py)
            restore["chunk_bytes"] = ""
        config.update(**restore)


def pytest_report_header(config):
    """One line on the Triton interpreter when the tests use it, so that a triton/numpy pairing
    it cannot run (see ckpt_ext.kernels._interpreter) is named before the failures."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from ckpt_ext.kernels._interpreter import interpreter_problem
    except ImportError as exc:  # triton missing: the Triton tests say so themselves
        return f"ckpt_ext: Triton interpreter unavailable ({exc})"
    return f"ckpt_ext: {interpreter_problem() or 'Triton interpreter OK'}"
