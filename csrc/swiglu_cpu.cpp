// CPU (ATen) implementation of swiglu_fwd / swiglu_bwd, the reference of the Triton kernels.
//
//   gate = x Wg^T + bg + s_g (x Ag^T) Bg^T,  up = x Wu^T + bu + s_u (x Au^T) Bu^T   (T, I)
//   h    = act(gate) * up                                                         (T, I)
//   y    = h Wd^T + bd + s_d (h Ad^T) Bd^T                                        (T, H)
//
// act: silu (activation="silu", SwiGLU) or gelu(approximate="tanh") ("gelu_tanh", GeGLU),
// csrc/activation.h; ATen's silu / gelu and their backward kernels.
//
// Shapes: x (T, H); w_gate, w_up (I, H); w_down (H, I) (nn.Linear layout); b_gate, b_up (I,);
// b_down (H,); all of x's dtype and device. LoRA adapters (optional, per projection) A (r, in),
// B (out, r) in any float dtype on x's device. T = 0 is allowed (empty results of the right
// shapes; the requested weight gradients are then zeros).
//
// Memory: tokens are processed in chunks whose transient (rows, I) intermediates (gate, up,
// act, h, dh, dgate/dup: four in forward, six in backward, two fewer where gate/up are
// outputs or given) together fit the byte cap CKPT_EXT_CHUNK_BYTES (csrc/chunking.h; 64 MiB
// by default, counted at the compute dtype's width; at least one row), so they stay bounded
// whatever T is; only the outputs (and gate/up when they are requested or given) are (T, I).
//
// Precision: the base matmuls run in the input dtype (ATen's CPU matmuls accumulate float16 /
// bfloat16 products in float32); the pointwise SwiGLU math runs in float32 (float64 for
// float64) and is rounded once to the input dtype; weight and bias gradients are accumulated
// over token chunks in float32 (float64) and rounded once (see TnSum).
// LoRA: the low-rank terms run in the "LoRA dtype", float32 (float64 when x or the adapter is
// float64), from x / h converted to it (as PEFT does for float32 adapters on a half base). For
// gate/up the term is added to the base product before the activation, which then sees the
// unrounded sum (the stored gate/up of return_gate_up are the rounded sums, and h is then
// computed from them, as the backward will). For down the base product is rounded to x's dtype
// by its matmul and the term is added in the LoRA dtype, rounded once more (PEFT's order). The
// adapter gradients are accumulated over chunks in the LoRA dtype, from the unrounded
// dgate/dup, and returned in the adapter's dtype. LoRA dropout (lora_dropout > 0) masks the
// adapter's input after its conversion to the LoRA dtype (PEFT's order); backward regenerates
// the mask from dropout_seed (csrc/lora_dropout.h) and masks the input gradient's LoRA part
// with it.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "activation.h"
#include "checks.h"
#include "chunking.h"
#include "lora_dropout.h"

namespace ckpt_ext {
namespace {

using checks::check_defined;
using checks::check_dim;
using checks::check_floating;
using checks::check_like;

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

// ---- LoRA adapters -------------------------------------------------------------------------

enum LoraProj { kLGate = 0, kLUp = 1, kLDown = 2 };
constexpr const char* kLoraNames[6] = {"A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down"};

// One projection's adapter, its tensors converted to the LoRA dtype `dt`.
struct Adapter {
  bool on = false;
  at::Tensor a, b;  // (r, in), (out, r) in dt
  double s = 0.0;
  double p = 0.0;                     // dropout probability of the adapter's input
  uint32_t key = 0;                   // its dropout key (stream 4, 5, 6, or dropout_streams)
  int64_t row0 = 0;                   // the global row of x's first row (dropout_row_offset)
  at::ScalarType dt = at::kFloat;     // LoRA (compute) dtype
  at::ScalarType own = at::kFloat;    // the adapter's own dtype (of its gradients)
};
using Adapters = std::array<Adapter, 3>;

// Validates `lora` / `lora_scaling` / `lora_dropout` / `dropout_seed` (see
// csrc/ckpt_ext.cpp) and converts the adapters.
Adapters parse_lora(const char* op, const c10::List<std::optional<at::Tensor>>& lora,
                    c10::ArrayRef<double> scaling, c10::ArrayRef<double> dropout,
                    const std::optional<at::Tensor>& seed, int64_t row_offset,
                    const at::Tensor& x, const SwigluDims& d, c10::ArrayRef<int64_t> streams) {
  Adapters ad;
  CKPT_CHECK_VALUE(row_offset >= 0, op, "dropout_row_offset must be >= 0, got ", row_offset);
  CKPT_CHECK_VALUE(streams.empty() || streams.size() == 3, op,
                   "dropout_streams must be [] or have 3 entries (gate, up, down), got ",
                   streams.size());
  CKPT_CHECK_VALUE(lora.size() == 0 || lora.size() == 6, op,
                   "lora must be [] or the 6 entries [A_gate, B_gate, A_up, B_up, A_down, "
                   "B_down], got ", lora.size(), " entries");
  CKPT_CHECK_VALUE(scaling.size() == (lora.size() == 0 ? 0u : 3u), op,
                   "lora_scaling must have 3 entries (gate, up, down) with adapters and none "
                   "without, got ", scaling.size(), " for ", lora.size(), " lora entries");
  CKPT_CHECK_VALUE(dropout.size() == 0 || dropout.size() == scaling.size(), op,
                   "lora_dropout must be [] or have 3 entries (gate, up, down) with adapters, "
                   "got ", dropout.size(), " for ", lora.size(), " lora entries");
  if (lora.size() == 0) return ad;
  const int64_t ins[3] = {d.H, d.H, d.I}, outs[3] = {d.I, d.I, d.H};
  for (int p = 0; p < 3; ++p) {
    const std::optional<at::Tensor> a = lora.get(2 * p), b = lora.get(2 * p + 1);
    const bool ha = a.has_value() && a->defined(), hb = b.has_value() && b->defined();
    const char* an = kLoraNames[2 * p];
    const char* bn = kLoraNames[2 * p + 1];
    CKPT_CHECK_VALUE(ha == hb, op, "lora ", an, " and ", bn, " come together, got ", an, " ",
                     ha ? "given" : "None", " and ", bn, " ", hb ? "given" : "None");
    if (!ha) continue;
    check_dim(op, an, *a, 2, "(r, in)");
    check_floating(op, an, *a);
    checks::check_device_as(op, an, *a, "x", x);
    const int64_t r = a->size(0);
    CKPT_CHECK_VALUE(r >= 1, op, an, " must have rank r >= 1, got shape ",
                     checks::shape_str(a->sizes()));
    checks::check_shape(op, an, *a, {r, ins[p]}, "(r, in) with in = " + std::to_string(ins[p]));
    checks::check_shape(op, bn, *b, {outs[p], r},
                        "(out, r) with out = " + std::to_string(outs[p]) + " and r from " + an);
    checks::check_dtype_as(op, bn, *b, an, *a);
    checks::check_device_as(op, bn, *b, "x", x);
    CKPT_CHECK_VALUE(std::isfinite(scaling[p]), op, "lora_scaling[", p,
                     "] must be finite, got ", scaling[p]);
    Adapter& A = ad[p];
    A.on = true;
    A.own = a->scalar_type();
    A.dt = at::promote_types(checks::compute_dtype(x.scalar_type()),
                             checks::compute_dtype(A.own));
    A.a = a->to(A.dt);
    A.b = b->to(A.dt);
    A.s = scaling[p];
    if (dropout.size() != 0 && dropout[p] != 0.0) {
      dropout::check_probability(op, ("lora_dropout[" + std::to_string(p) + "]").c_str(),
                                 dropout[p]);
      CKPT_CHECK_VALUE(!checks::absent(seed), op,
                       "dropout_seed is required when lora_dropout has a probability > 0");
      A.p = dropout[p];
      A.key = dropout::key(dropout::read_seed(op, "dropout_seed", *seed),
                           streams.empty() ? 4 + p : streams[p]);
      A.row0 = row_offset;
    }
  }
  return ad;
}

// Rows per token chunk: its `buffers` (rows, I) intermediates, at the compute dtype's width,
// together within the byte cap.
int64_t chunk_rows(const SwigluDims& d, int64_t buffers, at::ScalarType cdt) {
  return chunking::swiglu_chunk_rows(d.I, buffers, static_cast<int64_t>(c10::elementSize(cdt)),
                                     chunking::chunk_bytes());
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

// The adapter's input for the token chunk starting at row0: in (tc, in) converted to the LoRA
// dtype, dropout applied (the mask of global rows A.row0 + row0 ...).
at::Tensor lora_input(const Adapter& A, const at::Tensor& in, int64_t row0) {
  const at::Tensor l = in.to(A.dt);
  return A.p > 0.0 ? dropout::apply_cpu(l, A.key, A.p, A.row0 + row0) : l;
}

// The pre-activation of gate or up for one chunk in the compute dtype `cdt` (or the adapter's
// LoRA dtype): base (tc, I) (x's dtype) plus s (xc' A^T) B^T, xc' = lora_input(xc).
at::Tensor with_lora(const at::Tensor& base, const at::Tensor& xc, const Adapter& A,
                     at::ScalarType cdt, int64_t row0) {
  if (!A.on) return base.to(cdt);
  at::Tensor xa = lora_input(A, xc, row0).mm(A.a.t());                         // (tc, r)
  return base.to(A.dt).addmm_(xa, A.b.t(), 1.0, A.s);                          // (tc, I)
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_fwd_cpu(
    const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
    const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
    const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
    const c10::List<std::optional<at::Tensor>>& lora, c10::ArrayRef<double> lora_scaling,
    bool return_gate_up, c10::ArrayRef<double> lora_dropout,
    const std::optional<at::Tensor>& dropout_seed, int64_t dropout_row_offset,
    c10::ArrayRef<int64_t> dropout_streams, c10::string_view activation) {
  const char* op = "swiglu_fwd";
  const SwigluDims d = check_swiglu(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  const Activation act = parse_activation(activation, op);
  const Adapters ad = parse_lora(op, lora, lora_scaling, lora_dropout, dropout_seed,
                                 dropout_row_offset, x, d, dropout_streams);
  const at::ScalarType dt = x.scalar_type(), cdt = checks::compute_dtype(dt);
  at::Tensor y = at::empty({d.T, d.H}, x.options());                                 // (T, H)
  at::Tensor gate = return_gate_up ? at::empty({d.T, d.I}, x.options()) : x.new_empty({0});
  at::Tensor up = return_gate_up ? at::empty({d.T, d.I}, x.options()) : x.new_empty({0});
  const int64_t step = chunk_rows(d, chunking::swiglu_buffers(false, return_gate_up), cdt);
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor xc = x.narrow(0, t0, tc);                                             // (tc, H)
    at::Tensor gc = return_gate_up ? gate.narrow(0, t0, tc) : at::empty({tc, d.I}, x.options());
    at::Tensor uc = return_gate_up ? up.narrow(0, t0, tc) : at::empty({tc, d.I}, x.options());
    linear_into(gc, xc, w_gate, b_gate);                                             // (tc, I)
    linear_into(uc, xc, w_up, b_up);                                                 // (tc, I)
    at::Tensor g = with_lora(gc, xc, ad[kLGate], cdt, t0);
    at::Tensor u = with_lora(uc, xc, ad[kLUp], cdt, t0);
    if (return_gate_up) {  // store the rounded sums; h from them, as the backward sees them
      if (ad[kLGate].on) gc.copy_(g), g = gc.to(cdt);
      if (ad[kLUp].on) uc.copy_(u), u = uc.to(cdt);
    }
    at::Tensor h = swiglu_product(g, u, dt, act);                                         // (tc, I)
    at::Tensor yc = y.narrow(0, t0, tc);
    linear_into(yc, h, w_down, b_down);                                              // (tc, H)
    const Adapter& D = ad[kLDown];
    if (D.on) {
      at::Tensor ha = lora_input(D, h, t0).mm(D.a.t());                              // (tc, r)
      yc.add_(ha.mm(D.b.t()).mul_(D.s));  // added in the LoRA dtype, rounded once
    }
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

// sum over chunks of s a_c^T b_c in the LoRA dtype (operands already in it), for an adapter
// gradient; returned in the adapter's own dtype.
struct LoraSum {
  at::Tensor sum;
  void add(const at::Tensor& a, const at::Tensor& b) {
    if (sum.defined()) {
      sum.addmm_(a.t(), b);
    } else {
      sum = at::mm(a.t(), b);
    }
  }
  // total: the gradient's sum over the caller's earlier token chunks (lora_sums): then
  // total + s sum in total's dtype.
  at::Tensor result(at::IntArrayRef shape, const Adapter& A, const at::Tensor& x,
                    const std::optional<at::Tensor>& total) const {
    if (total) return sum.defined() ? at::add(*total, sum.to(total->scalar_type()), A.s)
                                    : total->clone();
    const auto opts = x.options().dtype(A.own);
    return sum.defined() ? sum.mul(A.s).to(A.own) : at::zeros(shape, opts);
  }
};

using SwigluGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor, std::vector<at::Tensor>>;

// A weight gradient's sum over token chunks (swiglu_bwd's dw_*_sum): absent, or of the
// weight's shape, on x's device, float32 or x's dtype.
void check_grad_sum(const char* op, const char* name, const std::optional<at::Tensor>& sum,
                    const at::Tensor& x, c10::IntArrayRef shape, const char* layout) {
  if (!sum) return;
  checks::check_shape(op, name, *sum, shape, layout);
  checks::check_device_as(op, name, *sum, "x", x);
  CKPT_CHECK_TYPE(sum->scalar_type() == at::kFloat || sum->scalar_type() == x.scalar_type(),
                  op, name, " must be float32 or the dtype of x (",
                  checks::dtype_str(x.scalar_type()), "), got ",
                  checks::dtype_str(sum->scalar_type()));
}

constexpr const char* kLoraSumNames[6] = {"lora_a_gate_sum", "lora_b_gate_sum",
                                          "lora_a_up_sum",   "lora_b_up_sum",
                                          "lora_a_down_sum", "lora_b_down_sum"};

// swiglu_bwd's lora_a_gate_sum .. lora_b_down_sum: each absent or the running sum of a
// gradient the op computes (an adapter given, its needs_grad flag set), of its factor's shape,
// on x's device, float32 or float64. Returns the 6 (absent ones nullopt).
std::array<std::optional<at::Tensor>, 6> check_lora_sums(
    const char* op, const std::array<const std::optional<at::Tensor>*, 6>& sums,
    const c10::List<std::optional<at::Tensor>>& lora, const bool* n_la, const bool* n_lb,
    const at::Tensor& x) {
  std::array<std::optional<at::Tensor>, 6> out;
  for (int i = 0; i < 6; ++i) {
    const std::optional<at::Tensor>& t = *sums[i];
    if (checks::absent(t)) continue;
    const std::string name = kLoraSumNames[i];
    CKPT_CHECK_VALUE((i % 2 == 0 ? n_la : n_lb)[i / 2], op, name,
                     " is given but the op computes no gradient of ", kLoraNames[i],
                     " (no adapter there, or its needs_grad flag is false)");
    const at::Tensor& f = *lora.get(i);
    checks::check_shape(op, name.c_str(), *t, f.sizes(), "the shape of its factor");
    checks::check_device_as(op, name.c_str(), *t, "x", x);
    CKPT_CHECK_TYPE(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble, op, name,
                    " must be float32 or float64, got ", checks::dtype_str(t->scalar_type()));
    out[i] = *t;
  }
  return out;
}

SwigluGrads swiglu_bwd_cpu(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w_gate,
                           const at::Tensor& w_up, const at::Tensor& w_down,
                           const std::optional<at::Tensor>& b_gate,
                           const std::optional<at::Tensor>& b_up,
                           const std::optional<at::Tensor>& b_down,
                           const c10::List<std::optional<at::Tensor>>& lora,
                           c10::ArrayRef<double> lora_scaling,
                           const std::optional<at::Tensor>& gate,
                           const std::optional<at::Tensor>& up,
                           const c10::List<bool>& needs_grad,
                           c10::ArrayRef<double> lora_dropout,
                           const std::optional<at::Tensor>& dropout_seed,
                           int64_t dropout_row_offset,
                           c10::ArrayRef<int64_t> dropout_streams,
                           c10::string_view activation,
                           const std::optional<at::Tensor>& dw_gate_sum,
                           const std::optional<at::Tensor>& dw_up_sum,
                           const std::optional<at::Tensor>& dw_down_sum, double sum_beta,
                           const std::optional<at::Tensor>& lora_a_gate_sum,
                           const std::optional<at::Tensor>& lora_b_gate_sum,
                           const std::optional<at::Tensor>& lora_a_up_sum,
                           const std::optional<at::Tensor>& lora_b_up_sum,
                           const std::optional<at::Tensor>& lora_a_down_sum,
                           const std::optional<at::Tensor>& lora_b_down_sum) {
  const char* op = "swiglu_bwd";
  const SwigluDims d = check_swiglu(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  const Activation act = parse_activation(activation, op);
  const Adapters ad = parse_lora(op, lora, lora_scaling, lora_dropout, dropout_seed,
                                 dropout_row_offset, x, d, dropout_streams);
  check_like(op, "dy", dy, "x", x, {d.T, d.H}, "(T, H), the shape of x");
  check_grad_sum(op, "dw_gate_sum", dw_gate_sum, x, {d.I, d.H}, "(I, H)");
  check_grad_sum(op, "dw_up_sum", dw_up_sum, x, {d.I, d.H}, "(I, H)");
  check_grad_sum(op, "dw_down_sum", dw_down_sum, x, {d.H, d.I}, "(H, I)");
  const bool recompute = checks::absent(gate);
  CKPT_CHECK_VALUE(recompute == checks::absent(up), op,
                   "gate and up must be given together (save=\"gate_up\") or both left out "
                   "(save=\"input\"), got gate ", recompute ? "absent" : "given", " and up ",
                   checks::absent(up) ? "absent" : "given");
  if (!recompute) {
    check_like(op, "gate", *gate, "x", x, {d.T, d.I}, "(T, I)");
    check_like(op, "up", *up, "x", x, {d.T, d.I}, "(T, I)");
  }
  CKPT_CHECK_VALUE(needs_grad.size() == 12, op,
                   "needs_grad must have 12 entries [w_gate, w_up, w_down, b_gate, b_up, "
                   "b_down, A_gate, B_gate, A_up, B_up, A_down, B_down], got ",
                   needs_grad.size());
  // What is computed: a flag set and its tensor present.
  const bool n_wg = needs_grad.get(0), n_wu = needs_grad.get(1), n_wd = needs_grad.get(2);
  const bool n_bg = needs_grad.get(3) && b_gate.has_value();
  const bool n_bu = needs_grad.get(4) && b_up.has_value();
  const bool n_bd = needs_grad.get(5) && b_down.has_value();
  bool n_la[3], n_lb[3];
  for (int p = 0; p < 3; ++p) {
    n_la[p] = ad[p].on && needs_grad.get(6 + 2 * p);
    n_lb[p] = ad[p].on && needs_grad.get(7 + 2 * p);
  }
  const Adapter &G = ad[kLGate], &U = ad[kLUp], &D = ad[kLDown];
  const auto totals = check_lora_sums(op,
                                      {&lora_a_gate_sum, &lora_b_gate_sum, &lora_a_up_sum,
                                       &lora_b_up_sum, &lora_a_down_sum, &lora_b_down_sum},
                                      lora, n_la, n_lb, x);

  const at::ScalarType dt = x.scalar_type(), cdt = checks::compute_dtype(dt);
  const auto acc_opts = x.options().dtype(cdt);
  at::Tensor dx = at::empty({d.T, d.H}, x.options());      // (T, H)
  const int64_t step = chunk_rows(d, chunking::swiglu_buffers(true, gate.has_value()), cdt);
  const bool one_chunk = d.T <= step;
  TnSum dwg(one_chunk, cdt), dwu(one_chunk, cdt), dwd(one_chunk, cdt);  // (I, H) (I, H) (H, I)
  LoraSum dla[3], dlb[3];                                  // dA (r, in), dB (out, r), unscaled
  at::Tensor dbg = at::zeros({d.I}, acc_opts);             // (I,)
  at::Tensor dbu = at::zeros({d.I}, acc_opts);             // (I,)
  for (int64_t t0 = 0; t0 < d.T; t0 += step) {
    const int64_t tc = std::min(step, d.T - t0);
    at::Tensor xc = x.narrow(0, t0, tc);                   // (tc, H)
    at::Tensor dyc = dy.narrow(0, t0, tc);                 // (tc, H)
    at::Tensor g, u;                                       // (tc, I) pre-activations, cdt
    if (recompute) {
      at::Tensor gc = at::empty({tc, d.I}, x.options());
      at::Tensor uc = at::empty({tc, d.I}, x.options());
      linear_into(gc, xc, w_gate, b_gate);
      linear_into(uc, xc, w_up, b_up);
      g = with_lora(gc, xc, G, cdt, t0);
      u = with_lora(uc, xc, U, cdt, t0);
    } else {
      g = gate->narrow(0, t0, tc).to(cdt);
      u = up->narrow(0, t0, tc).to(cdt);
    }
    // Pointwise part in the compute dtype, in few passes over (tc, I) (it is memory-bound):
    // dgate = (dh u) act'(g), ATen's fused silu_backward / gelu_backward (for silu, with
    // s = sigmoid(g): silu'(g) = s (1 + g (1 - s))); dup = dh act(g); h = act(g) u.
    // One pointwise dtype: the compute dtype, or float64 when an adapter is float64.
    at::ScalarType pdt = at::promote_types(g.scalar_type(), u.scalar_type());
    if (D.on) pdt = at::promote_types(pdt, D.dt);
    g = g.to(pdt), u = u.to(pdt);
    at::Tensor dh = at::mm(dyc, w_down).to(pdt);           // dh = dy Wd (+ LoRA)  (tc, I)
    at::Tensor dyb;                                        // dy Bd (tc, r_d), LoRA dtype
    if (D.on) {
      dyb = dyc.to(D.dt).mm(D.b);
      if (D.p > 0.0) {  // the adapter's input was masked: so is its gradient
        dh.add_(dropout::apply_cpu(dyb.mm(D.a).mul_(D.s), D.key, D.p, D.row0 + t0).to(pdt));
      } else {
        dh.addmm_(dyb.to(pdt), D.a.to(pdt), 1.0, D.s);
      }
    }
    at::Tensor a = activate(g, act);
    at::Tensor dgate_c = activate_backward(dh * u, g, act);  // (tc, I) unrounded
    at::Tensor dup_c = dh.mul_(a);                         // (tc, I) unrounded
    at::Tensor dgate = dgate_c.to(dt), dup = dup_c.to(dt);
    if (n_wd || n_la[kLDown] || n_lb[kLDown]) {
      at::Tensor h = a.mul_(u).to(dt);                     // (tc, I), as the forward fed down
      if (n_wd) dwd.add(dyc, h);                           // dWd += dy^T h
      if (n_la[kLDown] || n_lb[kLDown]) {
        const at::Tensor hl = lora_input(D, h, t0);        // h' (dropout applied)
        if (n_la[kLDown]) dla[kLDown].add(dyb, hl);        // dAd += dyb^T h'
        if (n_lb[kLDown]) dlb[kLDown].add(dyc.to(D.dt), hl.mm(D.a.t()));  // dy^T (h' Ad^T)
      }
    }
    if (n_wg) dwg.add(dgate, xc);                          // dWg += dgate^T x
    if (n_wu) dwu.add(dup, xc);                            // dWu += dup^T x
    at::Tensor dxc = dx.narrow(0, t0, tc);
    at::mm_out(dxc, dgate, w_gate);                        // dx = dgate Wg + dup Wu
    dxc.addmm_(dup, w_up);
    const std::pair<const Adapter*, const at::Tensor*> gu[2] = {{&G, &dgate_c}, {&U, &dup_c}};
    at::Tensor dxl;                                        // LoRA part of dx, (tc, H)
    for (int p = 0; p < 2; ++p) {
      const Adapter& A = *gu[p].first;
      if (!A.on) continue;
      const at::Tensor dz = gu[p].second->to(A.dt);        // dgate or dup, (tc, I)
      const at::Tensor xl = lora_input(A, xc, t0);         // x' (dropout applied)
      const at::Tensor dzb = dz.mm(A.b);                   // (tc, r)
      at::Tensor t = dzb.mm(A.a).mul_(A.s);                // s (dz B) A, masked like x'
      if (A.p > 0.0) t = dropout::apply_cpu(t, A.key, A.p, A.row0 + t0);
      dxl = dxl.defined() ? t.add_(dxl) : t;
      if (n_la[p]) dla[p].add(dzb, xl);                    // dA += (dz B)^T x'
      if (n_lb[p]) dlb[p].add(dz, xl.mm(A.a.t()));         // dB += dz^T (x' A^T)
    }
    if (dxl.defined()) dxc.add_(dxl);                      // one rounding to x's dtype
    if (n_bg) dbg.add_(dgate_c.sum(0, false, cdt));
    if (n_bu) dbu.add_(dup_c.sum(0, false, cdt));
  }
  const at::Tensor none = x.new_empty({0});
  at::Tensor dbd = n_bd ? dy.sum(0, false, cdt).to(dt) : none;
  const auto out_opts = x.options();
  std::vector<at::Tensor> dlora(6);
  const int64_t ins[3] = {d.H, d.H, d.I}, outs[3] = {d.I, d.I, d.H};
  for (int p = 0; p < 3; ++p) {
    const int64_t r = ad[p].on ? ad[p].a.size(0) : 0;
    dlora[2 * p] =
        n_la[p] ? dla[p].result({r, ins[p]}, ad[p], x, totals[2 * p]) : x.new_empty({0});
    dlora[2 * p + 1] = n_lb[p] ? dlb[p].result({outs[p], r}, ad[p], x, totals[2 * p + 1])
                               : x.new_empty({0});
  }
  // A weight gradient with a sum given comes back as sum_beta * sum + dw in the sum's dtype
  // (the CPU has no float32-out GEMM for half-precision operands: the product, then the add).
  auto into_sum = [&](at::Tensor dw, const std::optional<at::Tensor>& sum) {
    if (!sum) return dw;
    if (sum_beta == 0.0) return dw.to(sum->scalar_type());
    return sum_beta == 1.0 ? at::add(*sum, dw) : at::add(sum->mul(sum_beta), dw);
  };
  return {dx,
          n_wg ? into_sum(dwg.result({d.I, d.H}, out_opts), dw_gate_sum) : x.new_empty({0}),
          n_wu ? into_sum(dwu.result({d.I, d.H}, out_opts), dw_up_sum) : x.new_empty({0}),
          n_wd ? into_sum(dwd.result({d.H, d.I}, out_opts), dw_down_sum) : x.new_empty({0}),
          n_bg ? dbg.to(dt) : x.new_empty({0}),
          n_bu ? dbu.to(dt) : x.new_empty({0}),
          dbd,
          dlora};
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("swiglu_fwd", &swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &swiglu_bwd_cpu);
}

}  // namespace ckpt_ext
