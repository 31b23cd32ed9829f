"""bench/_opcount.py (lora_profile.py --count): the counts of a few ops against hand counts."""
import importlib.util
import pathlib

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_opcount", ROOT / "bench" / "_opcount.py")
opcount = importlib.util.module_from_spec(spec)
spec.loader.exec_module(opcount)


def counted(fn):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return opcount.count_ops(prof)


def test_counts_match_hand_counts():
    M, K, N = 7, 5, 3
    a = torch.randn(M, K, dtype=torch.bfloat16)
    b = torch.randn(K, N)
    y = torch.randn(M, N)

    def step():
        af = a.float()                    # copy_: M K bf16 read, M K fp32 written
        z = torch.mm(af, b)               # 2 M N K FLOPs; operands and result fp32
        z.mul_(0.5)                       # scalar wrapped in a 0-d tensor: still one mul_
        y.add_(z, alpha=2.0)              # reads y and z, writes y
        return torch.nn.functional.linear(af, b.t())   # an addmm-free mm under linear

    c = counted(step)
    assert c["aten::copy_"] == opcount.Counted(1, 0, M * K * (2 + 4))
    mm = c["aten::mm"]
    assert mm.count == 2 and mm.flops == 2 * (2 * M * N * K)
    assert mm.bytes == 2 * 4 * (M * K + K * N + M * N)
    assert c["aten::mul_"] == opcount.Counted(1, 0, 2 * 4 * M * N)
    assert c["aten::add_"] == opcount.Counted(1, 0, 3 * 4 * M * N)
    assert set(c) == {"aten::copy_", "aten::mm", "aten::mul_", "aten::add_"}
    assert opcount.totals(c).count == 5


def test_difference_lists_changed_ops_only():
    x = torch.randn(16, 8)
    base = counted(lambda: x * 2)
    more = counted(lambda: (x * 2, x.abs()))
    d = opcount.difference(more, base)
    assert list(d) == ["aten::abs"] and d["aten::abs"] == opcount.Counted(1, 0, 2 * 4 * 16 * 8)
