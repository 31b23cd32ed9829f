# Does a C++ throw crash the process? (1) a tiny CPU extension; (2) ckpt_ext's op.
import sys, torch
from torch.utils.cpp_extension import load_inline
which = sys.argv[1]
if which == "inline":
    src = r'''
#include <torch/extension.h>
at::Tensor boom(at::Tensor x) { TORCH_CHECK(x.dim() == 99, "boom: x must have 99 dims"); return x; }
TORCH_LIBRARY(diag_throw, m) { m.def("boom(Tensor x) -> Tensor"); m.impl("boom", torch::kCPU, &boom); }
'''
    load_inline("diag_throw", cpp_sources=src, is_python_module=False, verbose=False)
    try:
        torch.ops.diag_throw.boom(torch.ones(2))
    except RuntimeError as e:
        print("inline dispatcher op: caught", str(e).splitlines()[0])
elif which == "ours_cpu":
    import ckpt_ext
    try:
        torch.ops.ckpt_ext.rms_norm_fwd(torch.ones(4, 64), torch.ones(32), 1e-6)
    except RuntimeError as e:
        print("ckpt_ext cpu op: caught", str(e).splitlines()[0])
elif which == "ours_cuda":
    import ckpt_ext
    try:
        torch.ops.ckpt_ext.rms_norm_fwd(torch.ones(4, 64, device="cuda"), torch.ones(32, device="cuda"), 1e-6)
    except RuntimeError as e:
        print("ckpt_ext cuda op: caught", str(e).splitlines()[0])
