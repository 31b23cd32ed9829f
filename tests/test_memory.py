"""saved_activation_bytes on cases whose answer is computed by hand."""
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_ext

N, D_IN, D_HID = 37, 24, 40


def linear_gelu_stack(dtype):
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.GELU(), nn.Linear(D_HID, D_IN), nn.GELU()).to(dtype)


def test_linear_gelu_stack_by_hand():
    for dtype, size in ((torch.float32, 4), (torch.float64, 8), (torch.bfloat16, 2)):
        model = linear_gelu_stack(dtype)
        x = torch.randn(N, D_IN, dtype=dtype, requires_grad=True)
        # Linear1 saves x; GELU1 saves its input (N, D_HID); Linear2 saves GELU1's output
        # (N, D_HID); GELU2 saves its input (N, D_IN). Weights are parameters: not counted.
        expected = size * (N * D_IN + N * D_HID + N * D_HID + N * D_IN)
        assert ckpt_ext.saved_activation_bytes(model, x) == expected


def test_input_not_requiring_grad_still_counted_once():
    model = linear_gelu_stack(torch.float32)
    x = torch.randn(N, D_IN)  # the first Linear still saves x for its weight gradient
    expected = 4 * (N * D_IN + 2 * N * D_HID + N * D_IN)
    assert ckpt_ext.saved_activation_bytes(model, x) == expected


def test_checkpointed_stack_saves_only_its_input():
    model = linear_gelu_stack(torch.float32)
    x = torch.randn(N, D_IN, requires_grad=True)
    assert ckpt_ext.saved_activation_bytes(ckpt_ext.checkpoint, model, x) == 4 * N * D_IN
    assert ckpt_ext.saved_activation_bytes(
        lambda t: torch_checkpoint(model, t, use_reentrant=False), x) == 4 * N * D_IN


def test_views_share_one_storage():
    x = torch.randn(10, 10, requires_grad=True)
    # Both halves are views of x's storage: saved twice, counted once.
    fn = lambda t: t[:5].sin() + t[5:].sin()  # noqa: E731
    assert ckpt_ext.saved_activation_bytes(fn, x) == 4 * 100


def test_parameter_views_excluded():
    w = nn.Parameter(torch.randn(6, 6))
    x = torch.randn(3, 6, requires_grad=True)
    # mm saves x and w.t() (a view of a parameter): only x counts.
    assert ckpt_ext.saved_activation_bytes(lambda t: t @ w.t(), x) == 4 * 18
