// The fused decoder layer's math: the ops decoder_layer_fwd and decoder_layer_bwd (their
// arguments, slots and residuals: csrc/layer_spec.h). The kernels are called through the
// dispatcher (csrc/kernel_ops.h), so each runs on the backend registered for its tensors.
#include "layer_spec.h"

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "chunking.h"
#include "kernel_ops.h"
#include "lora_dropout.h"

namespace ckpt_ext {
namespace layer {
namespace {

// ---- the call ------------------------------------------------------------------------------

Layer make_layer(const c10::List<OptTensor>& weights, const LayerTensors& tensors,
                 const LayerOptions& options, const char* op) {
  CKPT_CHECK_VALUE(static_cast<int64_t>(weights.size()) == kNumSlots, op, "weights must have ",
                   kNumSlots, " slots (ckpt_ext.blocks.WEIGHT_SLOTS), got ", weights.size());
  Layer L;
  static_cast<LayerTensors&>(L) = tensors;
  static_cast<LayerOptions&>(L) = options;
#define CKPT_LAYER_ABSENT_(param, name) \
  if (checks::absent(L.name)) L.name = std::nullopt;
  CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_ABSENT_)
#undef CKPT_LAYER_ABSENT_
  L.w.reserve(kNumSlots);
  for (const OptTensor& t : weights) L.w.push_back(checks::absent(t) ? at::Tensor() : *t);
  L.part_id = parse_part(L.part, op);
  L.preset_id = parse_preset(L.preset, op);
  return L;
}

// The adapter's input of projection p, dropout applied (inp in the LoRA dtype).
at::Tensor lora_input(const Layer& L, Proj p, const at::Tensor& inp) {
  const double dp = L.dropout_p(p);
  return dp > 0.0 ? kernel::lora_dropout(inp, *L.dropout_seed, p, dp, 0) : inp;
}

// ---- validation ----------------------------------------------------------------------------

void check_weight(const char* op, const Layer& L, int64_t s, const at::Tensor& x,
                  c10::IntArrayRef shape, const std::string& why) {
  const at::Tensor& t = L.at(s);
  const std::string name = slot_name(s);
  CKPT_CHECK_VALUE(t.defined(), op, name, " is required");
  checks::check_shape(op, name.c_str(), t, shape, why);
  checks::check_device_as(op, name.c_str(), t, "x", x);
  const bool adapter = s >= kNumNorms && (s - kNumNorms) % kNumProjParts >= kLoraA;
  if (L.compute_dtype || adapter) {
    checks::check_floating(op, name.c_str(), t);
  } else {
    CKPT_CHECK_TYPE(t.scalar_type() == x.scalar_type(), op, name, " is ",
                    checks::dtype_str(t.scalar_type()), " but x is ",
                    checks::dtype_str(x.scalar_type()),
                    "; outside autocast the input and the weights must share a dtype (cast x "
                    "to the weights' dtype, or run under torch.autocast)");
  }
}

void check_proj(const char* op, const Layer& L, Proj p, const at::Tensor& x, int64_t out,
                int64_t in) {
  check_weight(op, L, slot(p, kWeight), x, {out, in}, "(out_features, in_features)");
  if (L.proj(p, kBias).defined()) check_weight(op, L, slot(p, kBias), x, {out}, "(out_features,)");
  const bool a = L.proj(p, kLoraA).defined(), b = L.proj(p, kLoraB).defined();
  CKPT_CHECK_VALUE(a == b, op, kProjNames[p], ": lora_A and lora_B come together");
  if (a) {
    const int64_t r = L.proj(p, kLoraA).size(0);
    check_weight(op, L, slot(p, kLoraA), x, {r, in}, "(rank, in_features)");
    check_weight(op, L, slot(p, kLoraB), x, {out, r}, "(out_features, rank)");
    CKPT_CHECK_VALUE(static_cast<int64_t>(L.lora_scaling.size()) == kNumProjs, op,
                     "lora_scaling must have one entry per projection (", kNumProjs,
                     ") when adapters are given, got ", L.lora_scaling.size());
  }
}

void check_dropout(const char* op, const Layer& L) {
  if (L.lora_dropout.empty()) return;
  CKPT_CHECK_VALUE(static_cast<int64_t>(L.lora_dropout.size()) == kNumProjs, op,
                   "lora_dropout must be [] or have one entry per projection (", kNumProjs,
                   "), got ", L.lora_dropout.size());
  bool any = false;
  for (int64_t p = 0; p < kNumProjs; ++p) {
    const std::string name = std::string("lora_dropout[") + std::to_string(p) + "] (" +
                             kProjNames[p] + ")";
    dropout::check_probability(op, name.c_str(), L.lora_dropout[p]);
    any = any || L.dropout_p(static_cast<Proj>(p)) > 0.0;
  }
  if (!any) return;
  CKPT_CHECK_VALUE(L.dropout_seed.has_value(), op,
                   "dropout_seed is required when lora_dropout has a probability > 0");
  dropout::read_seed(op, "dropout_seed", *L.dropout_seed);
}

void check_layer(const char* op, const at::Tensor& x, const Layer& L) {
  checks::check_defined(op, "x", x);
  checks::check_dim(op, "x", x, 3, "(B, S, H)");
  checks::check_floating(op, "x", x);
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
  if (L.compute_dtype) {
    CKPT_CHECK_TYPE(at::isFloatingType(*L.compute_dtype), op,
                    "compute_dtype must be a floating dtype, got ",
                    checks::dtype_str(*L.compute_dtype));
  }
  if (has_attention(L.part_id)) {
    CKPT_CHECK_VALUE(L.num_heads > 0 && L.num_kv_heads > 0, op,
                     "num_heads and num_kv_heads must be positive, got ", L.num_heads, " and ", L.num_kv_heads);
    CKPT_CHECK_VALUE(L.num_heads % L.num_kv_heads == 0, op, "num_kv_heads must divide num_heads=", L.num_heads,
                     ", got ", L.num_kv_heads);
    const at::Tensor& wq = L.proj(kQ);
    CKPT_CHECK_VALUE(wq.defined() && wq.dim() == 2 && wq.size(0) % L.num_heads == 0, op,
                     "self_attn.q_proj.weight must be (num_heads * head_dim, H) with num_heads=",
                     L.num_heads, ", got ", wq.defined() ? checks::shape_str(wq.sizes()) : "None");
    const int64_t d = L.head_dim();
    check_weight(op, L, slot(kInputNorm), x, {h}, "to match x's hidden size");
    check_proj(op, L, kQ, x, L.num_heads * d, h);
    check_proj(op, L, kK, x, L.num_kv_heads * d, h);
    check_proj(op, L, kV, x, L.num_kv_heads * d, h);
    check_proj(op, L, kO, x, h, L.num_heads * d);
    CKPT_CHECK_VALUE(L.qk_norm() == L.norm(kKNorm).defined(), op,
                     "self_attn.q_norm.weight and self_attn.k_norm.weight come together");
    if (L.qk_norm()) {
      check_weight(op, L, slot(kQNorm), x, {d}, "(head_dim,)");
      check_weight(op, L, slot(kKNorm), x, {d}, "(head_dim,)");
    }
    CKPT_CHECK_VALUE(L.cos && L.sin, op,
                     "position_embeddings (cos, sin) are required for the attention");
    const at::Tensor &cos = *L.cos, &sin = *L.sin;
    checks::check_dim(op, "cos", cos, 3, "(B or 1, S, head_dim)");
    CKPT_CHECK_VALUE(cos.size(0) == 1 || cos.size(0) == b, op,
                     "cos must have batch size 1 or B=", b, ", got shape ",
                     checks::shape_str(cos.sizes()));
    checks::check_shape(op, "cos", cos, {cos.size(0), s, d}, "(B or 1, S, head_dim)");
    checks::check_shape(op, "sin", sin, cos.sizes(), "(the shape of cos)");
    CKPT_CHECK_VALUE(!cos.requires_grad() && !sin.requires_grad(), op,
                     "gradients with respect to cos/sin are not computed; pass position "
                     "embeddings that do not require grad (detach them)");
    if (!L.compute_dtype) {
      CKPT_CHECK_TYPE(cos.scalar_type() == x.scalar_type(), op, "cos is ",
                      checks::dtype_str(cos.scalar_type()), " but x is ",
                      checks::dtype_str(x.scalar_type()),
                      "; outside autocast position embeddings share the input's dtype");
    }
  }
  if (has_mlp(L.part_id)) {
    const at::Tensor& wg = L.proj(kGate);
    CKPT_CHECK_VALUE(wg.defined() && wg.dim() == 2, op,
                     "mlp.gate_proj.weight must be (intermediate_size, H)");
    const int64_t i = wg.size(0);
    check_weight(op, L, slot(kPostNorm), x, {h}, "to match x's hidden size");
    check_proj(op, L, kGate, x, i, h);
    check_proj(op, L, kUp, x, i, h);
    check_proj(op, L, kDown, x, h, i);
  }
  check_dropout(op, L);
}

// ---- projections (with optional LoRA) ------------------------------------------------------

// y = inp W^T + b + scaling * (dropout(inp) A^T) B^T; inp in the compute dtype, dropout in
// the LoRA dtype (PEFT's order).
at::Tensor proj_fwd(const Layer& L, Proj p, const at::Tensor& inp) {
  at::Tensor y = at::linear(inp, L.cast(L.proj(p)), L.cast_opt(L.proj(p, kBias)));
  if (L.has_lora(p)) {
    const at::ScalarType ld = L.lora_dtype(p);
    const at::Tensor u = at::linear(lora_input(L, p, inp.to(ld)), L.proj(p, kLoraA).to(ld));
    y.add_(at::linear(u, L.proj(p, kLoraB).to(ld)).mul_(L.lora_scale(p)).to(y.scalar_type()));
  }
  return y;
}

struct Grads {
  at::Tensor dx;
  std::vector<at::Tensor> dw = std::vector<at::Tensor>(kNumSlots);
};

// The gradient of slot s, cast to the slot's dtype.
void set_grad(Grads& g, const Layer& L, int64_t s, const at::Tensor& d) {
  g.dw[s] = d.to(L.at(s).scalar_type());
}

// Backward of proj_fwd: inp2 (T, in) and dy2 (T, out) in the compute dtype; weight gradients
// only where `needs` asks for them. Returns d inp (T, in).
at::Tensor proj_bwd(const Layer& L, Proj p, const at::Tensor& dy2, const at::Tensor& inp2,
                    const std::vector<bool>& needs, Grads& g) {
  const at::Tensor w = L.cast(L.proj(p));
  at::Tensor dinp = dy2.mm(w);
  if (needs[slot(p, kWeight)]) set_grad(g, L, slot(p, kWeight), dy2.t().mm(inp2));
  if (needs[slot(p, kBias)]) set_grad(g, L, slot(p, kBias), dy2.sum(0));
  if (L.has_lora(p)) {
    const double s = L.lora_scale(p);
    const at::ScalarType ld = L.lora_dtype(p);
    const at::Tensor a = L.proj(p, kLoraA).to(ld), b = L.proj(p, kLoraB).to(ld);
    const at::Tensor dyl = dy2.to(ld), inpl = lora_input(L, p, inp2.to(ld));
    const at::Tensor dyb = dyl.mm(b);  // (T, r)
    // dropout is linear and its own adjoint: the input's gradient gets the forward's mask
    dinp.add_(lora_input(L, p, dyb.mm(a).mul_(s)).to(dinp.scalar_type()));
    if (needs[slot(p, kLoraB)]) set_grad(g, L, slot(p, kLoraB), dyl.t().mm(inpl.mm(a.t())).mul_(s));
    if (needs[slot(p, kLoraA)]) set_grad(g, L, slot(p, kLoraA), dyb.t().mm(inpl).mul_(s));
  }
  return dinp;
}

at::Tensor flat2(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// ---- residuals -----------------------------------------------------------------------------

std::vector<at::Tensor> pack(const Residuals& r, const Layer& L) {
  std::vector<at::Tensor> out;
  for (Member m : kept(L.part_id, L.preset_id)) out.push_back(r.*m);
  return out;
}

Residuals unpack(at::TensorList saved, const Layer& L, const char* op) {
  const auto members = kept(L.part_id, L.preset_id);
  CKPT_CHECK_VALUE(saved.size() == members.size(), op, "saved must hold ", members.size(),
                   " tensors for this part and preset, got ", saved.size());
  Residuals r;
  for (size_t i = 0; i < members.size(); ++i) r.*members[i] = saved[i];
  return r;
}

// ---- attention sublayer --------------------------------------------------------------------

// (B, Hq, S, D) -> (B, S, Hq * D)
at::Tensor merge_heads(const at::Tensor& out) {
  return out.transpose(1, 2).reshape({out.size(0), out.size(2), out.size(1) * out.size(3)});
}

// q/k/v from the sublayer input. n: the normed input in the compute dtype; q_lin/k_lin:
// (B, S, H*, D) projections before the optional per-head norms; q, k: (B, H*, S, D) views
// of (B, S, H*, D) memory after norms and RoPE; v: a (B, Hkv, S, D) view of its projection.
struct Projected {
  at::Tensor n, q_lin, k_lin, q, k, v;
};

Projected project(const at::Tensor& x, const Layer& L) {
  const int64_t b = x.size(0), s = x.size(1), d = L.head_dim();
  Projected p;
  p.n = L.cast(kernel::rms_norm_fwd(x, L.norm(kInputNorm), L.eps));
  p.q_lin = proj_fwd(L, kQ, p.n).view({b, s, L.num_heads, d});
  p.k_lin = proj_fwd(L, kK, p.n).view({b, s, L.num_kv_heads, d});
  p.v = proj_fwd(L, kV, p.n).view({b, s, L.num_kv_heads, d}).transpose(1, 2);
  const at::Tensor qh = L.qk_norm() ? kernel::rms_norm_fwd(p.q_lin, L.norm(kQNorm), L.eps) : p.q_lin;
  const at::Tensor kh = L.qk_norm() ? kernel::rms_norm_fwd(p.k_lin, L.norm(kKNorm), L.eps) : p.k_lin;
  // rope keeps its input's layout: q, k stay (B, H, S, D) views of (B, S, H, D) memory, the
  // layout attention reads, and their gradients come back alike (merged with views).
  std::tie(p.q, p.k) = kernel::rope_fwd(qh.transpose(1, 2), kh.transpose(1, 2), *L.cos, *L.sin);
  p.q = L.cast(p.q);
  p.k = L.cast(p.k);
  return p;
}

// ---- HF eager attention's rows with nothing to attend ---------------------------------------
// Eager attention adds the dtype's minimum to every masked score, so a query row that may
// attend no key (a left-padded position) has all scores equal: it averages every value
// uniformly (future and padded keys included) and its gradient reaches q, every k and every v.
// The attention kernels return 0 for such rows (lse = -inf); with uniform_empty_rows these
// corrections reproduce eager's result in O(S * D^2), with no host sync.

at::Tensor empty_rows(const at::Tensor& lse) {  // (B, Hq, S, 1) float, 1 on empty rows
  return at::isneginf(lse).unsqueeze(-1).to(at::kFloat);
}

at::Tensor per_query_head(const at::Tensor& t, int64_t groups) {  // (B, Hkv, ...) -> (B, Hq, ...)
  return groups == 1 ? t : t.repeat_interleave(groups, 1);
}

at::Tensor per_kv_head(const at::Tensor& t, int64_t hkv) {  // (B, Hq, S, D) summed per group
  return t.view({t.size(0), hkv, -1, t.size(2), t.size(3)}).sum(2);
}

void fix_empty_rows_forward(const Layer& L, Residuals& r) {
  const at::Tensor vmean = per_query_head(r.v.mean(2, /*keepdim=*/true), L.num_heads / L.num_kv_heads);
  at::Tensor fixed = at::empty_like(r.out);  // keeps out's (B, S, Hq, D) memory layout
  at::where_out(fixed, empty_rows(r.lse).to(at::kBool), vmean.to(r.out.scalar_type()), r.out);
  r.out = fixed;
}

void fix_empty_rows_backward(const Layer& L, const Residuals& r, const at::Tensor& dout,
                             at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t groups = L.num_heads / L.num_kv_heads, s = r.k.size(2);
  const at::Tensor d = dout.to(at::kFloat) * empty_rows(r.lse);  // (B, Hq, S, D)
  const at::Tensor q = r.q.to(at::kFloat);
  const at::Tensor k = per_query_head(r.k.to(at::kFloat), groups);
  const at::Tensor v = per_query_head(r.v.to(at::kFloat), groups);
  const at::Tensor vmean = v.mean(2, true), kmean = k.mean(2, true);
  const at::Tensor dvm = (d * vmean).sum(-1, true);                       // dout_i . vmean
  // dS_ij = (dout_i . v_j - dout_i . vmean) / S on empty rows
  const at::Tensor dq_fix = d.matmul(v.transpose(-1, -2).matmul(k)).mul_(L.scale / s)
                                .sub_(dvm * kmean * L.scale);
  const at::Tensor m = q.transpose(-1, -2).matmul(d);                     // sum_i q_i dout_i^T
  const at::Tensor c = (dvm * q).sum(2, true);                            // sum_i (dout_i . vmean) q_i
  const at::Tensor dk_fix = v.matmul(m.transpose(-1, -2)).sub_(c).mul_(L.scale / s);
  const at::Tensor dv_fix = (d.sum(2, true) / s).expand_as(v);
  dq = dq + dq_fix.to(dq.scalar_type());
  dk = dk + per_kv_head(dk_fix, L.num_kv_heads).to(dk.scalar_type());
  dv = dv + per_kv_head(dv_fix.contiguous(), L.num_kv_heads).to(dv.scalar_type());
}

// y = x + o_proj(attention(q, k, v)); fills r.q/k/v/out/lse.
at::Tensor attention_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  Projected p = project(x, L);
  r.q = p.q, r.k = p.k, r.v = p.v;
  std::tie(r.out, r.lse) = kernel::attention_fwd(p.q, p.k, p.v, L.key_padding_mask, L.segment_ids,
                              L.window, /*causal=*/true, L.scale, /*q_offset=*/0);
  if (L.uniform_empty_rows) fix_empty_rows_forward(L, r);
  // The kernels return out as a (B, Hq, S, D) view of (B, S, Hq, D) memory, so merge_heads is
  // a view; this is a no-op for them and keeps the residual's layout fixed for any kernel.
  r.out = r.out.transpose(1, 2).contiguous().transpose(1, 2);
  return x + proj_fwd(L, kO, merge_heads(r.out));
}

at::Tensor attention_backward(const at::Tensor& dy, const at::Tensor& x, const Layer& L,
                              Residuals r, const std::vector<bool>& needs, Grads& g) {
  const int64_t b = x.size(0), sl = x.size(1), d = L.head_dim();
  // Recompute what the preset did not keep. The norm is always recomputed; the projections
  // when q/k/v were not kept, or when the per-head q/k norms need their inputs.
  Projected p;
  if (!r.q.defined() || L.qk_norm()) {
    p = project(x, L);
    if (!r.q.defined()) r.q = p.q, r.k = p.k, r.v = p.v;
  } else {
    p.n = L.cast(kernel::rms_norm_fwd(x, L.norm(kInputNorm), L.eps));
  }
  if (!r.out.defined()) {
    std::tie(r.out, r.lse) = kernel::attention_fwd(r.q, r.k, r.v, L.key_padding_mask, L.segment_ids,
                              L.window, /*causal=*/true, L.scale, /*q_offset=*/0);
    if (L.uniform_empty_rows) fix_empty_rows_forward(L, r);
  }

  const at::Tensor dy2 = L.cast(flat2(dy));
  const at::Tensor dmerged = proj_bwd(L, kO, dy2, flat2(merge_heads(r.out)), needs, g);
  const at::Tensor dout = dmerged.view({b, sl, L.num_heads, d}).transpose(1, 2);
  auto [dq, dk, dv] =
      kernel::attention_bwd(dout, r.q, r.k, r.v, r.out, r.lse, L.key_padding_mask, L.segment_ids,
                              L.window, /*causal=*/true, L.scale, /*q_offset=*/0, std::nullopt,
                              std::nullopt);
  if (L.uniform_empty_rows) fix_empty_rows_backward(L, r, dout, dq, dk, dv);
  auto [dqh, dkh] = kernel::rope_bwd(dq, dk, *L.cos, *L.sin);
  at::Tensor dq_lin = dqh.transpose(1, 2), dk_lin = dkh.transpose(1, 2);  // (B, S, H*, D)
  if (L.qk_norm()) {
    at::Tensor dqn, dkn;
    const at::Tensor &wqn = L.norm(kQNorm), &wkn = L.norm(kKNorm);
    std::tie(dq_lin, dqn) = kernel::rms_norm_bwd(
        dq_lin.to(at::promote_types(p.q_lin.scalar_type(), wqn.scalar_type())), p.q_lin, wqn,
        L.eps);
    std::tie(dk_lin, dkn) = kernel::rms_norm_bwd(
        dk_lin.to(at::promote_types(p.k_lin.scalar_type(), wkn.scalar_type())), p.k_lin, wkn,
        L.eps);
    if (needs[slot(kQNorm)]) set_grad(g, L, slot(kQNorm), dqn);
    if (needs[slot(kKNorm)]) set_grad(g, L, slot(kKNorm), dkn);
  }
  const at::Tensor n2 = flat2(p.n);
  at::Tensor dn = proj_bwd(L, kQ, L.cast(dq_lin.reshape({b * sl, L.num_heads * d})), n2, needs, g);
  dn.add_(proj_bwd(L, kK, L.cast(dk_lin.reshape({b * sl, L.num_kv_heads * d})), n2, needs, g));
  dn.add_(proj_bwd(L, kV, dv.transpose(1, 2).reshape({b * sl, L.num_kv_heads * d}), n2, needs, g));
  const at::Tensor& wn = L.norm(kInputNorm);
  auto [dxn, dwn] = kernel::rms_norm_bwd(
      dn.view(x.sizes()).to(at::promote_types(x.scalar_type(), wn.scalar_type())), x, wn,
      L.eps);
  if (needs[slot(kInputNorm)]) set_grad(g, L, slot(kInputNorm), dwn);
  return dy + dxn;
}

// ---- MLP sublayer --------------------------------------------------------------------------

// The normed MLP input, (T, H) in the compute dtype.
at::Tensor mlp_input(const at::Tensor& h, const Layer& L) {
  return L.cast(flat2(kernel::rms_norm_fwd(h, L.norm(kPostNorm), L.eps)));
}

// The SwiGLU ops' adapter arguments: [A_gate, B_gate, A_up, B_up, A_down, B_down] (cast to
// the compute dtype under autocast, their own dtype otherwise), the three factors, and the
// dropout probabilities with the seed (the ops number gate/up/down 4/5/6, as the layer does).
constexpr std::array<Proj, 3> kMlpProjs = {kGate, kUp, kDown};

struct MlpLora {
  c10::List<OptTensor> lora;
  std::vector<double> scaling, dropout;
  OptTensor seed;
};

MlpLora mlp_lora(const Layer& L) {
  MlpLora l;
  if (!L.mlp_has_lora()) return l;
  bool any_dropout = false;
  for (Proj p : kMlpProjs) {
    for (ProjPart part : {kLoraA, kLoraB}) l.lora.push_back(L.cast_opt(L.proj(p, part)));
    l.scaling.push_back(L.lora_scale(p));
    l.dropout.push_back(L.dropout_p(p));
    any_dropout = any_dropout || L.dropout_p(p) > 0.0;
  }
  if (any_dropout) {
    l.seed = L.dropout_seed;
  } else {
    l.dropout.clear();
  }
  return l;
}

// Rows per token chunk of the MLP: the SwiGLU intermediates of a chunk, three (rows, I)
// tensors at the compute width (the Triton backward's dh, dgate and dup; the CPU kernels
// chunk further within the same cap), within the byte cap CKPT_EXT_CHUNK_BYTES. A sequence
// that fits is one chunk, computed exactly as written out.
int64_t mlp_chunk_rows(const Layer& L, const at::Tensor& h) {
  const int64_t I = L.proj(kGate).size(0);
  return chunking::chunk_rows(3 * I * std::max<int64_t>(4, h.element_size()));
}

// y = h + down(silu(gate(m)) * up(m)) over token chunks (rows of h viewed as (T, H)), each
// chunk's output written in place; with `keep_gate_up` (fast, which saves the whole-sequence
// gate/up) one chunk, filling r.gate/up. The SwiGLU ops hash LoRA dropout masks on global
// rows (dropout_row_offset), so the chunks change no mask.
at::Tensor mlp_forward(const at::Tensor& h, const Layer& L, bool keep_gate_up, Residuals& r) {
  const MlpLora l = mlp_lora(L);
  const at::Tensor h2 = flat2(h);
  const int64_t T = h2.size(0);
  const int64_t rows = keep_gate_up ? T : mlp_chunk_rows(L, h);
  at::Tensor out;
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t tc = std::min(rows, T - t0);
    const at::Tensor hc = h2.narrow(0, t0, tc);
    auto [y2, gate, up] = kernel::swiglu_fwd(
        mlp_input(hc, L), L.cast(L.proj(kGate)), L.cast(L.proj(kUp)), L.cast(L.proj(kDown)),
        L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
        L.cast_opt(L.proj(kDown, kBias)), l.lora, l.scaling, keep_gate_up, l.dropout, l.seed,
        t0);
    if (keep_gate_up) r.gate = gate, r.up = up;
    if (tc == T) return h + y2.view(h.sizes());
    if (!out.defined())
      out = at::empty({T, h2.size(1)}, h.options().dtype(at::result_type(hc, y2)));
    at::Tensor out_c = out.narrow(0, t0, tc);
    at::add_out(out_c, hc, y2);
  }
  return out.view(h.sizes());
}

// A gradient summed over token chunks: the first chunk's as it is when it is the only one or
// already float32/float64, else widened to float32 (one rounding at the end, as one GEMM).
void accumulate(at::Tensor& sum, const at::Tensor& d, bool only_chunk) {
  if (sum.defined()) {
    sum.add_(d);
  } else {
    sum = only_chunk || d.element_size() >= 4 ? d : d.to(at::kFloat);
  }
}

// Backward of mlp_forward over the same token chunks: per chunk the norm is recomputed, the
// SwiGLU backward runs (its (rows, I) work one chunk at a time; fast reads its saved gate/up
// rows), and the chunk's dx rows are written in place; weight, bias, adapter and norm
// gradients sum over the chunks (float32 for half-precision ones).
at::Tensor mlp_backward(const at::Tensor& dy, const at::Tensor& h, const Layer& L,
                        const Residuals& r, const std::vector<bool>& needs, Grads& g) {
  // The ops' gradient order: weights, biases, then the adapters, as in mlp_lora.
  std::vector<int64_t> order;
  for (ProjPart part : {kWeight, kBias})
    for (Proj p : kMlpProjs) order.push_back(slot(p, part));
  for (Proj p : kMlpProjs)
    for (ProjPart part : {kLoraA, kLoraB}) order.push_back(slot(p, part));
  c10::List<bool> wanted;
  for (int64_t s : order) wanted.push_back(needs[s]);
  const MlpLora l = mlp_lora(L);
  const at::Tensor& wn = L.norm(kPostNorm);
  const at::Tensor h2 = flat2(h), dy2 = flat2(dy);
  const int64_t T = h2.size(0);
  const int64_t rows = mlp_chunk_rows(L, h);
  const bool one = rows >= T;
  std::vector<at::Tensor> sums(order.size());
  at::Tensor dwn_sum, dx;
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t tc = std::min(rows, T - t0);
    const at::Tensor hc = h2.narrow(0, t0, tc), dyc = dy2.narrow(0, t0, tc);
    OptTensor gate, up;
    if (r.gate.defined()) gate = r.gate.narrow(0, t0, tc), up = r.up.narrow(0, t0, tc);
    auto [dm2, dwg, dwu, dwd, dbg, dbu, dbd, dlora] = kernel::swiglu_bwd(
        L.cast(dyc), mlp_input(hc, L), L.cast(L.proj(kGate)), L.cast(L.proj(kUp)),
        L.cast(L.proj(kDown)), L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
        L.cast_opt(L.proj(kDown, kBias)), l.lora, l.scaling, gate, up, wanted, l.dropout, l.seed,
        t0);
    const std::array<at::Tensor*, 6> base = {&dwg, &dwu, &dwd, &dbg, &dbu, &dbd};
    for (size_t j = 0; j < order.size(); ++j) {
      if (!needs[order[j]]) continue;
      accumulate(sums[j], j < base.size() ? *base[j] : dlora[j - base.size()], one);
    }
    auto [dhn, dwn] = kernel::rms_norm_bwd(
        dm2.to(at::promote_types(h.scalar_type(), wn.scalar_type())), hc, wn, L.eps);
    if (needs[slot(kPostNorm)]) accumulate(dwn_sum, dwn, one);
    if (one) {
      dx = dy + dhn.view(h.sizes());
    } else {
      if (!dx.defined())
        dx = at::empty({T, h2.size(1)}, dy.options().dtype(at::result_type(dyc, dhn)));
      at::Tensor dx_c = dx.narrow(0, t0, tc);
      at::add_out(dx_c, dyc, dhn);
    }
  }
  for (size_t j = 0; j < order.size(); ++j)
    if (needs[order[j]]) set_grad(g, L, order[j], sums[j]);
  if (needs[slot(kPostNorm)]) set_grad(g, L, slot(kPostNorm), dwn_sum);
  return one ? dx : dx.view(h.sizes());
}

// ---- the whole call ------------------------------------------------------------------------

at::Tensor layer_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  const bool fast = L.preset_id == Preset::kFast;
  switch (L.part_id) {
    case Part::kAttention:
      return attention_forward(x, L, r);
    case Part::kMlp:
      return mlp_forward(x, L, fast, r);
    case Part::kLayer:
      r.h = attention_forward(x, L, r).contiguous();
      return mlp_forward(r.h, L, fast, r);
  }
  TORCH_INTERNAL_ASSERT(false);
}

Grads layer_backward(const at::Tensor& dy, const at::Tensor& x, const Layer& L, Residuals r,
                     const std::vector<bool>& needs) {
  Grads g;
  switch (L.part_id) {
    case Part::kAttention:
      g.dx = attention_backward(dy, x, L, r, needs, g);
      break;
    case Part::kMlp:
      g.dx = mlp_backward(dy, x, L, r, needs, g);
      break;
    case Part::kLayer: {
      if (!r.h.defined()) {  // min_memory: rebuild the MLP input, keeping what it took
        Residuals a;
        r.h = attention_forward(x, L, a);
        r.q = a.q, r.k = a.k, r.v = a.v, r.out = a.out, r.lse = a.lse;
      }
      at::Tensor dh = mlp_backward(dy, r.h, L, r, needs, g);
      r.h = r.gate = r.up = at::Tensor();
      g.dx = attention_backward(dh, x, L, r, needs, g);
      break;
    }
  }
  return g;
}

// Residuals of an empty input (B = 0 or S = 0), shaped as the real ones.
Residuals empty_residuals(const at::Tensor& x, const Layer& L) {
  Residuals r;
  const int64_t b = x.size(0), s = x.size(1);
  const auto act = x.options().dtype(L.act_dtype(x));
  if (has_attention(L.part_id)) {
    const int64_t d = L.head_dim();
    r.q = at::empty({b, s, L.num_heads, d}, act).transpose(1, 2);
    r.k = at::empty({b, s, L.num_kv_heads, d}, act).transpose(1, 2);
    r.v = at::empty({b, s, L.num_kv_heads, d}, act).transpose(1, 2);
    r.out = at::empty({b, s, L.num_heads, d}, act).transpose(1, 2);
    r.lse = at::empty({b, L.num_heads, s}, x.options().dtype(at::kFloat));
  }
  r.h = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (has_mlp(L.part_id)) {
    r.gate = at::empty({b * s, L.proj(kGate).size(0)}, act);
    r.up = at::empty({b * s, L.proj(kGate).size(0)}, act);
  }
  return r;
}

}  // namespace

// ---- ops -----------------------------------------------------------------------------------

FwdResult decoder_layer_fwd(const at::Tensor& x LAYER_PARAMS) {
  const char* op = "decoder_layer";
  const Layer L = make_layer(weights, LAYER_TENSORS_OF_PARAMS, LAYER_OPTIONS_OF_PARAMS, op);
  check_layer(op, x, L);
  if (x.numel() == 0) return {at::empty_like(x, at::MemoryFormat::Contiguous),
                              pack(empty_residuals(x, L), L)};
  Residuals r;
  at::Tensor y = layer_forward(x, L, r).contiguous();
  return {y, pack(r, L)};
}

BwdResult decoder_layer_bwd(const at::Tensor& dy, const at::Tensor& x LAYER_PARAMS,
                            at::TensorList saved, const c10::List<bool>& needs_grad) {
  const char* op = "decoder_layer_bwd";
  const Layer L = make_layer(weights, LAYER_TENSORS_OF_PARAMS, LAYER_OPTIONS_OF_PARAMS, op);
  check_layer(op, x, L);
  checks::check_shape(op, "dy", dy, x.sizes(), "(the shape of x)");
  CKPT_CHECK_VALUE(static_cast<int64_t>(needs_grad.size()) == kNumSlots, op,
                   "needs_grad must have one entry per weight slot (", kNumSlots, "), got ",
                   needs_grad.size());
  std::vector<bool> needs(kNumSlots);
  for (int64_t s = 0; s < kNumSlots; ++s) needs[s] = needs_grad.get(s) && L.at(s).defined();
  Grads g;
  if (x.numel() == 0) {
    g.dx = at::zeros_like(x, at::MemoryFormat::Contiguous);
    for (int64_t s = 0; s < kNumSlots; ++s)
      if (needs[s]) g.dw[s] = at::zeros_like(L.at(s));
  } else {
    g = layer_backward(dy.to(x.scalar_type()), x, L, unpack(saved, L, op), needs);
  }
  // Slots without a gradient come back as empty (0,) tensors (a Tensor[] holds no None), one
  // each: outputs of an op must not alias each other.
  for (auto& d : g.dw)
    if (!d.defined()) d = at::empty({0}, x.options());
  return {g.dx.contiguous(), g.dw};
}

}  // namespace layer
}  // namespace ckpt_ext
