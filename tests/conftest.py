"""Test setup shared by every test module.

Triton kernels run on the CPU through Triton's interpreter when no CUDA GPU is present;
TRITON_INTERPRET must be set before triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
