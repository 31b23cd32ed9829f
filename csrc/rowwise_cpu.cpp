// CPU (ATen) implementation of the row-wise ops: RMSNorm forward / backward, the fused
// residual-add RMSNorm forward, and rotary position embedding forward / backward. They are the
// reference of the CUDA kernels in csrc/cuda/ and follow HF's semantics.
//
// RMSNorm (HF LlamaRMSNorm), over the last dim N = weight.numel() of x (any rank >= 1):
//   rstd = rsqrt(mean(xf^2) + eps),  n = xf * rstd,  y = weight * n.to(x.dtype)
// with xf = x in float32 (float64 for float64 x); y has dtype promote_types(x, weight).
//
// RoPE (HF apply_rotary_pos_emb): q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (B or 1, S, D)
// broadcast over heads; out = t * cos + rotate_half(t) * sin with
// rotate_half(t) = cat(-t[..., D/2:], t[..., :D/2]), computed in float32 (float64 for float64)
// and rounded once to t's dtype.
//
// Every output is a new contiguous tensor.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "checks.h"

namespace ckpt_ext {
namespace {

using checks::check_defined;
using checks::check_device_as;
using checks::check_dim;
using checks::check_floating;
using checks::check_like;
using checks::check_shape;

// ---- RMSNorm -------------------------------------------------------------------------------

// Validates x (..., N) and weight (N,).
void check_rms(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_defined(op, "x", x);
  check_defined(op, "weight", weight);
  CKPT_CHECK_VALUE(x.dim() >= 1, op, "x must have at least 1 dim (..., N), got a 0-dim tensor");
  check_floating(op, "x", x);
  check_floating(op, "weight", weight);
  check_device_as(op, "weight", weight, "x", x);
  const int64_t n = x.size(-1);
  check_shape(op, "weight", weight, {n}, "to match x's last dim");
  CKPT_CHECK_VALUE(n > 0, op, "x must have a non-empty last dim, got shape ",
                   checks::shape_str(x.sizes()));
}

// rstd (..., 1) and n = xf * rstd (..., N), both in the compute dtype.
std::tuple<at::Tensor, at::Tensor> rms_normalise(const at::Tensor& x, double eps) {
  at::Tensor xf = x.to(checks::compute_dtype(x.scalar_type()));
  at::Tensor rstd = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add_(eps));
  return {rstd, xf * rstd};
}

at::Tensor rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms("rms_norm_fwd", x, weight);
  at::Tensor n = std::get<1>(rms_normalise(x, eps));
  return (weight * n.to(x.scalar_type())).contiguous();  // promote_types(x, weight)
}

// dy (..., N) in the output dtype promote_types(x, weight). With n = x * rstd and
// g = dy * weight (compute dtype): dx = rstd * (g - n * mean(g * n)), in x's dtype;
// dweight = sum over rows of dy * n.to(x.dtype), accumulated in the compute dtype, in
// weight's dtype.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_bwd";
  check_rms(op, x, weight);
  check_defined(op, "dy", dy);
  check_shape(op, "dy", dy, x.sizes(), "(the shape of x)");
  const at::ScalarType out_dt = at::promote_types(x.scalar_type(), weight.scalar_type());
  checks::check_dtype(op, "dy", dy, out_dt, " (the output dtype, promote_types(x, weight))");
  check_device_as(op, "dy", dy, "x", x);

  const at::ScalarType cdt = checks::compute_dtype(x.scalar_type());
  auto [rstd, n] = rms_normalise(x, eps);
  at::Tensor dyf = dy.to(cdt);
  at::Tensor g = dyf * weight.to(cdt);                                    // (..., N)
  at::Tensor dx = (g - n * (g * n).mean(-1, /*keepdim=*/true)).mul_(rstd);
  const int64_t N = weight.numel();
  at::Tensor nx = n.to(x.scalar_type()).to(cdt);                          // y's factor as stored
  at::Tensor dweight = (dyf * nx).reshape({-1, N}).sum(0);                // (N,)
  return {dx.to(x.scalar_type()).contiguous(), dweight.to(weight.scalar_type())};
}

// s = x + residual (x's dtype); returns (rms_norm(s), s).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_fwd_cpu(const at::Tensor& x,
                                                        const at::Tensor& residual,
                                                        const at::Tensor& weight, double eps) {
  const char* op = "add_rms_norm_fwd";
  check_rms(op, x, weight);
  check_like(op, "residual", residual, "x", x, x.sizes(), "(the shape of x)");
  at::Tensor s = at::add(x, residual).contiguous();
  at::Tensor n = std::get<1>(rms_normalise(s, eps));
  return {(weight * n.to(s.scalar_type())).contiguous(), s};
}

// ---- RoPE ----------------------------------------------------------------------------------

// Validates q/k (or their gradients, named by qn/kn) and cos/sin; the op name is `op`.
void check_rope(const char* op, const char* qn, const at::Tensor& q, const char* kn,
                const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_defined(op, qn, q);
  check_defined(op, kn, k);
  check_defined(op, "cos", cos);
  check_defined(op, "sin", sin);
  check_dim(op, qn, q, 4, "(B, Hq, S, D)");
  check_dim(op, kn, k, 4, "(B, Hkv, S, D)");
  check_floating(op, qn, q);
  checks::check_dtype_as(op, kn, k, qn, q);
  check_device_as(op, kn, k, qn, q);
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3);
  check_shape(op, kn, k, {B, k.size(1), S, D},
              "(B, Hkv, S, D) with B, S, D from " + std::string(qn));
  CKPT_CHECK_VALUE(D % 2 == 0, op, qn, " must have an even head dim D, got D=", D);
  check_dim(op, "cos", cos, 3, "(B or 1, S, R)");
  check_floating(op, "cos", cos);
  check_device_as(op, "cos", cos, qn, q);
  CKPT_CHECK_VALUE(cos.size(0) == B || cos.size(0) == 1, op, "cos must have batch size 1 or B=",
                   B, ", got shape ", checks::shape_str(cos.sizes()));
  const int64_t R = cos.size(2);
  CKPT_CHECK_VALUE(R <= D && R % 2 == 0, op, "cos must be (B or 1, S, R) with an even "
                   "rotary width R <= D=", D, ", got shape ", checks::shape_str(cos.sizes()));
  check_shape(op, "cos", cos, {cos.size(0), S, R},
              "(B or 1, S, R) with S from " + std::string(qn));
  check_like(op, "sin", sin, "cos", cos, cos.sizes(), "(the shape of cos)");
}

// rotate_half(t) = cat(-t2, t1) and its transpose cat(t2, -t1), t = cat(t1, t2) on the last dim.
at::Tensor rotate_half(const at::Tensor& t, bool transpose) {
  const int64_t h = t.size(-1) / 2;
  at::Tensor t1 = t.narrow(-1, 0, h), t2 = t.narrow(-1, h, h);
  return transpose ? at::cat({t2, -t1}, -1) : at::cat({-t2, t1}, -1);
}

// forward:  t * cos + rotate_half(t) * sin;   backward: t * cos + rotate_half^T(t * sin).
// t (B, H, S, D); c, s (Bc, 1, S, R) in the compute dtype: the first R dims of t rotate (the
// pairs i, i + R/2), the other D - R pass through (partial rotary embeddings). Result in t's
// dtype and layout (checks::rope_out_like).
at::Tensor rope_apply(const at::Tensor& t, const at::Tensor& c, const at::Tensor& s,
                      bool backward) {
  const int64_t R = c.size(-1), D = t.size(-1);
  at::Tensor tf = t.narrow(-1, 0, R).to(c.scalar_type());
  at::Tensor r = backward ? tf * c + rotate_half(tf * s, /*transpose=*/true)
                          : tf * c + rotate_half(tf, /*transpose=*/false) * s;
  at::Tensor out = checks::rope_out_like(t);
  out.narrow(-1, 0, R).copy_(r);
  if (R < D) out.narrow(-1, R, D - R).copy_(t.narrow(-1, R, D - R));
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const char* op, const char* qn, const at::Tensor& q,
                                            const char* kn, const at::Tensor& k,
                                            const at::Tensor& cos, const at::Tensor& sin,
                                            bool backward) {
  check_rope(op, qn, q, kn, k, cos, sin);
  const at::ScalarType cdt = checks::compute_dtype(q.scalar_type());
  at::Tensor c = cos.to(cdt).unsqueeze(1);  // (Bc, 1, S, D)
  at::Tensor s = sin.to(cdt).unsqueeze(1);  // (Bc, 1, S, D)
  return {rope_apply(q, c, s, backward), rope_apply(k, c, s, backward)};
}

std::tuple<at::Tensor, at::Tensor> rope_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin) {
  return rope_cpu("rope_fwd", "q", q, "k", k, cos, sin, /*backward=*/false);
}

std::tuple<at::Tensor, at::Tensor> rope_bwd_cpu(const at::Tensor& dq_out, const at::Tensor& dk_out,
                                                const at::Tensor& cos, const at::Tensor& sin) {
  return rope_cpu("rope_bwd", "dq_out", dq_out, "dk_out", dk_out, cos, sin, /*backward=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cpu);
  m.impl("rope_fwd", &rope_fwd_cpu);
  m.impl("rope_bwd", &rope_bwd_cpu);
}

}  // namespace ckpt_ext
