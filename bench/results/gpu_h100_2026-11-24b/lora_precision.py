"""GPU session 2, calls 2 and 3: the input precision of the SwiGLU kernels' LoRA dots on a
half-precision base. (1) time of the LoRA SwiGLU forward+backward at LLaMA-3-8B dims (T 8192, H 4096,
I 14336, rank 16 on all three projections, bf16 base, fp32 adapters, frozen base) under each;
(2) error of each result against float64 for the LoRA test cases with a
half base, under "tf32" (the old choice), "tf32x3" (the new default) and "ieee". Run from the
repository root, with CKPT_EXT_AUTOTUNE=0 (first kept configuration, no tuning)."""
import sys

import torch
import triton.testing

sys.path.insert(0, "tests")
from reference import make_swiglu_lora, max_err  # noqa: E402
from test_triton_swiglu import (ALL_NAMES, LORA_CASES, flat_reference,  # noqa: E402
                                run_lora_kernels)

from ckpt_ext.kernels import swiglu_mlp  # noqa: E402

PRECISIONS = ("tf32", "tf32x3", "ieee")
chosen = swiglu_mlp._lora_precision


def use(prec):
    swiglu_mlp._lora_precision = lambda dtype: prec


import test_triton_swiglu as tts  # noqa: E402

H, I = tts.H, tts.I
# timing at LLaMA-3-8B dims
T8, H8, I8, r = 8192, 4096, 14336, 16
args, lora, scaling, dy = make_swiglu_lora(T8, H8, I8, torch.bfloat16, torch.float32, (r, r, r),
                                           False, device="cuda")
for prec in PRECISIONS:
    use(prec)

    def step():
        y, g, u = swiglu_mlp.swiglu_fwd(*args, lora, scaling, False)
        swiglu_mlp.swiglu_bwd(dy, *args, lora, scaling, None, None, tts.NEEDS["frozen_base"])
    step(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=200, rep=1500, return_mode="median")
    print(f"LLaMA-3-8B MLP LoRA r{r}, T {T8}, bf16, save=input, fwd+bwd (frozen base): {prec:<7} {ms:.3f} ms")
print(f"default for bf16 now: {chosen(torch.bfloat16)}; fp32: {chosen(torch.float32)}")
print("case  save    prec    each result's error / plain PyTorch's error (both against float64)")
for case, (T, dtype, ldt, ranks, bias) in enumerate(LORA_CASES):
    if dtype == torch.float32:
        continue
    args, lora, scaling, dy = make_swiglu_lora(T, H, I, dtype, ldt, ranks, bias, device="cuda")
    base = flat_reference(args, lora, scaling, dy)
    ref = flat_reference(args, lora, scaling, dy, torch.float64)
    for save in ("input", "gate_up"):
        for prec in PRECISIONS:
            use(prec)
            out = run_lora_kernels(args, lora, scaling, dy, save)
            cells = []
            for name, o, b, r in list(zip(ALL_NAMES, out, base, ref)):
                if r is None or o.numel() == 0:
                    continue
                e, be = max_err(o, r), max_err(b, r)
                cells.append(f"{name}={e / be if be else float('nan'):.2f}")
            print(f"{case:>4}  {save:<7} {prec:<7} " + " ".join(cells))

swiglu_mlp._lora_precision = chosen
