// CPU (ATen) implementation of linear_cross_entropy_fwd / _bwd, the reference of the Triton
// kernels in kernels/linear_cross_entropy.py.
//
//   logits = hidden weight^T + bias                              (T, V), never whole
//   z       = s logits, or c tanh(s logits / c) with a cap     (s = logit_scale, c = softcap)
//   lse[t]  = logsumexp_v z[t, v]
//   loss[t] = lse[t] - z[t, labels[t]]   (0 where labels[t] == ignore_index)
//   dlogits = dloss[:, None] (exp(z - lse[:, None]) - onehot(labels)) dz/dlogits
//             (0 on ignored rows), dz/dlogits = s, or s (1 - tanh^2(s logits / c)) with a cap
//   dhidden = dlogits weight,  dweight = dlogits^T hidden,  dbias = sum_t dlogits
//
// Shapes: hidden (T, H); weight (V, H) (nn.Linear layout); bias (V,); labels (T,) int64;
// loss, lse, dloss (T,) float32 (float64 for float64 inputs). T = 0 is allowed (empty results;
// the weight and bias gradients are then zeros).
//
// Memory: tokens are processed in chunks whose (rows, V) logits in the compute dtype fit the
// byte cap CKPT_EXT_CHUNK_BYTES (csrc/chunking.h; at least one row), so that the transient
// logits / dlogits stay bounded whatever T is: one such buffer at a time (the log-sum-exp and
// dlogits are computed in place in it). Under a soft-cap the backward keeps the tanh's
// derivative beside it, so its chunks hold half as many rows. Backward forms only the
// gradients output_mask asks for: with a frozen weight (LoRA) there is no dweight GEMM and no
// (V, H) buffer; each chunk's dhidden rows are written in place in the input dtype.
//
// Precision: the matmuls run in the input dtype (ATen's CPU matmuls accumulate float16 /
// bfloat16 products in float32), so the logits are rounded to the input dtype once, as an HF
// lm_head computes them; the scale, the cap, the softmax, the log-sum-exp and the loss run in
// float32 (float64 for float64). dlogits are rounded to the input dtype (as HF's autograd does
// when it converts the float32 gradient of the upcast logits back); dweight is accumulated
// over chunks in float32 (float64) and rounded once; the widened dlogits of a chunk reuse its
// logits buffer.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "checks.h"
#include "chunking.h"

namespace ckpt_ext {
namespace {

using checks::check_defined;
using checks::check_device_as;
using checks::check_dim;
using checks::check_dtype;
using checks::check_floating;
using checks::check_like;

struct LceDims {
  int64_t T, H, V;
};

// Validates the arguments shared by both ops; returns (T, H, V).
LceDims check_lce(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const at::Tensor& labels) {
  check_defined(op, "hidden", hidden);
  check_dim(op, "hidden", hidden, 2, "(T, H) (tokens flattened)");
  check_floating(op, "hidden", hidden);
  check_defined(op, "weight", weight);
  check_dim(op, "weight", weight, 2, "(V, H)");
  const LceDims d{hidden.size(0), hidden.size(1), weight.size(0)};
  check_like(op, "weight", weight, "hidden", hidden, {d.V, d.H},
             "(V, H) with H=" + std::to_string(d.H) + " from hidden");
  CKPT_CHECK_VALUE(d.V > 0, op, "weight must have at least one vocabulary row, got shape ",
                   checks::shape_str(weight.sizes()));
  if (bias.has_value()) check_like(op, "bias", *bias, "hidden", hidden, {d.V}, "(V,)");
  check_defined(op, "labels", labels);
  check_dtype(op, "labels", labels, at::kLong);
  check_dim(op, "labels", labels, 1, "(T,)");
  checks::check_shape(op, "labels", labels, {d.T}, "(T,) with T from hidden");
  check_device_as(op, "labels", labels, "hidden", hidden);
  return d;
}

// A token-stat tensor (T,) of the compute dtype on hidden's device (lse, dloss).
void check_stat(const char* op, const char* name, const at::Tensor& t, const at::Tensor& hidden,
                const LceDims& d) {
  check_defined(op, name, t);
  check_dim(op, name, t, 1, "(T,)");
  checks::check_shape(op, name, t, {d.T}, "(T,) with T from hidden");
  check_dtype(op, name, t, checks::compute_dtype(hidden.scalar_type()),
              " (float64 for float64 hidden, else float32)");
  check_device_as(op, name, t, "hidden", hidden);
}

// logit_scale finite > 0; softcap finite >= 0 (0: no cap).
void check_transform(const char* op, double logit_scale, double softcap) {
  checks::check_positive_finite(op, "logit_scale", logit_scale);
  CKPT_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, op,
                   "softcap must be a finite number > 0 (or 0: no cap), got ", softcap);
}

// Rows per token chunk: `buffers` (rows, V) tensors in the compute dtype within the byte cap.
int64_t chunk_rows(const LceDims& d, at::ScalarType cdt, int64_t buffers = 1) {
  return chunking::lce_chunk_rows(d.V, static_cast<int64_t>(c10::elementSize(cdt)), buffers,
                                 chunking::chunk_bytes());
}

// z in place of the logits: logit_scale logits, or softcap tanh(logit_scale logits / softcap)
// with a cap.
void transform_(at::Tensor& z, double logit_scale, double softcap) {
  if (softcap > 0) {
    z.mul_(logit_scale / softcap).tanh_().mul_(softcap);
  } else if (logit_scale != 1.0) {
    z.mul_(logit_scale);
  }
}

// (tc, V) logits of the token rows of hc, in the compute dtype (rounded to the input dtype
// first, as a Linear in that dtype returns them).
at::Tensor chunk_logits(const at::Tensor& hc, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::ScalarType cdt) {
  at::Tensor z = bias.has_value() ? at::addmm(*bias, hc, weight.t()) : at::mm(hc, weight.t());
  return z.to(cdt);
}

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_fwd_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double logit_scale, double softcap) {
  const char* op = "linear_cross_entropy_fwd";
  const LceDims d = check_lce(op, hidden, weight, bias, labels);
  check_transform(op, logit_scale, softcap);
  const at::Tensor valid = labels.ne(ignore_index);                                // (T,)
  const at::Tensor bad = valid.logical_and(labels.lt(0).logical_or(labels.ge(d.V)));
  if (bad.any().item<bool>()) {
    const int64_t t = bad.nonzero().select(1, 0).min().item<int64_t>();
    CKPT_CHECK_VALUE(false, op, "labels must be in [0, V=", d.V, ") or equal ignore_index=",
                     ignore_index, ", got ", labels[t].item<int64_t>(), " at token ", t);
  }
  const at::ScalarType cdt = checks::compute_dtype(hidden.scalar_type());
  at::Tensor loss = at::empty({d.T}, hidden.options().dtype(cdt));
  at::Tensor lse = at::empty({d.T}, hidden.options().dtype(cdt));
  const int64_t step = chunk_rows(d, cdt);
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor z = chunk_logits(hidden.narrow(0, t0, tc), weight, bias, cdt);      // (tc, V)
    transform_(z, logit_scale, softcap);
    at::Tensor vc = valid.narrow(0, t0, tc);
    at::Tensor lc = at::where(vc, labels.narrow(0, t0, tc), 0).unsqueeze(1);         // (tc, 1)
    at::Tensor target = z.gather(1, lc).squeeze(1);                                  // (tc,)
    // log-sum-exp in place over the chunk (logsumexp would allocate a second (tc, V) buffer):
    // lse = m + log(sum exp(z - m)), m the row max.
    at::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));                          // (tc, 1)
    at::Tensor lse_c = lse.narrow(0, t0, tc);
    at::sum_out(lse_c, z.sub_(m).exp_(), {1});
    lse_c.log_().add_(m.squeeze(1));
    loss.narrow(0, t0, tc).copy_(at::where(vc, lse_c - target, 0));
  }
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cpu(
    const at::Tensor& dloss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& lse,
    int64_t ignore_index, std::array<bool, 3> output_mask, double logit_scale, double softcap) {
  const char* op = "linear_cross_entropy_bwd";
  const LceDims d = check_lce(op, hidden, weight, bias, labels);
  check_transform(op, logit_scale, softcap);
  check_stat(op, "dloss", dloss, hidden, d);
  check_stat(op, "lse", lse, hidden, d);
  const bool want_dh = output_mask[0], want_dw = output_mask[1];
  const bool want_db = output_mask[2] && bias.has_value();
  const at::ScalarType dt = hidden.scalar_type();
  const at::ScalarType cdt = checks::compute_dtype(dt);
  // A gradient not asked for: an empty (0,) tensor of its own (outputs never alias).
  auto none = [&] { return at::empty({0}, hidden.options()); };
  at::Tensor dhidden = want_dh ? at::empty({d.T, d.H}, hidden.options()) : none();
  if (!(want_dh || want_dw || want_db)) return {dhidden, none(), none()};
  const at::Tensor valid = labels.ne(ignore_index);
  // Per-token scale of dlogits: dloss logit_scale, 0 on ignored tokens.
  at::Tensor scale = at::where(valid, dloss, 0);                                    // (T,)
  if (logit_scale != 1.0) scale = scale * logit_scale;
  const bool capped = softcap > 0;

  const int64_t step = chunk_rows(d, cdt, capped ? 2 : 1);
  const bool one_chunk = d.T <= step;
  at::Tensor dweight;                                  // (V, H): input dtype, or an accumulator
  at::Tensor dbias = at::zeros({want_db ? d.V : 0}, hidden.options().dtype(cdt));
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor hc = hidden.narrow(0, t0, tc);
    at::Tensor z = chunk_logits(hc, weight, bias, cdt);                              // (tc, V)
    at::Tensor lc =                                                                  // (tc, 1)
        at::where(valid.narrow(0, t0, tc), labels.narrow(0, t0, tc), 0).unsqueeze(1);
    at::Tensor sc = scale.narrow(0, t0, tc).unsqueeze(1);                            // (tc, 1)
    // dlogits = scale (softmax(z) - onehot) (1 - tanh^2), in place over the chunk's logits.
    at::Tensor dcap;                                   // 1 - tanh^2 under a cap (tc, V)
    if (capped) {
      z.mul_(logit_scale / softcap).tanh_();
      dcap = at::mul(z, z).neg_().add_(1);
      z.mul_(softcap);
    } else if (logit_scale != 1.0) {
      z.mul_(logit_scale);
    }
    z.sub_(lse.narrow(0, t0, tc).unsqueeze(1)).exp_();
    z.scatter_add_(1, lc, at::full({tc, 1}, -1, z.options()));
    z.mul_(sc);
    if (capped) {
      z.mul_(dcap);
      dcap.reset();
    }
    at::Tensor dl = z.to(dt);                         // z itself when dt is the compute dtype
    if (want_dh) {
      at::Tensor dh_c = dhidden.narrow(0, t0, tc);                                 // (tc, H)
      at::mm_out(dh_c, dl, weight);
    }
    if (want_dw) {
      if (one_chunk) {
        dweight = at::mm(dl.t(), hc);
      } else {
        // The rounded dlogits widened back into z's buffer: no second (tc, V) copy.
        at::Tensor dl_c = dl.is_same(z) ? z : z.copy_(dl);
        at::Tensor hc_c = hc.to(cdt);
        if (dweight.defined()) {
          dweight.addmm_(dl_c.t(), hc_c);
        } else {
          dweight = at::mm(dl_c.t(), hc_c);
        }
      }
    }
    if (want_db) dbias.add_(dl.sum(0, false, cdt));
  }
  if (!want_dw) {
    dweight = none();
  } else {
    dweight = dweight.defined() ? dweight.to(dt) : at::zeros({d.V, d.H}, hidden.options());
  }
  return {dhidden, dweight, want_db ? dbias.to(dt) : none()};
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("linear_cross_entropy_fwd", &linear_cross_entropy_fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &linear_cross_entropy_bwd_cpu);
}

}  // namespace ckpt_ext
