// Torch-facing launchers of the CUDA row-wise kernels (rms_norm.cu, rope.cu), registered at
// the CUDA key of the ckpt_ext ops declared in csrc/ckpt_ext.cpp. They check the tensors
// (naming the argument), pick the dtypes, run on x's device and its current stream, and turn a
// failed launch into a c10::Error. Compiled only by the CUDA build.
//
// Dtypes: float32, float16 and bfloat16 in any combination the op schemas allow (float64 runs
// on the CPU reference only). Layout: RMSNorm views its input as (rows, n) rows with a unit
// column stride (a view when the leading dims collapse to one row stride, else a contiguous
// copy); RoPE takes any strides for (B, H, S) and copies q/k/cos/sin only when their last dim
// is not contiguous. All outputs are freshly allocated and contiguous.
#ifndef CKPT_EXT_WITH_CUDA
#error "rowwise_launch.cpp belongs to the CUDA build (setup.py defines CKPT_EXT_WITH_CUDA)"
#endif

// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/promote_types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "rowwise.cuh"

namespace {

using ckpt_ext::cuda::DType;

DType kernel_dtype(const char* op, const char* name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

void check_device(const char* op, const char* name, const at::Tensor& t,
                  const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device,
              " like the first input, got ", t.device());
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// x (..., n) -> (rows, n) with x2.stride(1) == 1; a view when possible, else a copy.
at::Tensor as_rows(const at::Tensor& x, int64_t n) {
  at::Tensor x2 = x.reshape({-1, n});
  if (n > 1 && x2.stride(1) != 1) x2 = x2.contiguous();
  return x2;
}

// Shared checks of the RMSNorm ops: x (..., N) with N >= 1 and weight (N,) on one CUDA
// device, each float32/float16/bfloat16. Returns (x dtype, weight dtype).
std::pair<DType, DType> check_rms_norm(const char* op, const at::Tensor& x,
                                       const at::Tensor& weight) {
  check_device(op, "x", x, x.device());
  check_device(op, "weight", weight, x.device());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dim (..., N), got a 0-dim tensor");
  TORCH_CHECK(x.size(-1) > 0, op, ": x must have a non-empty last dim, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be (N,) with N = x.size(-1) = ", x.size(-1), ", got shape ",
              weight.sizes());
  return {kernel_dtype(op, "x", x), kernel_dtype(op, "weight", weight)};
}

// ---- RMSNorm -------------------------------------------------------------------------------
at::ScalarType out_dtype(const at::Tensor& x, const at::Tensor& weight) {
  return at::promote_types(x.scalar_type(), weight.scalar_type());
}

// y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype); y has x's shape and
// dtype promote_types(x, weight).
at::Tensor rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm_fwd";
  const auto [xd, wd] = check_rms_norm(op, x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype(x, weight)));
  if (y.numel() == 0) return y;
  const at::Tensor x2 = as_rows(x, n);
  const at::Tensor w = weight.contiguous();
  check_launch(op, ckpt_ext::cuda::rms_norm_fwd(x2.data_ptr(), x2.stride(0), w.data_ptr(),
                                                y.data_ptr(), x2.size(0), n,
                                                static_cast<float>(eps), xd, wd,
                                                current_stream()));
  return y;
}

// s = x + residual (x's dtype), y = rms_norm_fwd(s, weight, eps). Returns (y, s).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_fwd_cuda(const at::Tensor& x,
                                                         const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps) {
  constexpr const char* op = "add_rms_norm_fwd";
  const auto [xd, wd] = check_rms_norm(op, x, weight);
  check_device(op, "residual", residual, x.device());
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual must have x's shape ", x.sizes(),
              ", got ", residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op, ": residual must have x's dtype (",
              x.scalar_type(), "), got ", residual.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype(x, weight)));
  at::Tensor sum = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return {y, sum};
  const at::Tensor x2 = as_rows(x, n);
  const at::Tensor r2 = as_rows(residual, n);
  const at::Tensor w = weight.contiguous();
  check_launch(op, ckpt_ext::cuda::add_rms_norm_fwd(
                       x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), w.data_ptr(),
                       y.data_ptr(), sum.data_ptr(), x2.size(0), n, static_cast<float>(eps), xd,
                       wd, current_stream()));
  return {y, sum};
}

// dy: x's shape, dtype promote_types(x, weight). rstd is recomputed from x. Returns dx (x's
// shape and dtype) and dweight (weight's shape and dtype, float32-accumulated, deterministic).
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm_bwd";
  const auto [xd, wd] = check_rms_norm(op, x, weight);
  check_device(op, "dy", dy, x.device());
  TORCH_CHECK(dy.sizes() == x.sizes(), op, ": dy must have x's shape ", x.sizes(), ", got ",
              dy.sizes());
  TORCH_CHECK(dy.scalar_type() == out_dtype(x, weight), op,
              ": dy must have the forward output's dtype ", out_dtype(x, weight),
              " (promote_types of x ", x.scalar_type(), " and weight ",
              weight.scalar_type(), "), got ", dy.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dweight = at::empty(weight.sizes(), weight.options());
  const at::Tensor x2 = as_rows(x, n);
  const at::Tensor dy2 = as_rows(dy, n);
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x2.size(0);
  int64_t ws_floats = 0;
  check_launch(op, ckpt_ext::cuda::rms_norm_bwd_workspace_size(rows, n, xd, &ws_floats));
  // Per-block partial dweight rows (stage 1 of the deterministic reduction).
  at::Tensor workspace = at::empty({ws_floats}, x.options().dtype(at::kFloat));
  check_launch(op, ckpt_ext::cuda::rms_norm_bwd(
                       dy2.data_ptr(), dy2.stride(0), x2.data_ptr(), x2.stride(0), w.data_ptr(),
                       dx.data_ptr(), dweight.data_ptr(), workspace.data_ptr<float>(), ws_floats,
                       rows, n, static_cast<float>(eps), xd, wd, current_stream()));
  return {dx, dweight};
}

// ---- RoPE ----------------------------------------------------------------------------------

// a (B, Hq, S, D) and b (B, Hkv, S, D) (q/k, or dq_out/dk_out), cos/sin (1 or B, S, D).
// Returns (B, Hq, S, D) and (B, Hkv, S, D) in a's dtype, laid out as checks::rope_out_like.
std::tuple<at::Tensor, at::Tensor> rope_cuda(const char* op, const char* qname,
                                             const char* kname, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, bool backward) {
  check_device(op, qname, q, q.device());
  check_device(op, kname, k, q.device());
  check_device(op, "cos", cos, q.device());
  check_device(op, "sin", sin, q.device());
  TORCH_CHECK(q.dim() == 4, op, ": ", qname, " must be (B, Hq, S, D), got shape ", q.sizes());
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(2) == S && k.size(3) == D, op, ": ",
              kname, " must be (B, Hkv, S, D) = (", B, ", Hkv, ", S, ", ", D, "), got shape ",
              k.sizes());
  TORCH_CHECK(D % 2 == 0, op, ": head dim D must be even, got D=", D);
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == S &&
                  cos.size(2) <= D && cos.size(2) % 2 == 0,
              op, ": cos must be (1 or B, S, R) with B=", B, ", S=", S,
              " and an even rotary width R <= D=", D, ", got shape ", cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin must have cos's shape ", cos.sizes(),
              ", got ", sin.sizes());
  const DType qd = kernel_dtype(op, qname, q);
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": ", kname, " must have ", qname,
              "'s dtype (", q.scalar_type(), "), got ", k.scalar_type());
  const DType cd = kernel_dtype(op, "cos", cos);
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type(), op, ": sin must have cos's dtype (",
              cos.scalar_type(), "), got ", sin.scalar_type());

  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = ckpt_ext::checks::rope_out_like(q);
  at::Tensor k_out = ckpt_ext::checks::rope_out_like(k);
  if (q.numel() == 0 && k.numel() == 0) return {q_out, k_out};
  // The kernel needs a contiguous last dim; any strides of the first three dims are fine.
  const at::Tensor qi = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor ki = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor ci = cos.stride(2) == 1 ? cos : cos.contiguous();
  const at::Tensor si = sin.stride(2) == 1 ? sin : sin.contiguous();

  ckpt_ext::cuda::RopeArgs a;
  a.q = qi.data_ptr();
  a.k = ki.data_ptr();
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = qi.stride(d);
    a.k_stride[d] = ki.stride(d);
  }
  a.q_out = q_out.data_ptr();
  a.k_out = k_out.data_ptr();
  for (int d = 0; d < 3; ++d) {
    a.q_out_stride[d] = q_out.stride(d);
    a.k_out_stride[d] = k_out.stride(d);
  }
  a.cos = ci.data_ptr();
  a.cos_stride[0] = ci.size(0) == 1 ? 0 : ci.stride(0);  // batch 1 broadcasts
  a.cos_stride[1] = ci.stride(1);
  a.sin = si.data_ptr();
  a.sin_stride[0] = si.size(0) == 1 ? 0 : si.stride(0);
  a.sin_stride[1] = si.stride(1);
  a.batch = B;
  a.heads_q = q.size(1);
  a.heads_k = k.size(1);
  a.seq = S;
  a.head_dim = D;
  a.rot_dim = cos.size(2);
  check_launch(op, ckpt_ext::cuda::rope(a, backward, qd, cd, current_stream()));
  return {q_out, k_out};
}

// q_out = q * cos + rotate_half(q) * sin, same for k.
std::tuple<at::Tensor, at::Tensor> rope_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos, const at::Tensor& sin) {
  return rope_cuda("rope_fwd", "q", "k", q, k, cos, sin, /*backward=*/false);
}

// dq = dq_out * cos + rotate_half^T(dq_out * sin), same for dk.
std::tuple<at::Tensor, at::Tensor> rope_bwd_cuda(const at::Tensor& dq_out,
                                                 const at::Tensor& dk_out, const at::Tensor& cos,
                                                 const at::Tensor& sin) {
  return rope_cuda("rope_bwd", "dq_out", "dk_out", dq_out, dk_out, cos, sin, /*backward=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("rms_norm_fwd", TORCH_FN(rms_norm_fwd_cuda));
  m.impl("rms_norm_bwd", TORCH_FN(rms_norm_bwd_cuda));
  m.impl("add_rms_norm_fwd", TORCH_FN(add_rms_norm_fwd_cuda));
  m.impl("rope_fwd", TORCH_FN(rope_fwd_cuda));
  m.impl("rope_bwd", TORCH_FN(rope_bwd_cuda));
}
