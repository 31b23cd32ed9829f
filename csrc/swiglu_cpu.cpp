// CPU (ATen) implementation of swiglu_fwd / swiglu_bwd, the reference of the Triton kernels.
//
//   gate = x Wg^T + bg,  up = x Wu^T + bu          (T, I)
//   y    = (silu(gate) * up) Wd^T + bd             (T, H)
//
// Shapes: x (T, H); w_gate, w_up (I, H); w_down (H, I) (nn.Linear layout); b_gate, b_up (I,);
// b_down (H,); all of x's dtype and device. T = 0 is allowed (empty results of the right
// shapes; the weight gradients are then zeros).
//
// Memory: tokens are processed in chunks of at most kChunkElems / I rows, so the transient
// (chunk, I) intermediates (gate, up, h, dh, dgate, dup) stay bounded whatever T is; only the
// outputs (and gate/up when they are requested or given) are (T, I) sized.
//
// Precision: the matmuls run in the input dtype (ATen's CPU matmuls accumulate float16 /
// bfloat16 products in float32); the pointwise SwiGLU math runs in float32 (float64 for
// float64) and is rounded once to the input dtype; weight and bias gradients are accumulated
// over token chunks in float32 (float64) and rounded once (see TnSum).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "checks.h"

namespace ckpt_ext {
namespace {

using checks::check_defined;
using checks::check_dim;
using checks::check_floating;
using checks::check_like;

constexpr int64_t kChunkElems = int64_t{1} << 22;  // elements of one (chunk, I) intermediate

struct SwigluDims {
  int64_t T, H, I;
};

// Validates the arguments shared by both ops; returns (T, H, I).
SwigluDims check_swiglu(const char* op, const at::Tensor& x, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& w_down,
                        const std::optional<at::Tensor>& b_gate,
                        const std::optional<at::Tensor>& b_up,
                        const std::optional<at::Tensor>& b_down) {
  check_defined(op, "x", x);
  check_dim(op, "x", x, 2, "(T, H) (tokens flattened)");
  check_floating(op, "x", x);
  check_defined(op, "w_gate", w_gate);
  check_dim(op, "w_gate", w_gate, 2, "(I, H)");
  const SwigluDims d{x.size(0), x.size(1), w_gate.size(0)};
  const std::string hs = "(I, H) with H=" + std::to_string(d.H) + " from x";
  check_like(op, "w_gate", w_gate, "x", x, {d.I, d.H}, hs);
  check_like(op, "w_up", w_up, "x", x, {d.I, d.H}, "(I, H), the shape of w_gate");
  check_like(op, "w_down", w_down, "x", x, {d.H, d.I}, "(H, I) for w_gate of shape (I, H)");
  if (b_gate.has_value()) check_like(op, "b_gate", *b_gate, "x", x, {d.I}, "(I,)");
  if (b_up.has_value()) check_like(op, "b_up", *b_up, "x", x, {d.I}, "(I,)");
  if (b_down.has_value()) check_like(op, "b_down", *b_down, "x", x, {d.H}, "(H,)");
  return d;
}

// Rows per token chunk: bounded (chunk, I) intermediates, at least 64 rows.
int64_t chunk_rows(const SwigluDims& d) {
  return std::max<int64_t>(64, kChunkElems / std::max<int64_t>(d.I, 1));
}

// out = a b^T (+ bias), written into the preallocated contiguous `out` (rows, cols).
void linear_into(at::Tensor out, const at::Tensor& a, const at::Tensor& w,
                 const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) {
    at::addmm_out(out, *bias, a, w.t());
  } else {
    at::mm_out(out, a, w.t());
  }
}

// silu(gate) * up in the compute dtype, rounded to gate's dtype. gate, up (rows, I).
at::Tensor swiglu_product(const at::Tensor& gate, const at::Tensor& up) {
  const at::ScalarType cdt = checks::compute_dtype(gate.scalar_type());
  return at::silu(gate.to(cdt)).mul_(up.to(cdt)).to(gate.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_fwd_cpu(
    const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
    const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
    bool return_gate_up) {
  const SwigluDims d = check_swiglu("swiglu_fwd", x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  at::Tensor y = at::empty({d.T, d.H}, x.options());                                 // (T, H)
  at::Tensor gate = return_gate_up ? at::empty({d.T, d.I}, x.options()) : x.new_empty({0});
  at::Tensor up = return_gate_up ? at::empty({d.T, d.I}, x.options()) : x.new_empty({0});
  const int64_t step = chunk_rows(d);
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor xc = x.narrow(0, t0, tc);                                             // (tc, H)
    at::Tensor gc = return_gate_up ? gate.narrow(0, t0, tc) : at::empty({tc, d.I}, x.options());
    at::Tensor uc = return_gate_up ? up.narrow(0, t0, tc) : at::empty({tc, d.I}, x.options());
    linear_into(gc, xc, w_gate, b_gate);                                             // (tc, I)
    linear_into(uc, xc, w_up, b_up);                                                 // (tc, I)
    at::Tensor h = swiglu_product(gc, uc);                                           // (tc, I)
    linear_into(y.narrow(0, t0, tc), h, w_down, b_down);                             // (tc, H)
  }
  return {y, gate, up};
}

// sum over token chunks of a_c^T b_c (a weight gradient). With one chunk it is one matmul in
// the input dtype (ATen accumulates it in float32 and rounds once). With several the sum runs in
// the compute dtype, the chunk operands (small) converted, so that no (I, H) temporary is
// zero-filled, added or converted per chunk: for bfloat16 those passes cost 4x the matmuls.
class TnSum {
 public:
  TnSum(bool one_chunk, at::ScalarType cdt) : one_chunk_(one_chunk), cdt_(cdt) {}
  void add(const at::Tensor& a, const at::Tensor& b) {
    if (one_chunk_) {
      sum_ = at::mm(a.t(), b);
      return;
    }
    const at::Tensor ac = a.to(cdt_), bc = b.to(cdt_);
    if (sum_.defined()) {
      sum_.addmm_(ac.t(), bc);
    } else {
      sum_ = at::mm(ac.t(), bc);
    }
  }
  // The sum in dtype `dt`; zeros of `shape` when no chunk was added (T = 0).
  at::Tensor result(at::IntArrayRef shape, const at::TensorOptions& opts) const {
    return sum_.defined() ? sum_.to(opts.dtype()) : at::zeros(shape, opts);
  }

 private:
  bool one_chunk_;
  at::ScalarType cdt_;
  at::Tensor sum_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
swiglu_bwd_cpu(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w_gate,
               const at::Tensor& w_up, const at::Tensor& w_down,
               const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
               const std::optional<at::Tensor>& b_down, const std::optional<at::Tensor>& gate,
               const std::optional<at::Tensor>& up) {
  const char* op = "swiglu_bwd";
  const SwigluDims d = check_swiglu(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  check_like(op, "dy", dy, "x", x, {d.T, d.H}, "(T, H), the shape of x");
  const bool recompute = checks::absent(gate);
  CKPT_CHECK_VALUE(recompute == checks::absent(up), op,
                   "gate and up must be given together (save=\"gate_up\") or both left out "
                   "(save=\"input\"), got gate ", recompute ? "absent" : "given", " and up ",
                   checks::absent(up) ? "absent" : "given");
  if (!recompute) {
    check_like(op, "gate", *gate, "x", x, {d.T, d.I}, "(T, I)");
    check_like(op, "up", *up, "x", x, {d.T, d.I}, "(T, I)");
  }

  const at::ScalarType cdt = checks::compute_dtype(x.scalar_type());
  const auto acc_opts = x.options().dtype(cdt);
  at::Tensor dx = at::empty({d.T, d.H}, x.options());      // (T, H)
  const int64_t step = chunk_rows(d);
  const bool one_chunk = d.T <= step;
  TnSum dwg(one_chunk, cdt), dwu(one_chunk, cdt), dwd(one_chunk, cdt);  // (I, H) (I, H) (H, I)
  at::Tensor dbg = at::zeros({d.I}, acc_opts);             // (I,)
  at::Tensor dbu = at::zeros({d.I}, acc_opts);             // (I,)
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor xc = x.narrow(0, t0, tc);                   // (tc, H)
    at::Tensor dyc = dy.narrow(0, t0, tc);                 // (tc, H)
    at::Tensor gc, uc;                                     // (tc, I) pre-activations
    if (recompute) {
      gc = at::empty({tc, d.I}, x.options());
      uc = at::empty({tc, d.I}, x.options());
      linear_into(gc, xc, w_gate, b_gate);
      linear_into(uc, xc, w_up, b_up);
    } else {
      gc = gate->narrow(0, t0, tc);
      uc = up->narrow(0, t0, tc);
    }
    // Pointwise part in the compute dtype, in few passes over (tc, I) (it is memory-bound):
    // silu(g) = g s with s = sigmoid(g); dgate = (dh u) silu'(g), silu'(g) = s (1 + g (1 - s)),
    // which is ATen's fused silu_backward; dup = dh silu(g); h = silu(g) u.
    at::Tensor g = gc.to(cdt), u = uc.to(cdt);
    at::Tensor dh = at::mm(dyc, w_down).to(cdt);           // dh = dy Wd  (tc, I)
    at::Tensor silu = at::silu(g);
    at::Tensor dgate = at::silu_backward(dh * u, g).to(x.scalar_type());  // (tc, I)
    at::Tensor dup = dh.mul_(silu).to(x.scalar_type());                   // (tc, I)
    at::Tensor h = silu.mul_(u).to(x.scalar_type());                      // (tc, I)
    dwd.add(dyc, h);                                          // dWd += dy^T h
    dwg.add(dgate, xc);                                       // dWg += dgate^T x
    dwu.add(dup, xc);                                         // dWu += dup^T x
    at::Tensor dxc = dx.narrow(0, t0, tc);
    at::mm_out(dxc, dgate, w_gate);                           // dx = dgate Wg + dup Wu
    dxc.addmm_(dup, w_up);
    if (b_gate.has_value()) dbg.add_(dgate.sum(0, false, cdt));
    if (b_up.has_value()) dbu.add_(dup.sum(0, false, cdt));
  }
  const at::ScalarType dt = x.scalar_type();
  auto bias_grad = [&](const std::optional<at::Tensor>& bias, const at::Tensor& acc) {
    return bias.has_value() ? acc.to(dt) : x.new_empty({0});
  };
  at::Tensor dbd = b_down.has_value() ? dy.sum(0, false, cdt).to(dt) : x.new_empty({0});
  const auto out_opts = x.options();
  return {dx,
          dwg.result({d.I, d.H}, out_opts),
          dwu.result({d.I, d.H}, out_opts),
          dwd.result({d.H, d.I}, out_opts),
          bias_grad(b_gate, dbg),
          bias_grad(b_up, dbu),
          dbd};
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("swiglu_fwd", &swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &swiglu_bwd_cpu);
}

}  // namespace ckpt_ext
