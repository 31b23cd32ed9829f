"""saved_activation_bytes and peak_memory_bytes on cases whose answer is computed by hand."""
import random

import pytest
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


# ---- peak_memory_bytes ---------------------------------------------------------------------
# Sizes are drawn afresh each run (not from torch's seeded generator), so that no constant of a
# particular run can make these pass. TOL: room for the allocations the profiler or the
# allocator make around the call (a few small tensors), far below the sizes measured.
_rng = random.SystemRandom()
MiB = 2**20
TOL = 64 * 1024


def _fresh_bytes(mib: int) -> int:
    """About ``mib`` MiB, a multiple of 4 bytes that differs from run to run."""
    return mib * MiB + 4 * _rng.randrange(1, 64 * 1024)


# With no tensor among its arguments, peak_memory_bytes measures the current CUDA device when
# CUDA is available, else the CPU: the tests whose fn takes no tensor allocate there.
NO_TENSOR_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _floats(nbytes: int, device=NO_TENSOR_DEVICE) -> torch.Tensor:
    return torch.empty(nbytes // 4, dtype=torch.float32, device=device)


def test_peak_of_two_tensors_held_together_is_their_sum():
    a, b = _fresh_bytes(4), _fresh_bytes(8)

    def fn():
        x = _floats(a)
        y = _floats(b)   # while x is held
        del x, y

    peak = ckpt_ext.peak_memory_bytes(fn)
    assert a + b <= peak <= a + b + TOL, (peak, a + b)


def test_peak_of_tensors_freed_in_turn_is_the_larger():
    a, b = _fresh_bytes(4), _fresh_bytes(8)
    first_large = _rng.random() < 0.5

    def fn(n1, n2):
        x = _floats(n1)
        del x
        y = _floats(n2)
        del y

    args = (b, a) if first_large else (a, b)
    peak = ckpt_ext.peak_memory_bytes(fn, *args)
    assert max(a, b) <= peak <= max(a, b) + TOL, (peak, a, b)
    assert peak < a + b - TOL  # not the sum: nothing was held together


def test_peak_counts_from_the_start_and_frees_of_older_memory():
    """The arguments' own bytes are the base, not part of the peak. Freeing a tensor allocated
    before the call: on CUDA it lowers what later allocations add; on CPU the profiler does not
    know the size of a block allocated before it started, so the free is not seen and the peak
    is that of the call's own allocations (documented)."""
    held, new = _fresh_bytes(6), _fresh_bytes(8)
    box = [_floats(held, "cpu")]

    def fn(box, n):
        box.pop()             # frees `held` bytes allocated before the call
        y = _floats(n, "cpu")
        del y

    peak = ckpt_ext.peak_memory_bytes(fn, box, n=new)  # keyword arguments reach fn
    assert new <= peak <= new + TOL, (peak, new)
    assert not box
    assert ckpt_ext.peak_memory_bytes(lambda: None) <= TOL  # allocates nothing


def test_peak_includes_what_fn_returns_and_a_module_step():
    n = _fresh_bytes(3)
    peak = ckpt_ext.peak_memory_bytes(lambda: _floats(n))
    assert n <= peak <= n + TOL
    # A Linear's forward + backward on a batch of T rows: the gradients of x, weight and bias
    # are all alive at the end, so the peak is at least their sum; beyond it there is at most
    # the output (T, out) and its gradient (T, out).
    T, d_in, d_out = _rng.randrange(2000, 3000), 256, 384
    lin = nn.Linear(d_in, d_out)
    x = torch.randn(T, d_in, requires_grad=True)

    def step(module, inp):
        module(inp).sum().backward()

    held_after = 4 * (T * d_in + d_out * d_in + d_out)   # x.grad, weight.grad, bias.grad
    peak = ckpt_ext.peak_memory_bytes(step, lin, x)
    assert held_after <= peak <= held_after + 2 * 4 * T * d_out + TOL, peak


def test_device_is_read_from_the_arguments():
    from ckpt_ext.memory import _compute_device

    lin = nn.Linear(3, 3)
    assert _compute_device(lin, (torch.zeros(2, 3),), {}).type == "cpu"
    assert _compute_device(lambda m: m, (), {"m": {"w": [torch.zeros(1)]}}).type == "cpu"
    assert _compute_device(lin.forward, (), {}).type == "cpu"  # a bound method's module
    if not torch.cuda.is_available():
        assert _compute_device(lambda: None, (), {}).type == "cpu"


@pytest.mark.gpu
def test_cuda_peak_is_relative_to_the_start():
    a, b = _fresh_bytes(4), _fresh_bytes(8)
    resident = _floats(_fresh_bytes(16), "cuda")  # allocated before: not part of the peak

    def fn(t):
        x = _floats(a, t.device)
        y = _floats(b, t.device)
        del x, y

    peak = ckpt_ext.peak_memory_bytes(fn, resident)
    # the caching allocator rounds each request up to a multiple of 512 bytes
    assert a + b <= peak <= a + b + 1024, (peak, a + b)
    box = [resident]
    del resident

    def frees_first(box, n):  # on CUDA a free of older memory lowers the peak
        device = box.pop().device   # the tensor is freed here, before y is allocated
        y = _floats(n, device)
        del y

    held = box[0].nbytes
    peak = ckpt_ext.peak_memory_bytes(frees_first, box, n=held + a)
    # (held + a) rounded up to 512, less held rounded up: a, give or take one rounding
    assert a - 512 < peak < a + 512, (peak, a)


def test_nested_peaks_each_see_their_own_part():
    """A peak_memory_bytes inside the measured function measures its part, and the outer call
    still sees everything (it returned 0 when the inner call ended the profiler session)."""
    a, b, c = _fresh_bytes(4), _fresh_bytes(8), _fresh_bytes(4)
    inner = []

    def part():
        y = _floats(b)
        del y

    def fn():
        x = _floats(a)            # held across the inner measurement
        inner.append(ckpt_ext.peak_memory_bytes(part))
        z = _floats(c)            # after it: the outer session must have gone on
        del x, z

    peak = ckpt_ext.peak_memory_bytes(fn)
    assert b <= inner[0] <= b + TOL, (inner, b)
    want = a + max(b, c)
    assert want <= peak <= want + TOL, (peak, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path is the one that profiles")
def test_a_running_profiler_of_the_callers_survives_a_refusal():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with pytest.raises(RuntimeError, match="peak_memory_bytes: a torch profiler is already "
                                               "running"):
            ckpt_ext.peak_memory_bytes(lambda: _floats(1024))
        assert torch.autograd._profiler_enabled()
        torch.mm(torch.ones(3, 3), torch.ones(3, 3))  # recorded by the caller's profiler
    assert any(e.name == "aten::mm" for e in prof.events())


@pytest.mark.parametrize("stamps", ["same", "swapped"])
def test_cpu_peak_follows_the_allocator_total_not_timestamps(stamps):
    """A block allocated and freed at once can get one timestamp for both events, or the free
    an earlier one (a thread that moved between cores): the peak follows the allocator's
    running total that each event carries, so the meter still sees the block."""
    from ckpt_ext import memory

    n, base, probe = _fresh_bytes(8), _rng.randrange(1, 1 << 30), 0x1000
    free_at = 7 if stamps == "same" else 6
    # (timestamp, address, bytes, allocator total after the event), listed in timestamp order
    events = sorted([(1, probe, 1, base + 1), (5, 0x2000, 100, base + 101),
                     (7, 0x3000, n, base + 101 + n), (free_at, 0x3000, -n, base + 101),
                     (9, 0x2000, -100, base + 1), (10, 0x4000, 40, base + 41),
                     (11, probe, -1, base + 40)])
    assert memory._session_bytes(events, probe) == (100 + n, 40)
    # A running sum in the listed order (the free first) would miss the block.
    total = peak = 0
    for *_, nbytes, _ in events:
        total += nbytes
        peak = max(peak, total)
    assert peak < 100 + n


def test_cpu_meter_folds_sessions_in_order():
    from ckpt_ext import memory

    meter = memory._CpuMeter()
    meter.add_session(peak=50, change=30)
    meter.add_session(peak=10, change=-20)
    meter.add_session(peak=25, change=0)
    assert (meter.peak, meter.total) == (50, 10)
    meter.add_session(peak=45, change=5)
    assert (meter.peak, meter.total) == (55, 15)
