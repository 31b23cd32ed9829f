// C++ autograd Functions of the block ops: the attention sublayer, the MLP sublayer and the
// whole LLaMA decoder layer, each with the presets of DESIGN.md:
//
//   preset       forward saves (besides inputs and weights)   backward recomputes
//   fast         q, k, v (post-RoPE), out, lse, h, gate, up   norms, SwiGLU product, softmax tiles
//   balanced     out, lse, h                                  + q/k/v and RoPE, gate/up tile-wise
//   min_memory   nothing                                      + attention forward and o_proj
//
// (h = x + attention output, the MLP sublayer's input; the sublayer Functions save the part
// of that list that belongs to them.) Forward and backward call only the kernel ops
// (torch.ops.ckpt_ext.*_fwd/_bwd) and ATen linear algebra through the dispatcher, below
// autograd, so the same code runs on the CPU reference ops and on the Triton/CUDA kernels.
//
// Shapes: x, h (B, S, H); q (B, Hq, S, D); k, v (B, Hkv, S, D); out (B, Hq, S, D);
// lse (B, Hq, S) fp32; gate, up (B*S, I); weights in nn.Linear layout.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace ckpt_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// ---- kernel ops, called through the dispatcher ---------------------------------------------

template <class Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

T2 attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const OptTensor& mask, double scale) {
  static auto op = op_handle<T2(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, std::optional<int64_t>,
                                bool, double)>("ckpt_ext::attention_fwd");
  return op.call(q, k, v, mask, /*segment_ids=*/std::nullopt, /*window=*/std::nullopt,
                 /*causal=*/true, scale);
}

T3 attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 const OptTensor& mask, double scale) {
  static auto op = op_handle<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, std::optional<int64_t>,
                                bool, double)>("ckpt_ext::attention_bwd");
  return op.call(dout, q, k, v, out, lse, mask, /*segment_ids=*/std::nullopt,
                 /*window=*/std::nullopt, /*causal=*/true, scale);
}

T3 swiglu_fwd(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
              const at::Tensor& wd, const OptTensor& bg, const OptTensor& bu,
              const OptTensor& bd, bool return_gate_up) {
  static auto op = op_handle<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, bool)>("ckpt_ext::swiglu_fwd");
  return op.call(x, wg, wu, wd, bg, bu, bd, return_gate_up);
}

using T7 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                      at::Tensor>;
T7 swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& wg,
              const at::Tensor& wu, const at::Tensor& wd, const OptTensor& bg,
              const OptTensor& bu, const OptTensor& bd, const OptTensor& gate,
              const OptTensor& up) {
  static auto op = op_handle<T7(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&)>("ckpt_ext::swiglu_bwd");
  return op.call(dy, x, wg, wu, wd, bg, bu, bd, gate, up);
}

at::Tensor rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(
      "ckpt_ext::rms_norm_fwd");
  return op.call(x, w, eps);
}

T2 rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto op =
      op_handle<T2(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "ckpt_ext::rms_norm_bwd");
  return op.call(dy, x, w, eps);
}

using RopeSig = T2(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);

T2 rope_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
            const at::Tensor& sin) {
  static auto op = op_handle<RopeSig>("ckpt_ext::rope_fwd");
  return op.call(q, k, cos, sin);
}

T2 rope_bwd(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& cos,
            const at::Tensor& sin) {
  static auto op = op_handle<RopeSig>("ckpt_ext::rope_bwd");
  return op.call(dq, dk, cos, sin);
}

// ---- presets -------------------------------------------------------------------------------

enum class Preset : int64_t { kFast = 0, kBalanced = 1, kMinMemory = 2 };

Preset parse_preset(c10::string_view name, const char* op) {
  if (name == "fast") return Preset::kFast;
  if (name == "balanced") return Preset::kBalanced;
  if (name == "min_memory") return Preset::kMinMemory;
  TORCH_CHECK(false, op, ": preset must be one of 'fast', 'balanced', 'min_memory', got '",
              std::string(name), "'");
}

// ---- linear algebra helpers ----------------------------------------------------------------

// Gradients of y = inp @ w^T + b for a given dy; inp (..., in), dy (..., out).
struct LinearGrads {
  at::Tensor dw, db;
};

LinearGrads linear_weight_grads(const at::Tensor& dy2, const at::Tensor& inp2, bool has_bias) {
  return {dy2.t().mm(inp2), has_bias ? dy2.sum(0) : at::Tensor()};
}

at::Tensor flat2(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

at::Tensor grad_or_none(const at::Tensor& g, const OptTensor& param) {
  return param.has_value() && param->defined() ? g : at::Tensor();
}

// ---- attention sublayer --------------------------------------------------------------------

struct AttnArgs {
  at::Tensor norm_w, wq, wk, wv, wo;
  OptTensor bq, bk, bv, bo, qn, kn;
  at::Tensor cos, sin;
  OptTensor mask;
  int64_t hq, hkv;
  double eps, scale;

  int64_t head_dim() const { return wq.size(0) / hq; }
  bool qk_norm() const { return qn.has_value() || kn.has_value(); }
};

void check_attention_args(const char* op, const at::Tensor& x, const AttnArgs& a) {
  TORCH_CHECK(x.dim() == 3, op, ": x must be (B, S, H), got shape ", x.sizes());
  TORCH_CHECK(x.size(0) > 0, op, ": x has an empty batch (B = 0)");
  TORCH_CHECK(a.hq > 0 && a.hkv > 0, op, ": num_heads and num_kv_heads must be positive, got ",
              a.hq, " and ", a.hkv);
  TORCH_CHECK(a.hq % a.hkv == 0, op, ": num_kv_heads must divide num_heads=", a.hq, ", got ",
              a.hkv);
  TORCH_CHECK(a.wq.dim() == 2 && a.wq.size(0) % a.hq == 0, op,
              ": w_q must be (num_heads * head_dim, H) with num_heads=", a.hq, ", got shape ",
              a.wq.sizes());
  const int64_t d = a.head_dim(), h = x.size(2);
  TORCH_CHECK(a.norm_w.dim() == 1 && a.norm_w.size(0) == h, op, ": norm_weight must be (",
              h, ",) to match x's hidden size, got ", a.norm_w.sizes());
  TORCH_CHECK(a.wq.size(1) == h, op, ": w_q must be (", a.hq * d, ", ", h, "), got ",
              a.wq.sizes());
  TORCH_CHECK(a.wk.dim() == 2 && a.wk.size(0) == a.hkv * d && a.wk.size(1) == h, op,
              ": w_k must be (num_kv_heads * head_dim, H) = (", a.hkv * d, ", ", h, "), got ",
              a.wk.sizes());
  TORCH_CHECK(a.wv.dim() == 2 && a.wv.size(0) == a.hkv * d && a.wv.size(1) == h, op,
              ": w_v must be (", a.hkv * d, ", ", h, "), got ", a.wv.sizes());
  TORCH_CHECK(a.wo.dim() == 2 && a.wo.size(0) == h && a.wo.size(1) == a.hq * d, op,
              ": w_o must be (", h, ", ", a.hq * d, "), got ", a.wo.sizes());
  TORCH_CHECK(!a.cos.requires_grad() && !a.sin.requires_grad(), op,
              ": gradients with respect to cos/sin are not computed; pass position "
              "embeddings that do not require grad (detach them)");
}

// q/k/v for attention from the sublayer input. q_lin/k_lin: (B, S, H*, D) projections before
// the optional per-head q/k norms; q, k: (B, H*, S, D) after norms and RoPE; v: a (B, Hkv, S, D)
// view of its projection.
struct Projected {
  at::Tensor n, q_lin, k_lin, q, k, v;
};

Projected project(const at::Tensor& x, const AttnArgs& a) {
  const int64_t b = x.size(0), s = x.size(1), d = a.head_dim();
  Projected p;
  p.n = rms_norm_fwd(x, a.norm_w, a.eps);
  p.q_lin = at::linear(p.n, a.wq, a.bq).view({b, s, a.hq, d});
  p.k_lin = at::linear(p.n, a.wk, a.bk).view({b, s, a.hkv, d});
  p.v = at::linear(p.n, a.wv, a.bv).view({b, s, a.hkv, d}).transpose(1, 2);
  const at::Tensor qh = a.qn ? rms_norm_fwd(p.q_lin, *a.qn, a.eps) : p.q_lin;
  const at::Tensor kh = a.kn ? rms_norm_fwd(p.k_lin, *a.kn, a.eps) : p.k_lin;
  std::tie(p.q, p.k) = rope_fwd(qh.transpose(1, 2), kh.transpose(1, 2), a.cos, a.sin);
  return p;
}

// (B, Hq, S, D) -> (B, S, Hq * D)
at::Tensor merge_heads(const at::Tensor& out) {
  return out.transpose(1, 2).reshape({out.size(0), out.size(2), out.size(1) * out.size(3)});
}

at::Tensor attention_output(const at::Tensor& x, const at::Tensor& out, const AttnArgs& a) {
  return x + at::linear(merge_heads(out), a.wo, a.bo);
}

// What an attention backward may find saved; undefined members are recomputed.
struct AttnSaved {
  at::Tensor q, k, v, out, lse;
};

struct AttnForward {
  AttnSaved saved;
  at::Tensor y;
};

AttnForward attention_forward(const at::Tensor& x, const AttnArgs& a) {
  Projected p = project(x, a);
  auto [out, lse] = attention_fwd(p.q, p.k, p.v, a.mask, a.scale);
  at::Tensor y = attention_output(x, out, a);
  return {{p.q, p.k, p.v, out, lse}, y};
}

// Gradients of the attention sublayer, in the order of its tensor arguments.
struct AttnGrads {
  at::Tensor dx, dnorm_w, dwq, dwk, dwv, dwo, dbq, dbk, dbv, dbo, dqn, dkn;
};

AttnGrads attention_backward(const at::Tensor& dy, const at::Tensor& x, const AttnArgs& a,
                             AttnSaved s) {
  const int64_t b = x.size(0), sl = x.size(1), d = a.head_dim();
  // Recompute what the preset did not keep. The norm is always recomputed; the projections
  // when q/k/v were not kept, or when the per-head q/k norms need their inputs.
  Projected p;
  if (!s.q.defined() || a.qk_norm()) {
    p = project(x, a);
    if (!s.q.defined()) s = {p.q, p.k, p.v, s.out, s.lse};
  } else {
    p.n = rms_norm_fwd(x, a.norm_w, a.eps);
  }
  if (!s.out.defined()) std::tie(s.out, s.lse) = attention_fwd(s.q, s.k, s.v, a.mask, a.scale);

  AttnGrads g;
  const at::Tensor dy2 = flat2(dy);
  auto go = linear_weight_grads(dy2, flat2(merge_heads(s.out)), a.bo.has_value());
  g.dwo = go.dw;
  g.dbo = go.db;
  const at::Tensor dout = dy.matmul(a.wo).view({b, sl, a.hq, d}).transpose(1, 2);
  auto [dq, dk, dv] = attention_bwd(dout, s.q, s.k, s.v, s.out, s.lse, a.mask, a.scale);
  auto [dqh, dkh] = rope_bwd(dq, dk, a.cos, a.sin);
  at::Tensor dq_lin = dqh.transpose(1, 2), dk_lin = dkh.transpose(1, 2);  // (B, S, H*, D)
  if (a.qn) std::tie(dq_lin, g.dqn) = rms_norm_bwd(dq_lin, p.q_lin, *a.qn, a.eps);
  if (a.kn) std::tie(dk_lin, g.dkn) = rms_norm_bwd(dk_lin, p.k_lin, *a.kn, a.eps);
  const at::Tensor dq2 = dq_lin.reshape({b * sl, a.hq * d});
  const at::Tensor dk2 = dk_lin.reshape({b * sl, a.hkv * d});
  const at::Tensor dv2 = dv.transpose(1, 2).reshape({b * sl, a.hkv * d});
  const at::Tensor n2 = flat2(p.n);
  auto gq = linear_weight_grads(dq2, n2, a.bq.has_value());
  auto gk = linear_weight_grads(dk2, n2, a.bk.has_value());
  auto gv = linear_weight_grads(dv2, n2, a.bv.has_value());
  std::tie(g.dwq, g.dbq, g.dwk, g.dbk, g.dwv, g.dbv) =
      std::make_tuple(gq.dw, gq.db, gk.dw, gk.db, gv.dw, gv.db);
  const at::Tensor dn = (dq2.mm(a.wq) + dk2.mm(a.wk) + dv2.mm(a.wv)).view(x.sizes());
  auto [dxn, dnorm_w] = rms_norm_bwd(dn, x, a.norm_w, a.eps);
  g.dx = dy + dxn;
  g.dnorm_w = dnorm_w;
  return g;
}

// ---- MLP sublayer --------------------------------------------------------------------------

struct MlpArgs {
  at::Tensor norm_w, wg, wu, wd;
  OptTensor bg, bu, bd;
  double eps;
};

void check_mlp_args(const char* op, const at::Tensor& h, const MlpArgs& m) {
  TORCH_CHECK(h.dim() == 3, op, ": the MLP input must be (B, S, H), got shape ", h.sizes());
  TORCH_CHECK(h.size(0) > 0, op, ": the MLP input has an empty batch (B = 0)");
  TORCH_CHECK(m.norm_w.dim() == 1 && m.norm_w.size(0) == h.size(2), op,
              ": the MLP norm weight must be (", h.size(2), ",), got ", m.norm_w.sizes());
}

struct MlpForward {
  at::Tensor y, gate, up;
};

MlpForward mlp_forward(const at::Tensor& h, const MlpArgs& m, bool keep_gate_up) {
  const at::Tensor n2 = flat2(rms_norm_fwd(h, m.norm_w, m.eps));
  auto [y2, gate, up] = swiglu_fwd(n2, m.wg, m.wu, m.wd, m.bg, m.bu, m.bd, keep_gate_up);
  return {h + y2.view(h.sizes()), gate, up};
}

struct MlpGrads {
  at::Tensor dh, dnorm_w, dwg, dwu, dwd, dbg, dbu, dbd;
};

MlpGrads mlp_backward(const at::Tensor& dy, const at::Tensor& h, const MlpArgs& m,
                      const at::Tensor& gate, const at::Tensor& up) {
  const at::Tensor n2 = flat2(rms_norm_fwd(h, m.norm_w, m.eps));
  OptTensor g_opt, u_opt;
  if (gate.defined()) g_opt = gate, u_opt = up;
  auto [dn2, dwg, dwu, dwd, dbg, dbu, dbd] =
      swiglu_bwd(flat2(dy), n2, m.wg, m.wu, m.wd, m.bg, m.bu, m.bd, g_opt, u_opt);
  auto [dhn, dnorm_w] = rms_norm_bwd(dn2.view(h.sizes()), h, m.norm_w, m.eps);
  return {dy + dhn, dnorm_w, dwg, dwu, dwd,
          grad_or_none(dbg, m.bg), grad_or_none(dbu, m.bu), grad_or_none(dbd, m.bd)};
}

// ---- saving helpers ------------------------------------------------------------------------

at::Tensor opt(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
OptTensor as_opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Saved-tensor layout of the attention arguments: 15 tensors.
variable_list attn_tensors(const at::Tensor& x, const AttnArgs& a) {
  return {x,   a.norm_w,  a.wq,     a.wk,     a.wv,  a.wo,  opt(a.bq),  opt(a.bk),
          opt(a.bv), opt(a.bo), opt(a.qn), opt(a.kn), a.cos, a.sin, opt(a.mask)};
}

AttnArgs attn_from_saved(const variable_list& t, AutogradContext* ctx) {
  return {t[1],        t[2],        t[3],        t[4],        t[5],
          as_opt(t[6]), as_opt(t[7]), as_opt(t[8]), as_opt(t[9]), as_opt(t[10]),
          as_opt(t[11]), t[12],      t[13],       as_opt(t[14]),
          ctx->saved_data["hq"].toInt(), ctx->saved_data["hkv"].toInt(),
          ctx->saved_data["eps"].toDouble(), ctx->saved_data["scale"].toDouble()};
}

void save_attn_scalars(AutogradContext* ctx, const AttnArgs& a) {
  ctx->saved_data["hq"] = a.hq;
  ctx->saved_data["hkv"] = a.hkv;
  ctx->saved_data["eps"] = a.eps;
  ctx->saved_data["scale"] = a.scale;
}

variable_list attn_grads_list(const AttnGrads& g) {
  // one per attention tensor argument, then cos, sin, mask (no gradient)
  return {g.dx,  g.dnorm_w, g.dwq, g.dwk, g.dwv, g.dwo,      g.dbq,     g.dbk,
          g.dbv, g.dbo,     g.dqn, g.dkn, at::Tensor(), at::Tensor(), at::Tensor()};
}

void no_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": double backward (create_graph=True) through a fused block is not supported; "
              "use policy='none' or 'torch' for higher-order gradients");
}

// ---- the Functions -------------------------------------------------------------------------

struct AttentionBlockFn : public torch::autograd::Function<AttentionBlockFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& norm_w, const at::Tensor& wq,
                               const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo,
                               const OptTensor& bq, const OptTensor& bk, const OptTensor& bv,
                               const OptTensor& bo, const OptTensor& qn, const OptTensor& kn,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const OptTensor& mask, int64_t hq, int64_t hkv, double eps,
                               double scale, Preset preset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AttnArgs a{norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask,
                     hq,     hkv, eps, scale};
    AttnForward f = attention_forward(x, a);
    variable_list to_save = attn_tensors(x, a);
    if (preset == Preset::kFast) {
      to_save.insert(to_save.end(), {f.saved.q, f.saved.k, f.saved.v, f.saved.out, f.saved.lse});
    } else if (preset == Preset::kBalanced) {
      to_save.insert(to_save.end(), {at::Tensor(), at::Tensor(), at::Tensor(), f.saved.out,
                                     f.saved.lse});
    } else {
      to_save.insert(to_save.end(), 5, at::Tensor());
    }
    ctx->save_for_backward(to_save);
    save_attn_scalars(ctx, a);
    return {f.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    no_double_backward("attention_block");
    const variable_list t = ctx->get_saved_variables();
    // Only now: unpacking may run an outer checkpoint's recomputation, which needs autograd.
    at::AutoDispatchBelowADInplaceOrView guard;  // straight to the kernels, no autograd
    const AttnArgs a = attn_from_saved(t, ctx);
    AttnGrads g = attention_backward(grad_outputs[0], t[0], a, {t[15], t[16], t[17], t[18], t[19]});
    variable_list grads = attn_grads_list(g);
    grads.resize(grads.size() + 5);  // hq, hkv, eps, scale, preset
    return grads;
  }
};

struct MlpBlockFn : public torch::autograd::Function<MlpBlockFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& h,
                               const at::Tensor& norm_w, const at::Tensor& wg,
                               const at::Tensor& wu, const at::Tensor& wd, const OptTensor& bg,
                               const OptTensor& bu, const OptTensor& bd, double eps,
                               Preset preset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const MlpArgs m{norm_w, wg, wu, wd, bg, bu, bd, eps};
    MlpForward f = mlp_forward(h, m, preset == Preset::kFast);
    ctx->save_for_backward({h, norm_w, wg, wu, wd, opt(bg), opt(bu), opt(bd), f.gate, f.up});
    ctx->saved_data["eps"] = eps;
    return {f.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    no_double_backward("mlp_block");
    const variable_list t = ctx->get_saved_variables();
    // Only now: unpacking may run an outer checkpoint's recomputation, which needs autograd.
    at::AutoDispatchBelowADInplaceOrView guard;  // straight to the kernels, no autograd
    const MlpArgs m{t[1], t[2], t[3], t[4], as_opt(t[5]), as_opt(t[6]), as_opt(t[7]),
                    ctx->saved_data["eps"].toDouble()};
    MlpGrads g = mlp_backward(grad_outputs[0], t[0], m, t[8], t[9]);
    return {g.dh, g.dnorm_w, g.dwg, g.dwu, g.dwd, g.dbg, g.dbu, g.dbd, at::Tensor(),
            at::Tensor()};
  }
};

struct DecoderLayerFn : public torch::autograd::Function<DecoderLayerFn> {
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& x, const at::Tensor& in_norm_w,
      const at::Tensor& wq, const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo,
      const OptTensor& bq, const OptTensor& bk, const OptTensor& bv, const OptTensor& bo,
      const OptTensor& qn, const OptTensor& kn, const at::Tensor& cos, const at::Tensor& sin,
      const OptTensor& mask, const at::Tensor& post_norm_w, const at::Tensor& wg,
      const at::Tensor& wu, const at::Tensor& wd, const OptTensor& bg, const OptTensor& bu,
      const OptTensor& bd, int64_t hq, int64_t hkv, double eps, double scale, Preset preset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const AttnArgs a{in_norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask,
                     hq,        hkv, eps, scale};
    const MlpArgs m{post_norm_w, wg, wu, wd, bg, bu, bd, eps};
    AttnForward fa = attention_forward(x, a);
    MlpForward fm = mlp_forward(fa.y, m, preset == Preset::kFast);
    variable_list to_save = attn_tensors(x, a);
    to_save.insert(to_save.end(), {post_norm_w, wg, wu, wd, opt(bg), opt(bu), opt(bd)});
    const at::Tensor none;
    switch (preset) {
      case Preset::kFast:
        to_save.insert(to_save.end(), {fa.saved.q, fa.saved.k, fa.saved.v, fa.saved.out,
                                       fa.saved.lse, fa.y, fm.gate, fm.up});
        break;
      case Preset::kBalanced:
        to_save.insert(to_save.end(),
                       {none, none, none, fa.saved.out, fa.saved.lse, fa.y, none, none});
        break;
      case Preset::kMinMemory:
        to_save.insert(to_save.end(), 8, none);
        break;
    }
    ctx->save_for_backward(to_save);
    save_attn_scalars(ctx, a);
    return {fm.y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    no_double_backward("decoder_layer");
    const variable_list t = ctx->get_saved_variables();
    // Only now: unpacking may run an outer checkpoint's recomputation, which needs autograd.
    at::AutoDispatchBelowADInplaceOrView guard;  // straight to the kernels, no autograd
    const at::Tensor& x = t[0];
    const AttnArgs a = attn_from_saved(t, ctx);
    const MlpArgs m{t[15], t[16], t[17], t[18], as_opt(t[19]), as_opt(t[20]), as_opt(t[21]), a.eps};
    AttnSaved s{t[22], t[23], t[24], t[25], t[26]};
    at::Tensor h = t[27];
    if (!h.defined()) {  // min_memory: rebuild the MLP input, keeping what it took
      AttnForward f = attention_forward(x, a);
      s = f.saved;
      h = f.y;
    }
    MlpGrads gm = mlp_backward(grad_outputs[0], h, m, t[28], t[29]);
    h = at::Tensor();
    AttnGrads ga = attention_backward(gm.dh, x, a, s);
    variable_list grads = attn_grads_list(ga);
    grads.insert(grads.end(), {gm.dnorm_w, gm.dwg, gm.dwu, gm.dwd, gm.dbg, gm.dbu, gm.dbd});
    grads.resize(grads.size() + 5);  // hq, hkv, eps, scale, preset
    return grads;
  }
};

// ---- dispatcher entry points ---------------------------------------------------------------

at::Tensor attention_block_autograd(
    const at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& wv, const at::Tensor& wo, const OptTensor& bq, const OptTensor& bk,
    const OptTensor& bv, const OptTensor& bo, const OptTensor& qn, const OptTensor& kn,
    const at::Tensor& cos, const at::Tensor& sin, const OptTensor& mask, int64_t hq,
    int64_t hkv, double eps, double scale, c10::string_view preset) {
  const Preset p = parse_preset(preset, "attention_block");
  const AttnArgs a{norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask,
                   hq,     hkv, eps, scale};
  check_attention_args("attention_block", x, a);
  return AttentionBlockFn::apply(x, norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin,
                                 mask, hq, hkv, eps, scale, p)[0];
}

at::Tensor attention_block_plain(
    const at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& wv, const at::Tensor& wo, const OptTensor& bq, const OptTensor& bk,
    const OptTensor& bv, const OptTensor& bo, const OptTensor& qn, const OptTensor& kn,
    const at::Tensor& cos, const at::Tensor& sin, const OptTensor& mask, int64_t hq,
    int64_t hkv, double eps, double scale, c10::string_view preset) {
  parse_preset(preset, "attention_block");
  const AttnArgs a{norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask,
                   hq,     hkv, eps, scale};
  check_attention_args("attention_block", x, a);
  return attention_forward(x, a).y;
}

at::Tensor mlp_block_autograd(const at::Tensor& h, const at::Tensor& norm_w,
                              const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                              const OptTensor& bg, const OptTensor& bu, const OptTensor& bd,
                              double eps, c10::string_view preset) {
  const Preset p = parse_preset(preset, "mlp_block");
  check_mlp_args("mlp_block", h, {norm_w, wg, wu, wd, bg, bu, bd, eps});
  return MlpBlockFn::apply(h, norm_w, wg, wu, wd, bg, bu, bd, eps, p)[0];
}

at::Tensor mlp_block_plain(const at::Tensor& h, const at::Tensor& norm_w, const at::Tensor& wg,
                           const at::Tensor& wu, const at::Tensor& wd, const OptTensor& bg,
                           const OptTensor& bu, const OptTensor& bd, double eps,
                           c10::string_view preset) {
  parse_preset(preset, "mlp_block");
  const MlpArgs m{norm_w, wg, wu, wd, bg, bu, bd, eps};
  check_mlp_args("mlp_block", h, m);
  return mlp_forward(h, m, /*keep_gate_up=*/false).y;
}

at::Tensor decoder_layer_autograd(
    const at::Tensor& x, const at::Tensor& in_norm_w, const at::Tensor& wq,
    const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo, const OptTensor& bq,
    const OptTensor& bk, const OptTensor& bv, const OptTensor& bo, const OptTensor& qn,
    const OptTensor& kn, const at::Tensor& cos, const at::Tensor& sin, const OptTensor& mask,
    const at::Tensor& post_norm_w, const at::Tensor& wg, const at::Tensor& wu,
    const at::Tensor& wd, const OptTensor& bg, const OptTensor& bu, const OptTensor& bd,
    int64_t hq, int64_t hkv, double eps, double scale, c10::string_view preset) {
  const Preset p = parse_preset(preset, "decoder_layer");
  check_attention_args("decoder_layer", x,
                       {in_norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask, hq,
                        hkv, eps, scale});
  check_mlp_args("decoder_layer", x, {post_norm_w, wg, wu, wd, bg, bu, bd, eps});
  return DecoderLayerFn::apply(x, in_norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin,
                               mask, post_norm_w, wg, wu, wd, bg, bu, bd, hq, hkv, eps, scale,
                               p)[0];
}

at::Tensor decoder_layer_plain(
    const at::Tensor& x, const at::Tensor& in_norm_w, const at::Tensor& wq,
    const at::Tensor& wk, const at::Tensor& wv, const at::Tensor& wo, const OptTensor& bq,
    const OptTensor& bk, const OptTensor& bv, const OptTensor& bo, const OptTensor& qn,
    const OptTensor& kn, const at::Tensor& cos, const at::Tensor& sin, const OptTensor& mask,
    const at::Tensor& post_norm_w, const at::Tensor& wg, const at::Tensor& wu,
    const at::Tensor& wd, const OptTensor& bg, const OptTensor& bu, const OptTensor& bd,
    int64_t hq, int64_t hkv, double eps, double scale, c10::string_view preset) {
  parse_preset(preset, "decoder_layer");
  const AttnArgs a{in_norm_w, wq, wk, wv, wo, bq, bk, bv, bo, qn, kn, cos, sin, mask,
                   hq,        hkv, eps, scale};
  const MlpArgs m{post_norm_w, wg, wu, wd, bg, bu, bd, eps};
  check_attention_args("decoder_layer", x, a);
  check_mlp_args("decoder_layer", x, m);
  return mlp_forward(attention_forward(x, a).y, m, /*keep_gate_up=*/false).y;
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, Autograd, m) {
  m.impl("attention_block", attention_block_autograd);
  m.impl("mlp_block", mlp_block_autograd);
  m.impl("decoder_layer", decoder_layer_autograd);
}

// Below autograd (no_grad, inference tensors): the forward alone, nothing saved.
TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) {
  m.impl("attention_block", attention_block_plain);
  m.impl("mlp_block", mlp_block_plain);
  m.impl("decoder_layer", decoder_layer_plain);
}

}  // namespace ckpt_ext
