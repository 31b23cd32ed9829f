// The fused decoder layer's math: the ops decoder_layer_fwd and decoder_layer_bwd (their
// arguments, slots and residuals: csrc/layer_spec.h). The kernels are called through the
// dispatcher (csrc/kernel_ops.h), so each runs on the backend registered for its tensors.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "layer_spec.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/promote_types.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros_like.h>

#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "activation.h"
#include "checks.h"
#include "chunking.h"
#include "kernel_ops.h"
#include "lora_dropout.h"
#include "moe_math.h"
#include "ulysses.h"

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
  L.num_kv_heads = options.num_kv_heads.value_or(L.num_heads);
  const at::Tensor& wq = L.proj(kQ);
  L.scale = options.scale ? *options.scale
            : wq.defined() && wq.dim() == 2 && L.num_heads > 0
                ? 1.0 / std::sqrt(static_cast<double>(wq.size(0) / L.num_heads))
                : 1.0;
  return L;
}

// Adapter factor `part` (kLoraA / kLoraB) of projection p as the layer's ops read it: in the
// compute dtype under autocast (Layer::cast), then, where `wide` (the SwiGLU ops, whose LoRA
// dtype is float32 for a half-precision base), widened to float32 (exact). Converted once per
// call, not once per token chunk: kept in L.factor_cache (a factor needing no conversion is
// itself; a call reads each slot in one dtype, and one read in another is converted as it is).
at::Tensor lora_factor(const Layer& L, Proj p, ProjPart part, bool wide = false) {
  const at::Tensor& f = L.proj(p, part);
  const bool cast = L.compute_dtype && f.scalar_type() != *L.compute_dtype;
  const at::ScalarType dt = cast ? *L.compute_dtype : f.scalar_type();
  const bool widen = wide && c10::elementSize(dt) < 4;
  if (!cast && !widen) return f;
  at::Tensor& c = L.factor_cache[slot(p, part)];
  const at::ScalarType want = widen ? at::kFloat : dt;
  if (!c.defined()) c = (cast ? f.to(dt) : f).to(want);
  return c.scalar_type() == want ? c : (cast ? f.to(dt) : f).to(want);
}

// The adapter's input of projection p, dropout applied (inp in the LoRA dtype); row0: the
// global token row of inp's first row (masks hash global rows, so chunks change none).
at::Tensor lora_input(const Layer& L, Proj p, const at::Tensor& inp, int64_t row0) {
  const double dp = L.dropout_p(p);
  return dp > 0.0 ? kernel::lora_dropout(inp, *L.dropout_seed, L.stream(p), dp, row0) : inp;
}

// ---- validation ----------------------------------------------------------------------------

void check_weight(const char* op, const Layer& L, int64_t s, const at::Tensor& x,
                  c10::IntArrayRef shape, const std::string& why) {
  const at::Tensor& t = L.at(s);
  const std::string name = slot_name(s);
  CKPT_CHECK_VALUE(t.defined(), op, name, " is required");
  checks::check_shape(op, name.c_str(), t, shape, why);
  checks::check_device_as(op, name.c_str(), t, "x", x);
  const bool adapter =
      (s >= kNumNorms && !is_moe_slot(s) && (s - kNumNorms) % kNumProjParts >= kLoraA) ||
      s >= slot(kExpertsGateUpLoraA);
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

// An optional norm over the hidden size.
void check_norm(const char* op, const Layer& L, Norm n, const at::Tensor& x) {
  if (L.has_norm(n)) check_weight(op, L, slot(n), x, {x.size(2)}, "to match x's hidden size");
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
  CKPT_CHECK_VALUE(L.lora_streams.empty() ||
                       static_cast<int64_t>(L.lora_streams.size()) == kNumProjs,
                   op, "lora_streams must be [] or have one entry per projection (", kNumProjs,
                   "), got ", L.lora_streams.size());
  for (int64_t t : L.lora_streams)
    CKPT_CHECK_VALUE(t >= 0, op, "lora_streams must hold streams >= 0, got ", t);
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

// sequence_parallel: the heads split over the group, the per-token tensors of this rank's
// tokens. The options are the same on every rank, so each of these refuses on every rank.
void check_sequence_parallel(const char* op, const at::Tensor& x, const Layer& L) {
  const ulysses::Group g = ulysses::resolve(L.sequence_parallel, op);
  const int64_t n = g.size;
  CKPT_CHECK_VALUE(L.num_heads % n == 0, op, "num_heads=", L.num_heads,
                   " must be divisible by the sequence_parallel group's size ", n,
                   " (each rank attends with num_heads / N query heads)");
  CKPT_CHECK_VALUE(L.num_kv_heads % n == 0 || n % L.num_kv_heads == 0, op, "num_kv_heads=",
                   L.num_kv_heads, " must be a multiple or a divisor of the sequence_parallel "
                   "group's size ", n, " (KV heads are split over the ranks, or repeated)");
  for (const auto& [name, t] : {std::pair<const char*, const OptTensor&>{"key_padding_mask",
                                                                         L.key_padding_mask},
                                {"segment_ids", L.segment_ids}}) {
    if (!t) continue;
    checks::check_shape(op, name, *t, {x.size(0), x.size(1)},
                        "(B, S): this rank's tokens under sequence_parallel");
  }
}

// ---- MoE: validation ------------------------------------------------------------------------

// The MoE slots and options: the router (E, H), the experts in transformers 5's layout, the
// shared expert's gate (1, H) beside a shared expert; without num_experts_per_tok no MoE slot.
void check_moe(const char* op, const at::Tensor& x, const Layer& L);

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
    CKPT_CHECK_VALUE(std::isfinite(L.softcap) && L.softcap >= 0, op,
                     "softcap must be a finite number >= 0 (0: no cap), got ", L.softcap);
    // Without a padding mask no query row is empty (each sees itself), so only with one do
    // eager's uniform rows arise; their corrections (EmptyRows) assume uncapped scores.
    TORCH_CHECK_NOT_IMPLEMENTED(
        !(L.softcap > 0 && L.uniform_empty_rows && L.key_padding_mask), op,
        ": softcap with uniform_empty_rows and a key_padding_mask (HF eager's rows with no key "
        "to attend) is not implemented; pad on the right with uniform_empty_rows=False (no "
        "row is then empty), or use policy 'torch' for this model");
    if (!L.sequence_parallel.empty()) check_sequence_parallel(op, x, L);
    const at::Tensor& wq = L.proj(kQ);
    CKPT_CHECK_VALUE(wq.defined() && wq.dim() == 2 && wq.size(0) % L.num_heads == 0, op,
                     "self_attn.q_proj.weight must be (num_heads * head_dim, H) with num_heads=",
                     L.num_heads, ", got ", wq.defined() ? checks::shape_str(wq.sizes()) : "None");
    const int64_t d = L.head_dim();
    check_norm(op, L, kInputNorm, x);
    check_norm(op, L, kAttnOutNorm, x);
    check_proj(op, L, kQ, x, L.num_heads * d, h);
    check_proj(op, L, kK, x, L.num_kv_heads * d, h);
    check_proj(op, L, kV, x, L.num_kv_heads * d, h);
    check_proj(op, L, kO, x, h, L.num_heads * d);
    CKPT_CHECK_VALUE(L.qk_norm() == L.norm(kKNorm).defined(), op,
                     "self_attn.q_norm.weight and self_attn.k_norm.weight come together");
    if (L.qk_norm()) {  // per head, or over the whole projection (the same when heads is 1)
      const bool whole = L.norm(kQNorm).numel() != d;
      const char* why = whole ? "(num_heads * head_dim,), or (head_dim,) for a per-head norm "
                                "like the other" : "(head_dim,), or the projection's width "
                                "(heads * head_dim,) for a norm over it like the other";
      check_weight(op, L, slot(kQNorm), x, {whole ? L.num_heads * d : d}, why);
      check_weight(op, L, slot(kKNorm), x, {whole ? L.num_kv_heads * d : d}, why);
    }
    CKPT_CHECK_VALUE(L.cos && L.sin, op,
                     "position_embeddings (cos, sin) are required for the attention");
    const at::Tensor &cos = *L.cos, &sin = *L.sin;
    checks::check_dim(op, "cos", cos, 3, "(B or 1, S, R)");
    CKPT_CHECK_VALUE(cos.size(0) == 1 || cos.size(0) == b, op,
                     "cos must have batch size 1 or B=", b, ", got shape ",
                     checks::shape_str(cos.sizes()));
    // partial rotary embeddings (Phi-4-mini): only the first R dims of a head rotate
    const int64_t r = cos.size(2);
    CKPT_CHECK_VALUE(r <= d && r % 2 == 0, op, "cos must be (B or 1, S, R) with an "
                     "even rotary width R <= head_dim=", d, ", got shape ",
                     checks::shape_str(cos.sizes()));
    checks::check_shape(op, "cos", cos, {cos.size(0), s, r}, "(B or 1, S, R)");
    checks::check_shape(op, "sin", sin, cos.sizes(), "(the shape of cos)");
    CKPT_CHECK_VALUE(!cos.requires_grad() && !sin.requires_grad(), op,
                     "gradients with respect to cos/sin are not computed; pass position "
                     "embeddings that do not require grad (detach them)");
    checks::check_dtype_as(op, "sin", sin, "cos", cos);
    if (!L.compute_dtype) {
      // float32 tables for a half-precision input: ERNIE 4.5 keeps its position embeddings in
      // full precision; RoPE computes in float32 either way
      const bool wide = cos.scalar_type() == at::kFloat &&
                        at::isReducedFloatingType(x.scalar_type());
      CKPT_CHECK_TYPE(cos.scalar_type() == x.scalar_type() || wide, op, "cos is ",
                      checks::dtype_str(cos.scalar_type()), " but x is ",
                      checks::dtype_str(x.scalar_type()),
                      "; outside autocast position embeddings share the input's dtype (or are "
                      "float32 for a float16/bfloat16 input)");
    }
  }
  if (has_mlp(L.part_id)) {
    check_norm(op, L, kPostNorm, x);
    check_norm(op, L, kMlpOutNorm, x);
    if (!L.moe() || L.has_dense_mlp()) {  // the dense MLP, or an MoE layer's shared expert
      const at::Tensor& wg = L.proj(kGate);
      CKPT_CHECK_VALUE(wg.defined() && wg.dim() == 2, op,
                       "mlp.gate_proj.weight must be (intermediate_size, H)");
      const int64_t i = wg.size(0);
      check_proj(op, L, kGate, x, i, h);
      check_proj(op, L, kUp, x, i, h);
      check_proj(op, L, kDown, x, h, i);
    }
  }
  check_moe(op, x, L);
  CKPT_CHECK_VALUE(std::isfinite(L.norm_offset), op, "norm_offset must be finite, got ",
                   L.norm_offset);
  CKPT_CHECK_VALUE(std::isfinite(L.eps) && L.eps >= 0, op,
                   "eps must be a finite number >= 0, got ", L.eps);
  TORCH_CHECK_NOT_IMPLEMENTED(L.sequence_parallel.empty() || has_attention(L.part_id), op,
                              ": sequence_parallel with part 'mlp' is not implemented (the MLP "
                              "is token-local: run it inside part 'layer', or without "
                              "sequence_parallel)");
  check_dropout(op, L);
  parse_activation(L.activation, op);
  CKPT_CHECK_VALUE(!L.chunk_rows || *L.chunk_rows >= 1, op,
                   "chunk_rows must be None (the byte cap's rows) or a positive number of "
                   "token rows, got ", L.chunk_rows.value_or(0));
}

// The experts' LoRA factors (PEFT's layouts, csrc/moe_math.h) of e experts of width i, and
// expert_lora_scaling: [] without factors, else two finite scalings.
void check_experts_lora(const char* op, const at::Tensor& x, const Layer& L, int64_t e,
                        int64_t i) {
  const int64_t h = x.size(2);
  const bool any = L.experts_lora();
  CKPT_CHECK_VALUE(L.expert_lora_scaling.empty() || L.expert_lora_scaling.size() == 2, op,
                   "expert_lora_scaling must be [] or two scalings (mlp.experts.gate_up_proj's "
                   "and mlp.experts.down_proj's), got ", L.expert_lora_scaling.size(),
                   " entries");
  CKPT_CHECK_VALUE(!any || L.expert_lora_scaling.size() == 2, op,
                   "expert_lora_scaling must have two entries (mlp.experts.gate_up_proj's and "
                   "mlp.experts.down_proj's scaling) when the experts' LoRA factors are given");
  for (double sc : L.expert_lora_scaling)
    CKPT_CHECK_VALUE(std::isfinite(sc), op, "expert_lora_scaling must be finite, got ", sc);
  const struct {
    MoeSlot a, b;
    int64_t out, in;
  } pairs[] = {{kExpertsGateUpLoraA, kExpertsGateUpLoraB, 2 * i, h},
               {kExpertsDownLoraA, kExpertsDownLoraB, h, i}};
  for (const auto& p : pairs) {
    const at::Tensor &a = L.moe_w(p.a), &b = L.moe_w(p.b);
    CKPT_CHECK_VALUE(a.defined() == b.defined(), op, kMoeNames[p.a], " and ", kMoeNames[p.b],
                     " come together");
    if (!a.defined()) continue;
    CKPT_CHECK_VALUE(a.dim() == 2 && a.size(0) > 0 && a.size(0) % e == 0, op, kMoeNames[p.a],
                     " must be (rank * num_experts, in) with num_experts=", e,
                     " (PEFT's expert-major rows), got ", checks::shape_str(a.sizes()));
    const int64_t re = a.size(0);
    check_weight(op, L, slot(p.a), x, {re, p.in}, "(rank * num_experts, in_features)");
    check_weight(op, L, slot(p.b), x, {p.out, re},
                 "(out_features, rank * num_experts): PEFT's lora_B, the expert index fastest");
  }
}

void check_moe(const char* op, const at::Tensor& x, const Layer& L) {
  CKPT_CHECK_VALUE(L.num_experts_per_tok >= 0, op,
                   "num_experts_per_tok must be >= 0 (0: a dense MLP), got ",
                   L.num_experts_per_tok);
  CKPT_CHECK_VALUE(!L.router_logits || (L.moe() && has_mlp(L.part_id)), op,
                   "router_logits=True needs a mixture-of-experts MLP (num_experts_per_tok > 0) "
                   "and a part that has it ('layer' or 'mlp'), got num_experts_per_tok=",
                   L.num_experts_per_tok, " and part '", L.part, "'");
  CKPT_CHECK_VALUE(!L.router_stats || (L.moe() && has_mlp(L.part_id)), op,
                   "router_stats=True needs a mixture-of-experts MLP (num_experts_per_tok > 0) "
                   "and a part that has it ('layer' or 'mlp'), got num_experts_per_tok=",
                   L.num_experts_per_tok, " and part '", L.part, "'");
  CKPT_CHECK_VALUE(!(L.router_stats && L.router_logits), op,
                   "router_logits and router_stats are exclusive (the op's second output is "
                   "one of them): ask for the logits, or for the load-balancing statistics");
  if (!L.moe()) {
    for (int64_t m = 0; m < kNumMoeSlots; ++m)
      CKPT_CHECK_VALUE(!L.moe_w(static_cast<MoeSlot>(m)).defined(), op, kMoeNames[m],
                       " is given but num_experts_per_tok is 0 (a dense MLP); set "
                       "num_experts_per_tok to the experts each token is routed to");
    CKPT_CHECK_VALUE(L.expert_lora_scaling.empty(), op,
                     "expert_lora_scaling is given but num_experts_per_tok is 0 (no experts)");
    return;
  }
  if (!has_mlp(L.part_id)) return;
  moe::parse_router(L.router, op);
  const int64_t h = x.size(2), k = L.num_experts_per_tok;
  const at::Tensor& wr = L.moe_w(kRouter);
  CKPT_CHECK_VALUE(wr.defined() && wr.dim() == 2, op,
                   "mlp.gate.weight (the router) must be (num_experts, H) when "
                   "num_experts_per_tok > 0, got ",
                   wr.defined() ? checks::shape_str(wr.sizes()) : "None");
  const int64_t e = wr.size(0);
  CKPT_CHECK_VALUE(k <= e, op, "num_experts_per_tok=", k,
                   " is larger than the number of experts (mlp.gate.weight has ", e, " rows)");
  check_weight(op, L, slot(kRouter), x, {e, h}, "(num_experts, H)");
  const at::Tensor& gu = L.moe_w(kExpertsGateUp);
  CKPT_CHECK_VALUE(gu.defined() && gu.dim() == 3 && gu.size(1) % 2 == 0, op,
                   "mlp.experts.gate_up_proj must be (num_experts, 2 * I, H), transformers 5's "
                   "layout (the gate's I rows, then up's), got ",
                   gu.defined() ? checks::shape_str(gu.sizes()) : "None");
  const int64_t i = gu.size(1) / 2;
  check_weight(op, L, slot(kExpertsGateUp), x, {e, 2 * i, h},
               "(num_experts, 2 * I, H): transformers 5's concatenated gate/up layout (a "
               "transposed or interleaved layout, like gpt-oss's, is not supported)");
  check_weight(op, L, slot(kExpertsDown), x, {e, h, i},
               "(num_experts, H, I): transformers 5's layout");
  check_experts_lora(op, x, L, e, i);
  if (L.moe_w(kSharedGate).defined()) {
    CKPT_CHECK_VALUE(L.has_dense_mlp(), op,
                     "mlp.shared_expert_gate.weight needs a shared expert (the mlp.gate_proj / "
                     "up_proj / down_proj slots)");
    check_weight(op, L, slot(kSharedGate), x, {1, h}, "(1, H)");
  }
}

// ---- products and their sums ---------------------------------------------------------------

// alpha a b as one GEMM (beta 0: the output's initial contents are ignored).
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, double alpha) {
  if (alpha == 1.0) return a.mm(b);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  return at::addmm_out(out, out, a, b, /*beta=*/0.0, alpha);
}

// acc + alpha a b, added into acc inside the GEMM where acc and the operands share a dtype
// (addmm_, beta 1: the GEMM adds in float32 and rounds once; ATen 2.13's CPU bf16 addmm_ had
// 0.55-0.67x the error of a product and an add at 1-512 rows); else the product, then an add
// with alpha. acc undefined: alpha a b.
at::Tensor add_product(at::Tensor acc, const at::Tensor& a, const at::Tensor& b,
                       double alpha = 1.0) {
  if (!acc.defined()) return scaled_mm(a, b, alpha);
  if (acc.scalar_type() == a.scalar_type() && acc.scalar_type() == b.scalar_type())
    return acc.addmm_(a, b, /*beta=*/1.0, alpha);
  return acc.add_(a.mm(b), alpha);
}

} // namespace

// Whether the installed ATen computes addmm with float32 out of half-precision operands on
// the device of `like` (addmm.dtype_out; older releases refused: "self and mat2 must have the
// same dtype"), probed once per process with a 1x1 product; a refusal warns once and the chunk
// sums fall back to a product and a separate add. The CPU has no such kernel: false.
bool gemm_fp32_out_ok(const at::Tensor& like) {
  if (!like.is_cuda()) return false;
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [&] {
    try {
      const auto o = like.options().dtype(at::kBFloat16);
      at::Tensor acc = at::zeros({1, 1}, o.dtype(at::kFloat));
      at::addmm_out(acc, acc, at::ones({1, 1}, o), at::ones({1, 1}, o), at::kFloat, 0.0, 1.0);
      ok = acc.item<float>() == 1.0f;
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok)
      TORCH_WARN("ckpt_ext: this torch's addmm does not take a float32 out with bfloat16 "
                 "operands; the fused layer sums its token chunks' gradients with a separate "
                 "add per chunk instead of inside the GEMM");
  });
  return ok;
}

namespace {

// ---- projections (with optional LoRA) ------------------------------------------------------

// y = inp W^T + b + scaling * (dropout(inp) A^T) B^T; inp in the compute dtype, dropout in
// the LoRA dtype (PEFT's order); row0 as in lora_input. The B product is added into the base
// projection's output inside its GEMM (addmm, beta 1, alpha = scaling: one rounding) where y
// and the adapter share a dtype, else added with alpha at the ops' float32 width
// (add_product).
at::Tensor proj_fwd(const Layer& L, Proj p, const at::Tensor& inp, int64_t row0) {
  at::Tensor y = at::linear(inp, L.cast(L.proj(p)), L.cast_opt(L.proj(p, kBias)));
  if (L.has_lora(p)) {
    const at::ScalarType ld = L.lora_dtype(p);
    const at::Tensor u =
        at::linear(lora_input(L, p, inp.to(ld), row0), lora_factor(L, p, kLoraA).to(ld));
    const at::Tensor y2 = y.view({-1, y.size(-1)});
    add_product(y2, u.view({-1, u.size(-1)}), lora_factor(L, p, kLoraB).to(ld).t(),
                L.lora_scale(p));
  }
  return y;
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

// The gradients of x and of the weight slots. A slot's gradient is summed over the token
// chunks (accumulate, or addmm for a product: inside the GEMM where chunking::chunk_sum
// allows) and cast to the slot's dtype at the end (finish).
struct Grads {
  explicit Grads(bool chunked) : chunked(chunked) {}
  bool chunked;  // more than one token chunk
  at::Tensor dx;
  std::vector<at::Tensor> dw = std::vector<at::Tensor>(kNumSlots);

  void add(int64_t s, const at::Tensor& d) { accumulate(dw[s], d, !chunked); }
  // dw[s] += alpha a b: a (out, T) and b (T, in) in one dtype.
  void addmm(int64_t s, const at::Tensor& a, const at::Tensor& b, double alpha = 1.0) {
    at::Tensor& acc = dw[s];
    const bool half = a.element_size() < 4;
    switch (chunking::chunk_sum(chunked || acc.defined(), half, a.is_cuda(),
                                half && gemm_fp32_out_ok(a))) {
      case chunking::ChunkSum::kProduct:
        acc = scaled_mm(a, b, alpha);
        return;
      case chunking::ChunkSum::kInGemm:
        if (!half) {
          acc = add_product(acc, a, b, alpha);
        } else {
          const bool first = !acc.defined();
          if (first) acc = at::empty({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
          else if (acc.scalar_type() != at::kFloat) acc = acc.to(at::kFloat);
          at::addmm_out(acc, acc, a, b, at::kFloat, first ? 0.0 : 1.0, alpha);
        }
        return;
      case chunking::ChunkSum::kAddAfter:
        accumulate(acc, scaled_mm(a, b, alpha), false);
        return;
    }
  }
  void finish(const Layer& L) {
    for (int64_t s = 0; s < kNumSlots; ++s)
      if (dw[s].defined()) dw[s] = dw[s].to(L.at(s).scalar_type());
  }
};

// Backward of proj_fwd: inp2 (T, in) and dy2 (T, out) in the compute dtype; weight gradients
// only where `needs` asks for them. Returns d inp (T, in), added into dsum when it is given
// (the gradient of an input several projections read: inside the GEMM, add_product).
at::Tensor proj_bwd(const Layer& L, Proj p, const at::Tensor& dy2, const at::Tensor& inp2,
                    const std::vector<bool>& needs, Grads& g, int64_t row0,
                    const at::Tensor& dsum = at::Tensor()) {
  const at::Tensor w = L.cast(L.proj(p));
  at::Tensor dinp = add_product(dsum, dy2, w);
  if (needs[slot(p, kWeight)]) g.addmm(slot(p, kWeight), dy2.t(), inp2);
  if (needs[slot(p, kBias)]) g.add(slot(p, kBias), dy2.sum(0));
  if (L.has_lora(p)) {
    const double s = L.lora_scale(p);
    const at::ScalarType ld = L.lora_dtype(p);
    const at::Tensor a = lora_factor(L, p, kLoraA).to(ld), b = lora_factor(L, p, kLoraB).to(ld);
    const at::Tensor dyl = dy2.to(ld), inpl = lora_input(L, p, inp2.to(ld), row0);
    const at::Tensor dyb = dyl.mm(b);  // (T, r)
    // dropout is linear and its own adjoint: the input's gradient gets the forward's mask;
    // the scaling and the sum in one pass (add_ with alpha, or the GEMM's alpha without one)
    if (L.dropout_p(p) > 0.0) dinp.add_(lora_input(L, p, dyb.mm(a), row0), s);
    else add_product(dinp, dyb, a, s);
    if (needs[slot(p, kLoraB)]) g.addmm(slot(p, kLoraB), dyl.t(), inpl.mm(a.t()), s);
    if (needs[slot(p, kLoraA)]) g.addmm(slot(p, kLoraA), dyb.t(), inpl, s);
  }
  return dinp;
}

at::Tensor flat2(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// ---- norms ---------------------------------------------------------------------------------

// The RMSNorm of slot n over x's last dim, as the family rounds it (norm_offset,
// norm_cast_last in csrc/layer_spec.h); an absent norm is the identity.
at::Tensor norm_fwd(const Layer& L, Norm n, const at::Tensor& x) {
  const at::Tensor& w = L.norm(n);
  if (!w.defined()) return x;
  if (!L.norm_cast_last) {
    return kernel::rms_norm_fwd(x, L.norm_offset == 0.0 ? w : w + L.norm_offset, L.eps);
  }
  const at::ScalarType wide = at::promote_types(x.scalar_type(), at::kFloat);
  return kernel::rms_norm_fwd(x.to(wide), w.to(wide) + L.norm_offset, L.eps)
      .to(x.scalar_type());
}

// Backward of norm_fwd: d x (dy itself for an absent norm); the weight's gradient is added to
// g where `needs` asks for it.
at::Tensor norm_bwd(const Layer& L, Norm n, const at::Tensor& dy, const at::Tensor& x,
                    const std::vector<bool>& needs, Grads& g) {
  const at::Tensor& w = L.norm(n);
  if (!w.defined()) return dy;
  at::Tensor dx, dw;
  if (!L.norm_cast_last) {
    std::tie(dx, dw) = kernel::rms_norm_bwd(dy.to(at::promote_types(x.scalar_type(), w.scalar_type())),
                                            x, L.norm_offset == 0.0 ? w : w + L.norm_offset,
                                            L.eps);
  } else {
    const at::ScalarType wide = at::promote_types(x.scalar_type(), at::kFloat);
    std::tie(dx, dw) = kernel::rms_norm_bwd(dy.to(wide), x.to(wide),
                                            w.to(wide) + L.norm_offset, L.eps);
    dx = dx.to(x.scalar_type());
  }
  if (needs[slot(n)]) g.add(slot(n), dw);
  return dx;
}

// q or k norm of lin (nb, sc, heads, D): per head for a (D,) weight, else over the whole
// projection (heads * D,).
bool per_head(const Layer& L, Norm n, const at::Tensor& lin) {
  return L.norm(n).numel() == lin.size(-1);
}

at::Tensor head_norm_fwd(const Layer& L, Norm n, const at::Tensor& lin) {
  if (!L.qk_norm()) return lin;
  if (per_head(L, n, lin)) return norm_fwd(L, n, lin);
  return norm_fwd(L, n, lin.flatten(2)).view(lin.sizes());
}

at::Tensor head_norm_bwd(const Layer& L, Norm n, const at::Tensor& dlin, const at::Tensor& lin,
                         const std::vector<bool>& needs, Grads& g) {
  if (!L.qk_norm()) return dlin;
  if (per_head(L, n, lin)) return norm_bwd(L, n, dlin, lin, needs, g);
  return norm_bwd(L, n, dlin.flatten(2), lin.flatten(2), needs, g).view(lin.sizes());
}

// ---- residuals -----------------------------------------------------------------------------

std::vector<at::Tensor> pack(const Residuals& r, const Layer& L) {
  std::vector<at::Tensor> out;
  for (Member m : kept(L.part_id, L.preset_id, L.moe())) out.push_back(r.*m);
  return out;
}

Residuals unpack(at::TensorList saved, const Layer& L, const char* op) {
  const auto members = kept(L.part_id, L.preset_id, L.moe());
  CKPT_CHECK_VALUE(saved.size() == members.size(), op, "saved must hold ", members.size(),
                   " tensors for this part and preset, got ", saved.size());
  Residuals r;
  for (size_t i = 0; i < members.size(); ++i) r.*members[i] = saved[i];
  return r;
}

// ---- MLP sublayer --------------------------------------------------------------------------

// The normed MLP input, (T, H) in the compute dtype.
at::Tensor mlp_input(const at::Tensor& h, const Layer& L) {
  return L.cast(flat2(norm_fwd(L, kPostNorm, h)));
}

// The SwiGLU ops' adapter arguments: [A_gate, B_gate, A_up, B_up, A_down, B_down] (cast to
// the compute dtype under autocast, converted once per call by lora_factor), the three factors,
// and the
// dropout probabilities with the seed (the ops number gate/up/down 4/5/6, as the layer does).
constexpr std::array<Proj, 3> kMlpProjs = {kGate, kUp, kDown};

struct MlpLora {
  c10::List<OptTensor> lora;
  std::vector<double> scaling, dropout;
  std::vector<int64_t> streams;  // [] or the three projections' streams (lora_streams)
  OptTensor seed;
};

// For the backward (`backward`) half-precision factors are widened to float32 (the ops' LoRA
// dtype), all six, as both backends' backward would widen them per call, i.e. per token chunk;
// their gradients then come back float32 and are rounded once, at the end. The forward's are
// as they are (the Triton launcher widens only the three it multiplies in torch GEMMs, and
// an adapter's two factors must share a dtype).
MlpLora mlp_lora(const Layer& L, bool backward) {
  MlpLora l;
  if (!L.mlp_has_lora()) return l;
  bool any_dropout = false;
  for (Proj p : kMlpProjs) {
    for (ProjPart part : {kLoraA, kLoraB}) {
      l.lora.push_back(L.has_lora(p) ? OptTensor(lora_factor(L, p, part, backward))
                                     : std::nullopt);
    }
    l.scaling.push_back(L.lora_scale(p));
    l.dropout.push_back(L.dropout_p(p));
    if (!L.lora_streams.empty()) l.streams.push_back(L.stream(p));
    any_dropout = any_dropout || L.dropout_p(p) > 0.0;
  }
  if (any_dropout) {
    l.seed = L.dropout_seed;
  } else {
    l.dropout.clear();
    l.streams.clear();
  }
  return l;
}

// ---- MoE FFN (num_experts_per_tok > 0) --------------------------------------------------------
//
// The MLP's output is the routed experts' (csrc/moe_math.h) plus, where the dense MLP slots are
// given, the shared expert's (the dense SwiGLU, LoRA included), times sigmoid(m g^T) with the
// shared gate g (Qwen2-MoE). The routing (topk_idx, topk_w) is computed once, in the forward,
// and kept in every preset; the backward recomputes the router's logits (for their gradient)
// and each chunk's expert gate/up, never the choice. fast keeps no gate/up of an MoE layer.

// The elements one token holds in an FFN chunk (csrc/chunking.h ffn_row_width).
int64_t ffn_row_width(const Layer& L, int64_t hidden) {
  const int64_t i = L.has_dense_mlp() ? L.proj(kGate).size(0) : 0;
  if (!L.moe()) return chunking::ffn_row_width(i);
  return chunking::ffn_row_width(i, hidden, L.moe_w(kRouter).size(0), L.num_experts_per_tok,
                                 L.moe_w(kExpertsDown).size(2));
}

// The router's logits of rows m (T, H) in the compute dtype: (T, E) in m's dtype, HF's
// F.linear(m, gate.weight).
at::Tensor router_logits(const Layer& L, const at::Tensor& m) {
  return at::linear(m, L.cast(L.moe_w(kRouter)));
}

// The load-balancing statistics' token weights of a call's rows (Residuals::stats_w): the key
// padding mask's (1 = a real token), undefined (all 1) without one or without router_stats.
at::Tensor stats_weights(const at::Tensor& x, const Layer& L) {
  if (!L.router_stats || !L.key_padding_mask) return at::Tensor();
  return L.key_padding_mask->reshape({x.size(0) * x.size(1)});
}

// (idx, w) from the router's logits: the router's choice.
std::tuple<at::Tensor, at::Tensor> moe_route(const Layer& L, const at::Tensor& logits) {
  return moe::route(logits, L.num_experts_per_tok,
                    moe::parse_router(L.router, "decoder_layer"), L.norm_topk_prob);
}

// The experts' LoRA factors in the experts' compute dtype (PEFT casts them to the expert
// weight's dtype before it folds them in), and their scalings.
moe::ExpertLora experts_lora(const Layer& L, at::ScalarType dt) {
  moe::ExpertLora l;
  if (!L.experts_lora()) return l;
  auto get = [&](MoeSlot m) {
    const at::Tensor& t = L.moe_w(m);
    return t.defined() ? t.to(dt) : t;
  };
  l.gate_up_a = get(kExpertsGateUpLoraA), l.gate_up_b = get(kExpertsGateUpLoraB);
  l.down_a = get(kExpertsDownLoraA), l.down_b = get(kExpertsDownLoraB);
  l.gate_up_scale = L.expert_lora_scaling[0], l.down_scale = L.expert_lora_scaling[1];
  return l;
}

// The MoE output of rows m from their routing; shared: the shared expert's output (undefined
// without one).
at::Tensor moe_output(const Layer& L, const at::Tensor& m, const at::Tensor& shared,
                      const at::Tensor& idx, const at::Tensor& w) {
  const at::Tensor gate_up = L.cast(L.moe_w(kExpertsGateUp));
  at::Tensor y = moe::experts_forward(m, idx, w, gate_up, L.cast(L.moe_w(kExpertsDown)),
                                      parse_activation(L.activation, "decoder_layer"),
                                      experts_lora(L, gate_up.scalar_type()));
  if (!shared.defined()) return y;
  if (!L.moe_w(kSharedGate).defined()) return y.add_(shared);
  return y.add_(at::linear(m, L.cast(L.moe_w(kSharedGate))).sigmoid_() * shared);
}

// Backward of moe_output for dy (T, H) (compute dtype): adds the router's, the experts' and the
// shared gate's gradients to g; returns (d m of those, d of the shared expert's output or
// undefined without one). shared: the shared expert's output (read with a shared gate only).
// dlogits_out: the gradient that reached the router logits the op returned (router_logits;
// undefined: none), added to the routing's own, as autograd sums the two uses of HF's logits.
// dprob (E,): the gradient that reached the probability sums of router_stats (undefined:
// none), added through moe::router_stats_backward with the rows' weights stat_w.
std::tuple<at::Tensor, at::Tensor> moe_backward(const Layer& L, const at::Tensor& dy,
                                                const at::Tensor& m, const at::Tensor& shared,
                                                const at::Tensor& idx, const at::Tensor& w,
                                                const at::Tensor& dlogits_out,
                                                const at::Tensor& dprob,
                                                const at::Tensor& stat_w,
                                                const std::vector<bool>& needs, Grads& g) {
  const at::Tensor wr = L.cast(L.moe_w(kRouter));
  // a later token chunk adds its expert gradients into the earlier chunks' sums in place
  auto sum_of = [&](MoeSlot m) {
    at::Tensor& sum = g.dw[slot(m)];
    return sum.defined() ? &sum : nullptr;
  };
  moe::ExpertNeeds en;
  en.gate_up = needs[slot(kExpertsGateUp)], en.down = needs[slot(kExpertsDown)];
  en.gate_up_a = needs[slot(kExpertsGateUpLoraA)];
  en.gate_up_b = needs[slot(kExpertsGateUpLoraB)];
  en.down_a = needs[slot(kExpertsDownLoraA)], en.down_b = needs[slot(kExpertsDownLoraB)];
  const at::Tensor gate_up = L.cast(L.moe_w(kExpertsGateUp));
  moe::ExpertGrads eg = moe::experts_backward(
      dy, m, idx, w, gate_up, L.cast(L.moe_w(kExpertsDown)),
      parse_activation(L.activation, "decoder_layer"), en, sum_of(kExpertsGateUp),
      sum_of(kExpertsDown), experts_lora(L, gate_up.scalar_type()));
  if (eg.dgate_up.defined()) g.add(slot(kExpertsGateUp), eg.dgate_up);
  if (eg.ddown.defined()) g.add(slot(kExpertsDown), eg.ddown);
  // the factors' gradients, summed over the token chunks as a dense adapter's (Grads::add)
  const std::pair<MoeSlot, const at::Tensor*> factor_grads[] = {
      {kExpertsGateUpLoraA, &eg.dgate_up_a}, {kExpertsGateUpLoraB, &eg.dgate_up_b},
      {kExpertsDownLoraA, &eg.ddown_a}, {kExpertsDownLoraB, &eg.ddown_b}};
  for (const auto& [m_slot, d] : factor_grads)
    if (d->defined()) g.add(slot(m_slot), *d);
  const at::Tensor logits = at::linear(m, wr);
  at::Tensor dlogits =
      moe::route_backward(logits, idx, eg.dw, moe::parse_router(L.router, "decoder_layer"),
                          L.norm_topk_prob)
          .to(m.scalar_type());
  if (dlogits_out.defined()) dlogits.add_(dlogits_out.to(m.scalar_type()));
  if (dprob.defined())
    dlogits.add_(moe::router_stats_backward(logits, dprob, stat_w).to(m.scalar_type()));
  if (needs[slot(kRouter)]) g.addmm(slot(kRouter), dlogits.t(), m);
  at::Tensor dm = eg.dm.add_(dlogits.mm(wr));
  at::Tensor dshared;
  if (L.has_dense_mlp()) {
    dshared = dy;
    if (L.moe_w(kSharedGate).defined()) {
      const at::Tensor wg = L.cast(L.moe_w(kSharedGate));
      const at::Tensor sg = at::linear(m, wg).sigmoid_();  // (T, 1)
      const at::Tensor dz = (dy * shared).sum(1, true) * sg * (1 - sg);
      if (needs[slot(kSharedGate)]) g.addmm(slot(kSharedGate), dz.t(), m);
      dm.add_(dz.mm(wg));
      dshared = dy * sg;
    }
  }
  return {dm, dshared};
}

// Rows per token chunk of the MLP: the SwiGLU intermediates of a chunk, three (rows, I)
// tensors at the compute width (the Triton backward's dh, dgate and dup; the CPU kernels
// chunk further within the same cap), or an MoE layer's (ffn_row_width), within the byte cap,
// and on CUDA at least kGemmMinRows rows (csrc/chunking.h); or the option chunk_rows when
// given. A sequence that fits is one chunk, computed exactly as written out.
int64_t mlp_chunk_rows(const Layer& L, const at::Tensor& h) {
  if (L.chunk_rows) return *L.chunk_rows;  // the caller's rows (checked >= 1 in make_layer)
  return chunking::mlp_chunk_rows(ffn_row_width(L, h.size(-1)), h.element_size(),
                                  chunking::chunk_bytes(),
                                  h.is_cuda() ? chunking::kGemmMinRows : 0);
}

// y = h + down(act(gate(m)) * up(m)) over token chunks (rows of h viewed as (T, H)), each
// chunk's output written in place; with `keep_gate_up` (fast, which saves the whole-sequence
// gate/up) one chunk, filling r.gate/up. h's first row is the global token row row0: the
// SwiGLU ops hash LoRA dropout masks on global rows (dropout_row_offset), so the chunks change
// no mask. r's rows are h's (a caller passes mlp_rows of its residuals): an MoE layer's
// routing and router logits are written there.
// The rows [t0, t0 + n) of the per-token residuals an MLP call fills or reads (views of r's):
// fast's gate/up, an MoE layer's routing, its router logits and their gradient; the router
// statistics (sums over the tokens) and their gradient whole.
// Rows [t0, t0 + n) of t, or t itself when undefined.
at::Tensor rows_of(const at::Tensor& t, int64_t t0, int64_t n) {
  return t.defined() ? t.narrow(0, t0, n) : t;
}

Residuals mlp_rows(const Residuals& r, int64_t t0, int64_t n) {
  const auto rows = [&](const at::Tensor& t) { return rows_of(t, t0, n); };
  Residuals rc;
  rc.gate = rows(r.gate), rc.up = rows(r.up);
  rc.topk_idx = rows(r.topk_idx), rc.topk_w = rows(r.topk_w);
  rc.router_logits = rows(r.router_logits), rc.drouter_logits = rows(r.drouter_logits);
  rc.router_stats = r.router_stats, rc.drouter_stats = r.drouter_stats;  // (3, E): sums
  rc.stats_w = rows(r.stats_w);
  return rc;
}

at::Tensor mlp_forward(const at::Tensor& h, const Layer& L, bool keep_gate_up, Residuals& r,
                       int64_t row0) {
  const MlpLora l = mlp_lora(L, false);
  keep_gate_up = keep_gate_up && !L.moe();
  const at::Tensor h2 = flat2(h);
  const int64_t T = h2.size(0);
  const int64_t rows = keep_gate_up ? T : mlp_chunk_rows(L, h);
  at::Tensor out;
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t tc = std::min(rows, T - t0);
    const at::Tensor hc = h2.narrow(0, t0, tc);
    const at::Tensor m = mlp_input(hc, L);
    at::Tensor y2, gate, up;
    if (L.has_dense_mlp()) {
      std::tie(y2, gate, up) = kernel::swiglu_fwd(
          m, L.cast(L.proj(kGate)), L.cast(L.proj(kUp)), L.cast(L.proj(kDown)),
          L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
          L.cast_opt(L.proj(kDown, kBias)), l.lora, l.scaling, keep_gate_up, l.dropout, l.seed,
          row0 + t0, l.streams, L.activation);
    }
    if (L.moe()) {  // route the chunk's tokens (r's rows start at this call's first row)
      const at::Tensor logits = router_logits(L, m);
      if (r.router_logits.defined()) r.router_logits.narrow(0, t0, tc).copy_(logits);
      if (r.router_stats.defined())
        r.router_stats.add_(moe::router_stats(logits, L.num_experts_per_tok,
                                              rows_of(r.stats_w, t0, tc)));
      auto [idx, w] = moe_route(L, logits);
      r.topk_idx.narrow(0, t0, tc).copy_(idx);
      r.topk_w.narrow(0, t0, tc).copy_(w);
      y2 = moe_output(L, m, y2, idx, w);
    }
    if (keep_gate_up) r.gate = gate, r.up = up;
    y2 = norm_fwd(L, kMlpOutNorm, y2);
    if (tc == T) return h + L.residual_scaled(y2).view(h.sizes());
    if (!out.defined())
      out = at::empty({T, h2.size(1)}, h.options().dtype(at::result_type(hc, y2)));
    at::Tensor out_c = out.narrow(0, t0, tc);
    at::add_out(out_c, hc, L.residual_scaled(y2));
  }
  return out.view(h.sizes());
}


// The MLP's output before its output norm, for token rows starting at the global row row0,
// from fast's saved gate/up rows: down(act(gate) * up) (+ the down adapter's term) as
// swiglu_fwd computes it (the product in the compute dtype, rounded once; the adapter's term
// in its LoRA dtype with the forward's dropout mask, added in place), without the gate/up
// GEMMs a full SwiGLU forward would redo.
at::Tensor mlp_down_from_gate_up(const Layer& L, const at::Tensor& gate, const at::Tensor& up,
                                 int64_t row0) {
  const at::ScalarType dt = gate.scalar_type(), cdt = checks::compute_dtype(dt);
  const at::Tensor h = swiglu_product(gate.to(cdt), up.to(cdt), dt,
                                      parse_activation(L.activation, "decoder_layer"));
  at::Tensor y = at::linear(h, L.cast(L.proj(kDown)), L.cast_opt(L.proj(kDown, kBias)));
  if (L.has_lora(kDown)) {
    const at::Tensor a = lora_factor(L, kDown, kLoraA, true);
    const at::Tensor b = lora_factor(L, kDown, kLoraB, true);
    const at::ScalarType ld = at::promote_types(cdt, checks::compute_dtype(a.scalar_type()));
    const at::Tensor u = lora_input(L, kDown, h.to(ld), row0).mm(a.to(ld).t());  // (T, r)
    y.add_(u.mm(b.to(ld).t()).mul_(L.lora_scale(kDown)));
  }
  return y;
}

// The dense MLP weights' gradient sums that swiglu_bwd adds a chunk's gradients to inside its
// GEMMs (its dw_*_sum, sum_beta: it returns sum_beta * sum + dw, which becomes g's sum), where
// chunking::chunk_sum chooses it: g's float32 sums (the weights' own dtype for float32 /
// float64 operands); the first chunk passes an uninitialised one with beta 0. Elsewhere (one
// chunk; half precision on the CPU) nullopt, and Grads::add sums what the op returns.
std::tuple<std::array<OptTensor, 3>, double> mlp_weight_sums(const Layer& L, const at::Tensor& m,
                                                              const std::vector<bool>& needs,
                                                              Grads& g) {
  std::array<OptTensor, 3> sums;
  const bool half = m.element_size() < 4;
  bool first = false, later = false;
  for (size_t j = 0; j < kMlpProjs.size(); ++j) {
    const int64_t s = slot(kMlpProjs[j], kWeight);
    if (!needs[s] || chunking::chunk_sum(g.chunked, half, m.is_cuda(),
                                         half && gemm_fp32_out_ok(m)) !=
                         chunking::ChunkSum::kInGemm)
      continue;
    at::Tensor& acc = g.dw[s];
    const at::ScalarType dt = half ? at::kFloat : m.scalar_type();
    if (!acc.defined()) {
      acc = at::empty(L.proj(kMlpProjs[j]).sizes(), m.options().dtype(dt));
      first = true;
    } else {
      if (acc.scalar_type() != dt) acc = acc.to(dt);
      later = true;
    }
    sums[j] = acc;
  }
  TORCH_INTERNAL_ASSERT(!(first && later), "decoder_layer: the MLP weights' sums started apart");
  return {sums, first ? 0.0 : 1.0};
}

// The MLP adapters' gradient sums that swiglu_bwd adds a chunk's gradients to (its
// lora_a_gate_sum .. lora_b_down_sum: it returns sum + d, which becomes g's sum; inside the
// adapter's GEMM in the Triton kernels): g's sums of the earlier chunks, float32 (float64) as
// the ops return them (the factors are widened, lora_factor); nullopt where there is none yet
// (the first chunk), so that the op's own result starts the sum (Grads::add).
std::array<OptTensor, 6> mlp_lora_sums(const Layer& L, const std::vector<int64_t>& order,
                                       const std::vector<bool>& needs, const Grads& g) {
  std::array<OptTensor, 6> sums;
  for (size_t k = 0; k < sums.size(); ++k) {
    const int64_t s = order[6 + k];
    const at::Tensor& acc = g.dw[s];
    if (needs[s] && L.at(s).defined() && acc.defined() && acc.element_size() >= 4) sums[k] = acc;
  }
  return sums;
}

// Backward of mlp_forward over the same token chunks: per chunk the norm is recomputed, the
// SwiGLU backward runs (its (rows, I) work one chunk at a time; fast reads its saved gate/up
// rows), and the chunk's dx rows are written in place; weight, bias, adapter and norm
// gradients sum over the chunks (Grads::add).
at::Tensor mlp_backward(const at::Tensor& dy, const at::Tensor& h, const Layer& L,
                        const Residuals& r, const std::vector<bool>& needs, Grads& g,
                        int64_t row0) {
  // The ops' gradient order: weights, biases, then the adapters, as in mlp_lora.
  std::vector<int64_t> order;
  for (ProjPart part : {kWeight, kBias})
    for (Proj p : kMlpProjs) order.push_back(slot(p, part));
  for (Proj p : kMlpProjs)
    for (ProjPart part : {kLoraA, kLoraB}) order.push_back(slot(p, part));
  c10::List<bool> wanted;
  for (int64_t s : order) wanted.push_back(needs[s]);
  const MlpLora l = mlp_lora(L, true);
  const at::Tensor h2 = flat2(h), dy2 = flat2(dy);
  const int64_t T = h2.size(0);
  const int64_t rows = mlp_chunk_rows(L, h);
  const bool one = rows >= T;
  g.chunked = g.chunked || !one;
  at::Tensor dx;
  // dx of rows t0 .. t0 + tc: dy plus the gradient dhn through the MLP's input norm
  auto add_dx = [&](const at::Tensor& dyc, const at::Tensor& dhn, int64_t t0, int64_t tc) {
    if (one) {
      dx = dy + dhn.view(h.sizes());
      return;
    }
    if (!dx.defined())
      dx = at::empty({T, h2.size(1)}, dy.options().dtype(at::result_type(dyc, dhn)));
    at::Tensor dx_c = dx.narrow(0, t0, tc);
    at::add_out(dx_c, dyc, dhn);
  };
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t tc = std::min(rows, T - t0);
    const at::Tensor hc = h2.narrow(0, t0, tc), dyc = dy2.narrow(0, t0, tc);
    OptTensor gate, up;
    if (r.gate.defined()) gate = r.gate.narrow(0, t0, tc), up = r.up.narrow(0, t0, tc);
    // an MoE layer's routing of these rows (r's rows start at this call's first row)
    at::Tensor idx, w, dlogits, dprob, stat_w;
    if (L.moe()) idx = r.topk_idx.narrow(0, t0, tc), w = r.topk_w.narrow(0, t0, tc);
    if (r.drouter_logits.defined()) dlogits = r.drouter_logits.narrow(0, t0, tc);
    if (r.drouter_stats.defined())  // only the probability sums carry a gradient
      dprob = r.drouter_stats[1], stat_w = rows_of(r.stats_w, t0, tc);
    const at::Tensor m = mlp_input(hc, L);
    at::Tensor dmlp = L.residual_scaled(L.cast(dyc));  // d of the MLP's (normed) output
    // the shared expert's output: for the output norm's backward, and the shared gate's
    at::Tensor shared;
    const bool need_dense_out =
        L.has_dense_mlp() && (L.has_norm(kMlpOutNorm) || L.moe_w(kSharedGate).defined());
    if (need_dense_out) {
      shared = gate ? mlp_down_from_gate_up(L, *gate, *up, row0 + t0)
                    : std::get<0>(kernel::swiglu_fwd(
                          m, L.cast(L.proj(kGate)), L.cast(L.proj(kUp)), L.cast(L.proj(kDown)),
                          L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
                          L.cast_opt(L.proj(kDown, kBias)), l.lora, l.scaling, false, l.dropout,
                          l.seed, row0 + t0, l.streams, L.activation));
    }
    if (L.has_norm(kMlpOutNorm)) {  // its norm's backward reads the MLP's output
      const at::Tensor y2 = L.moe() ? moe_output(L, m, shared, idx, w) : shared;
      dmlp = L.cast(norm_bwd(L, kMlpOutNorm, dmlp, y2, needs, g));
    }
    at::Tensor dm_moe;
    if (L.moe()) {
      std::tie(dm_moe, dmlp) =
          moe_backward(L, dmlp, m, shared, idx, w, dlogits, dprob, stat_w, needs, g);
      if (!dmlp.defined()) {  // no shared expert: the routed experts' share is all
        const at::Tensor dhn = norm_bwd(L, kPostNorm, dm_moe, hc, needs, g);
        add_dx(dyc, dhn, t0, tc);
        continue;
      }
    }
    const auto [sums, sum_beta] = mlp_weight_sums(L, m, needs, g);
    const std::array<OptTensor, 6> lora_sums = mlp_lora_sums(L, order, needs, g);
    auto [dm2, dwg, dwu, dwd, dbg, dbu, dbd, dlora] = kernel::swiglu_bwd(
        dmlp, m, L.cast(L.proj(kGate)), L.cast(L.proj(kUp)), L.cast(L.proj(kDown)),
        L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
        L.cast_opt(L.proj(kDown, kBias)), l.lora, l.scaling, gate, up, wanted, l.dropout, l.seed,
        row0 + t0, l.streams, L.activation, sums[0], sums[1], sums[2], sum_beta,
        lora_sums[0], lora_sums[1], lora_sums[2], lora_sums[3], lora_sums[4], lora_sums[5]);
    const std::array<at::Tensor*, 6> base = {&dwg, &dwu, &dwd, &dbg, &dbu, &dbd};
    for (size_t j = 0; j < order.size(); ++j) {
      if (!needs[order[j]]) continue;
      const size_t k = j - base.size();  // the adapter entry, for j >= 6
      if (j < 3 && sums[j]) g.dw[order[j]] = *base[j];  // the new sum, from inside the GEMM
      else if (j >= base.size() && lora_sums[k]) g.dw[order[j]] = dlora[k];
      else g.add(order[j], j < base.size() ? *base[j] : dlora[k]);
    }
    if (dm_moe.defined()) dm2 = dm2 + dm_moe.view(dm2.sizes());
    const at::Tensor dhn = norm_bwd(L, kPostNorm, dm2, hc, needs, g);
    add_dx(dyc, dhn, t0, tc);
  }
  return one ? dx : dx.view(h.sizes());
}

// ---- token chunks --------------------------------------------------------------------------
//
// The layer walks its tokens in chunks, so that the only sequence-sized tensors of a call are
// x and y (and their gradients), k and v, dk and dv (float32 sums) and what the preset keeps.
// A chunk is the batch rows [b0, b0 + nb) at the positions [s0, s0 + sc): whole sequences
// (s0 = 0, sc = S) or a piece of one (nb = 1), so that its tokens are the consecutive rows
// t0() .. t0() + nb * sc - 1 of x viewed as (B * S, H), the rows LoRA dropout hashes.
struct Chunk {
  int64_t b0, nb, s0, sc, S;
  // Under sequence_parallel (nb = 1) the global token row of position 0 of sequence b0 is
  // b0 * row_stride + row_base; 0: the local rows.
  int64_t row_stride = 0, row_base = 0;
  int64_t t0() const { return b0 * S + s0; }
  // The token row LoRA dropout hashes for the chunk's first token: t0(), or the global row.
  int64_t row() const { return row_stride == 0 ? t0() : b0 * row_stride + row_base + s0; }
  // The chunk of t (batch on dim 0, positions on dim `dim`).
  at::Tensor of(const at::Tensor& t, int64_t dim = 1) const {
    return t.narrow(0, b0, nb).narrow(dim, s0, sc);
  }
  // The keys the chunk's queries may see (the layer is causal): positions 0 .. s0 + sc - 1.
  at::Tensor keys(const at::Tensor& t, int64_t dim) const {
    return t.narrow(0, b0, nb).narrow(dim, 0, s0 + sc);
  }
  at::Tensor keys(const OptTensor& t) const { return t ? keys(*t, 1) : at::Tensor(); }
  // cos / sin (B or 1, S, D) at the chunk's positions.
  at::Tensor table(const at::Tensor& t) const {
    return t.size(0) == 1 ? t.narrow(1, s0, sc) : of(t);
  }
};

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The layer input as the backward reads it, a token chunk at a time: x itself, or, when the
// input stayed in host memory (ckpt_ext.offload's streamed inputs), `host`, each chunk copied
// to the device as the walk reads it (on the compute stream; from pinned memory the copy does
// not block the host). x is then a stand-in with x's shape, dtype and device (one NaN,
// expanded), for the sizes and options the backward reads: a read of its values would show.
struct Input {
  at::Tensor x, host;
  at::Tensor of(const Chunk& c) const {
    return host.defined() ? c.of(host).to(x.options(), /*non_blocking=*/true, /*copy=*/true)
                          : c.of(x);
  }
};

// Tokens per chunk of the attention sublayer or the whole layer: the byte cap
// (csrc/chunking.h) over a chunk's per-token working set, at the compute width and at least
// float32 (the CPU kernels' precision): the attention's q, out, dout and dq (4 Hq D) and,
// with the MLP, its three (rows, I) tensors (3 I), which the MLP's backward holds while the
// chunk's q and out wait for the attention's.
//
// On CUDA at least chunking::cuda_min_rows: rows whose attention fills the device's
// multiprocessors (two waves of programs over the layer's query heads), and kGemmMinRows for
// the weights' GEMMs. The option chunk_rows, when given, is the rows instead (no cap, no
// minimum).
int64_t layer_chunk_rows(const Layer& L, const at::Tensor& x) {
  if (L.chunk_rows) return *L.chunk_rows;
  const int64_t min_rows =
      x.is_cuda() ? chunking::cuda_min_rows(chunking::cuda_sms(), L.num_heads) : 0;
  return chunking::layer_chunk_rows(L.proj(kQ).size(0),
                                   has_mlp(L.part_id) ? ffn_row_width(L, x.size(2)) : 0,
                                   at::elementSize(L.act_dtype(x)), chunking::chunk_bytes(),
                                   min_rows);
}

std::vector<Chunk> layer_chunks(const Layer& L, const at::Tensor& x) {
  const int64_t B = x.size(0), S = x.size(1), rows = layer_chunk_rows(L, x);
  std::vector<Chunk> cs;
  if (S <= rows) {
    const int64_t nb = rows / S;
    for (int64_t b0 = 0; b0 < B; b0 += nb) cs.push_back({b0, std::min(nb, B - b0), 0, S, S});
  } else {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s0 = 0; s0 < S; s0 += rows) cs.push_back({b, 1, s0, std::min(rows, S - s0), S});
  }
  return cs;
}

// (B, S, Hn, D) memory viewed (B, Hn, S, D): the layout of q, k, v, out and their gradients.
at::Tensor heads_buffer(const at::Tensor& x, int64_t hn, int64_t d, at::TensorOptions o) {
  return at::empty({x.size(0), x.size(1), hn, d}, o).transpose(1, 2);
}

// ---- attention sublayer --------------------------------------------------------------------

// (B, Hq, S, D) -> (B, S, Hq * D)
at::Tensor merge_heads(const at::Tensor& out) {
  return out.transpose(1, 2).reshape({out.size(0), out.size(2), out.size(1) * out.size(3)});
}

// RoPE (forward or backward) of q alone or of k alone: the ops rotate a (q, k) pair, so one
// head of t stands in for the other tensor and its result is dropped.
at::Tensor rope_one(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin,
                    bool backward) {
  const at::Tensor other = t.narrow(1, 0, 1);
  return std::get<0>(backward ? kernel::rope_bwd(t, other, cos, sin)
                              : kernel::rope_fwd(t, other, cos, sin));
}

// Interleaved RoPE (rope_interleaved: the first R dims rotate in pairs (2i, 2i + 1) by the
// angle of the tables' column i) is the kernels' half-split rotation between two permutations
// of the head dims: rope_il(t) = P^T rope(P t), where P t lists the even dims of the first R,
// then their odd dims, then the dims past R (which pass through). P is orthogonal and RoPE
// linear, so the backward is P^T rope_bwd(P dt) alike; the rope kernels stay as they are, at the
// cost of two copies of q and k. P t (to_half_split) or P^T t, in t's layout
// (checks::rope_out_like).
at::Tensor permute_rotary_dims(const at::Tensor& t, int64_t R, bool to_half_split) {
  at::Tensor out = checks::rope_out_like(t);
  const int64_t h = R / 2, D = t.size(-1);
  for (int64_t parity = 0; parity < 2; ++parity) {  // even dims <-> first half, odd <-> second
    auto interleaved = [&](const at::Tensor& u) { return u.slice(-1, parity, R, 2); };
    auto half = [&](const at::Tensor& u) { return u.narrow(-1, parity * h, h); };
    if (to_half_split) half(out).copy_(interleaved(t));
    else interleaved(out).copy_(half(t));
  }
  if (R < D) out.narrow(-1, R, D - R).copy_(t.narrow(-1, R, D - R));
  return out;
}

// RoPE of q and k together, either of them absent (undefined); `interleaved`: the pairs
// (2i, 2i + 1) rotate instead of (i, i + R/2).
std::tuple<at::Tensor, at::Tensor> rope_pair(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             bool backward, bool interleaved) {
  if (interleaved) {
    const int64_t R = cos.size(-1);
    auto map = [R](const at::Tensor& t, bool to_half_split) {
      return t.defined() ? permute_rotary_dims(t, R, to_half_split) : t;
    };
    auto [qr, kr] = rope_pair(map(q, true), map(k, true), cos, sin, backward, false);
    return {map(qr, false), map(kr, false)};
  }
  if (!q.defined()) return {at::Tensor(), rope_one(k, cos, sin, backward)};
  if (!k.defined()) return {rope_one(q, cos, sin, backward), at::Tensor()};
  return backward ? kernel::rope_bwd(q, k, cos, sin) : kernel::rope_fwd(q, k, cos, sin);
}

// q/k/v of a chunk from its input x (nb, sc, H). n: the normed input in the compute dtype;
// q_lin/k_lin: (nb, sc, H*, D) inputs of the optional q/k norms, the projections (or, with
// qk_norm_after_rope, the projections after RoPE); q, k: (nb, H*, sc, D) views of
// (nb, sc, H*, D) memory after norms and RoPE; v: a (nb, Hkv, sc, D) view of its projection.
// `which` leaves out the keys or the queries.
enum class Heads { kAll, kQueries, kKeys };

struct Projected {
  at::Tensor n, q_lin, k_lin, q, k, v;
};

// RoPE rotates the projections before their norms (qk_norm_after_rope with q/k norms).
bool rope_before_norm(const Layer& L) { return L.qk_norm_after_rope && L.qk_norm(); }

// (nb, sc, H*, D) <-> (nb, H*, sc, D) views; an undefined tensor stays undefined.
at::Tensor swap_heads(const at::Tensor& t) { return t.defined() ? t.transpose(1, 2) : t; }

Projected project(const at::Tensor& x, const Layer& L, const Chunk& c, Heads which) {
  const int64_t b = x.size(0), s = x.size(1), d = L.head_dim(), t0 = c.row();
  const bool rope_first = rope_before_norm(L);
  Projected p;
  p.n = L.cast(norm_fwd(L, kInputNorm, x));
  at::Tensor qh, kh;
  if (which != Heads::kKeys) p.q_lin = proj_fwd(L, kQ, p.n, t0).view({b, s, L.num_heads, d});
  if (which != Heads::kQueries) {
    p.k_lin = proj_fwd(L, kK, p.n, t0).view({b, s, L.num_kv_heads, d});
    p.v = proj_fwd(L, kV, p.n, t0).view({b, s, L.num_kv_heads, d}).transpose(1, 2);
  }
  // rope keeps its input's layout: q, k stay (B, H, S, D) views of (B, S, H, D) memory, the
  // layout attention reads, and their gradients come back alike (merged with views).
  auto rope = [&](const at::Tensor& q, const at::Tensor& k) {
    return rope_pair(q, k, c.table(*L.cos), c.table(*L.sin), /*backward=*/false,
                     L.rope_interleaved);
  };
  if (rope_first) {  // the norms' inputs are the rotated projections, (nb, sc, H*, D)
    auto [qr, kr] = rope(swap_heads(p.q_lin), swap_heads(p.k_lin));
    p.q_lin = swap_heads(qr), p.k_lin = swap_heads(kr);
  }
  if (p.q_lin.defined()) qh = head_norm_fwd(L, kQNorm, p.q_lin).transpose(1, 2);
  if (p.k_lin.defined()) kh = head_norm_fwd(L, kKNorm, p.k_lin).transpose(1, 2);
  std::tie(p.q, p.k) = rope_first ? std::make_tuple(qh, kh) : rope(qh, kh);
  if (p.q.defined()) p.q = L.cast(p.q);
  if (p.k.defined()) p.k = L.cast(p.k);
  return p;
}

// The attention's keys over whole sequences: k (after its norm and RoPE) and v, (B, Hkv, S, D)
// views of (B, S, Hkv, D) memory; with per-head q/k norms, k_lin (B, S, Hkv, D), k before its
// norm, which the norm's backward reads.
struct Keys {
  at::Tensor k, v, k_lin;
};

Keys allocate_keys(const at::Tensor& x, const Layer& L, bool with_k_lin) {
  const auto act = x.options().dtype(L.act_dtype(x));
  const int64_t d = L.head_dim();
  Keys keys{heads_buffer(x, L.num_kv_heads, d, act), heads_buffer(x, L.num_kv_heads, d, act), {}};
  if (with_k_lin) keys.k_lin = heads_buffer(x, L.num_kv_heads, d, act).transpose(1, 2);
  return keys;
}

void store_keys(Keys& keys, const Chunk& c, const Projected& p) {
  c.of(keys.k, 2).copy_(p.k);
  c.of(keys.v, 2).copy_(p.v);
  if (keys.k_lin.defined()) c.of(keys.k_lin).copy_(p.k_lin);
}

// Every chunk's keys, before any query needs them.
Keys project_keys(const Input& in, const Layer& L, const std::vector<Chunk>& cs) {
  Keys keys = allocate_keys(in.x, L, L.qk_norm());
  for (const Chunk& c : cs) store_keys(keys, c, project(in.of(c), L, c, Heads::kKeys));
  return keys;
}

// The attention of a chunk's queries q (nb, Hq, sc, D) against the keys they may see, from k
// and v over the chunk's whole sequences: (out, lse).
std::tuple<at::Tensor, at::Tensor> attend(const Layer& L, const Chunk& c, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v) {
  return kernel::attention_fwd(q, c.keys(k, 2), c.keys(v, 2), opt(c.keys(L.key_padding_mask)),
                               opt(c.keys(L.segment_ids)), L.window, /*causal=*/true, L.scale,
                               c.s0, L.softcap);
}

// ---- HF eager attention's rows with nothing to attend ---------------------------------------
// Eager attention adds the dtype's minimum to every masked score, so a query row that may
// attend no key (a left-padded position) has all scores equal: it averages every value
// uniformly (future and padded keys included) and its gradient reaches q, every k and every v.
// The attention kernels return 0 for such rows (lse = -inf); with uniform_empty_rows these
// corrections reproduce eager's result in O(S * D^2), with no host sync. They are linear in
// sums over the empty rows, so the rows may come chunk by chunk.

// (B, Hq, S, 1) of `dtype`, 1 on empty rows.
at::Tensor empty_rows(const at::Tensor& lse, at::ScalarType dtype) {
  return at::isneginf(lse).unsqueeze(-1).to(dtype);
}

at::Tensor per_query_head(const at::Tensor& t, int64_t groups) {  // (B, Hkv, ...) -> (B, Hq, ...)
  return groups == 1 ? t : t.repeat_interleave(groups, 1);
}

at::Tensor per_kv_head(const at::Tensor& t, int64_t hkv) {  // (B, Hq, S, D) summed per group
  return t.view({t.size(0), hkv, -1, t.size(2), t.size(3)}).sum(2);
}

// The mean of the values over all keys, per query head: (B, Hq, 1, D) in v's dtype.
at::Tensor value_mean(const Layer& L, const at::Tensor& v) {
  return per_query_head(v.mean(2, /*keepdim=*/true), L.num_heads / L.num_kv_heads);
}

// out with its empty rows set to the mean value (vmean of the chunk's sequences).
at::Tensor fix_empty_rows_forward(const at::Tensor& out, const at::Tensor& lse,
                                  const at::Tensor& vmean) {
  at::Tensor fixed = at::empty_like(out);  // keeps out's (B, S, Hq, D) memory layout
  at::where_out(fixed, at::isneginf(lse).unsqueeze(-1), vmean.to(out.scalar_type()), out);
  return fixed;
}

// The backward's share of the empty rows. With d_i = dout_i on empty rows (0 elsewhere):
//   dq_i += (d_i (v^T k) - (d_i . vmean) kmean) * scale / S        row by row
//   dk_j += (v_j m^T - c) * scale / S,   dv_j += sum_i d_i / S       for every key, with
//   m = sum_i q_i d_i^T and c = sum_i (d_i . vmean) q_i             sums over the empty rows
// (the dS_ij = (dout_i . v_j - dout_i . vmean) / S of a uniform row). Tensors (B, Hq, ...)
// over whole sequences, float32 (float64 for float64 inputs).
struct EmptyRows {
  at::Tensor vk, kmean, vmean;  // v^T k (D, D), the key and value means, per query head
  at::Tensor m, c, dsum;        // the sums over the empty rows, added to chunk by chunk
  int64_t groups, S;
  at::ScalarType wide;

  EmptyRows(const Layer& L, const at::Tensor& k, const at::Tensor& v)
      : groups(L.num_heads / L.num_kv_heads),
        S(k.size(2)),
        wide(at::promote_types(k.scalar_type(), at::kFloat)) {
    const at::Tensor kf = k.to(wide), vf = v.to(wide);
    vk = per_query_head(vf.transpose(-1, -2).matmul(kf), groups);
    kmean = per_query_head(kf.mean(2, true), groups);
    vmean = per_query_head(vf.mean(2, true), groups);
    const int64_t b = k.size(0), d = k.size(3);
    const auto f = k.options().dtype(wide);
    m = at::zeros({b, L.num_heads, d, d}, f);
    c = at::zeros({b, L.num_heads, 1, d}, f);
    dsum = at::zeros({b, L.num_heads, 1, d}, f);
  }

  // dq's share for a chunk's queries; adds the chunk's empty rows to the sums.
  at::Tensor query_fix(const Layer& L, const Chunk& ch, const at::Tensor& dout,
                       const at::Tensor& lse, const at::Tensor& q) {
    auto rows = [&](const at::Tensor& t) { return t.narrow(0, ch.b0, ch.nb); };
    const at::Tensor d = dout.to(wide) * empty_rows(lse, wide);  // (nb, Hq, sc, D)
    const at::Tensor qf = q.to(wide);
    const at::Tensor dvm = (d * rows(vmean)).sum(-1, true);    // dout_i . vmean
    rows(m).add_(qf.transpose(-1, -2).matmul(d));
    rows(c).add_((dvm * qf).sum(2, true));
    rows(dsum).add_(d.sum(2, true));
    return d.matmul(rows(vk)).mul_(L.scale / S).sub_(dvm * rows(kmean) * L.scale);
  }

  // dk's and dv's shares for a chunk's keys v (nb, Hkv, sc, D), once every empty row is in.
  std::tuple<at::Tensor, at::Tensor> key_fix(const Layer& L, const Chunk& ch,
                                             const at::Tensor& v) const {
    auto rows = [&](const at::Tensor& t) { return t.narrow(0, ch.b0, ch.nb); };
    const at::Tensor vq = per_query_head(v.to(wide), groups);
    const at::Tensor dk = vq.matmul(rows(m).transpose(-1, -2)).sub_(rows(c)).mul_(L.scale / S);
    const at::Tensor dv = (rows(dsum) / S).expand_as(vq).contiguous();
    return {per_kv_head(dk, L.num_kv_heads), per_kv_head(dv, L.num_kv_heads)};
  }
};

// ---- the attention sublayer and the layer over token chunks ---------------------------------

// Part "attention": y = x + o_proj(attention(...)); part "layer": y = h + mlp(h) on top of it.
// Chunk by chunk in order: a chunk projects its own q, k, v (k, v stored whole for the chunks
// after it) and attends to the keys it sees. Eager's empty rows average all of v, so with
// uniform_empty_rows every key is projected first. fast keeps the whole h and gate/up, so its
// MLP runs after the attention over the whole sequence. Fills the kept residuals.
at::Tensor attention_layer_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  const int64_t d = L.head_dim();
  const bool layer = L.part_id == Part::kLayer, fast = L.preset_id == Preset::kFast;
  const bool keep = L.preset_id != Preset::kMinMemory;  // out, lse, and for the layer h
  const std::vector<Chunk> cs = layer_chunks(L, x);
  const bool one = cs.size() == 1;
  const bool keys_first = !one && L.uniform_empty_rows;
  Keys keys;
  at::Tensor vmean, y;
  if (keys_first) {
    keys = project_keys(Input{x, {}}, L, cs);
    vmean = value_mean(L, keys.v);
  } else if (!one) {
    keys = allocate_keys(x, L, false);
  }
  if (!one) {
    const auto act = x.options().dtype(L.act_dtype(x));
    if (keep) {
      r.out = heads_buffer(x, L.num_heads, d, act);
      r.lse = at::empty({x.size(0), L.num_heads, x.size(1)}, x.options().dtype(at::kFloat));
    }
    if (fast) r.q = heads_buffer(x, L.num_heads, d, act);
  }
  for (const Chunk& c : cs) {
    const at::Tensor xc = c.of(x);
    const Projected p = project(xc, L, c, keys_first ? Heads::kQueries : Heads::kAll);
    if (!one && !keys_first) store_keys(keys, c, p);
    const at::Tensor& k = one ? p.k : keys.k;
    const at::Tensor& v = one ? p.v : keys.v;
    auto [out, lse] = attend(L, c, p.q, k, v);
    if (L.uniform_empty_rows) {
      out = fix_empty_rows_forward(out, lse, one ? value_mean(L, v) : vmean.narrow(0, c.b0, c.nb));
    }
    // The kernels return out as a (B, Hq, S, D) view of (B, S, Hq, D) memory, so merge_heads is
    // a view; this is a no-op for them and keeps the residual's layout fixed for any kernel.
    out = out.transpose(1, 2).contiguous().transpose(1, 2);
    at::Tensor h = xc + L.residual_scaled(
                            norm_fwd(L, kAttnOutNorm, proj_fwd(L, kO, merge_heads(out), c.t0())));
    if (one) {
      if (fast) r.q = p.q, r.k = p.k, r.v = p.v;
      if (keep) r.out = out, r.lse = lse;
      if (!layer) return h;
      if (keep) r.h = h.contiguous();
      return mlp_forward(keep ? r.h : h, L, fast, r, 0);
    }
    if (fast) c.of(r.q, 2).copy_(p.q);
    if (keep) c.of(r.out, 2).copy_(out), c.of(r.lse, 2).copy_(lse);
    if (layer && keep) {
      if (!r.h.defined()) r.h = at::empty(x.sizes(), h.options());
      c.of(r.h).copy_(h);
    }
    if (layer && !fast) {
      Residuals rc = mlp_rows(r, c.t0(), c.nb * c.sc);
      h = mlp_forward(h, L, false, rc, c.t0());
    }
    if (!layer || !fast) {
      if (!y.defined()) y = at::empty(x.sizes(), h.options());
      c.of(y).copy_(h);
    }
  }
  if (fast) r.k = keys.k, r.v = keys.v;
  return layer && fast ? mlp_forward(r.h, L, true, r, 0) : y;
}

// The rest of a chunk's attention backward once dq (or dk, dv) is known: RoPE's and the q/k
// norms' backward, the projections' backward into dn (the input norm's output gradient; with
// dn given, the keys' share is added to it). q side: dq, p.q_lin; key side: dk, dv, k_lin.
at::Tensor projections_backward(const Layer& L, const Chunk& c, const Projected& p,
                                const at::Tensor& dq, const at::Tensor& dk,
                                const at::Tensor& dv, const at::Tensor& k_lin, at::Tensor dn,
                                const std::vector<bool>& needs, Grads& g) {
  const int64_t t0 = c.row(), d = L.head_dim();
  auto rope_back = [&](const at::Tensor& q, const at::Tensor& k) {
    return rope_pair(q, k, c.table(*L.cos), c.table(*L.sin), /*backward=*/true,
                     L.rope_interleaved);
  };
  const at::Tensor n2 = flat2(p.n);
  const int64_t rows = n2.size(0);
  auto norm_back = [&](const at::Tensor& dh, const at::Tensor& lin, Norm which) {
    return head_norm_bwd(L, which, dh.transpose(1, 2), lin, needs, g);  // (nb, sc, H*, D)
  };
  // (dq_lin, dk_lin), (nb, sc, H*, D): through RoPE then the norms, or (qk_norm_after_rope)
  // through the norms, whose inputs q_lin/k_lin are the rotated projections, then RoPE
  at::Tensor dq_lin, dk_lin;
  if (rope_before_norm(L)) {
    auto [dqr, dkr] = rope_back(dq.defined() ? swap_heads(norm_back(dq, p.q_lin, kQNorm)) : dq,
                                dk.defined() ? swap_heads(norm_back(dk, k_lin, kKNorm)) : dk);
    dq_lin = swap_heads(dqr), dk_lin = swap_heads(dkr);
  } else {
    auto [dqh, dkh] = rope_back(dq, dk);
    if (dq.defined()) dq_lin = norm_back(dqh, p.q_lin, kQNorm);
    if (dk.defined()) dk_lin = norm_back(dkh, k_lin, kKNorm);
  }
  if (dq.defined()) {
    dn = proj_bwd(L, kQ, L.cast(dq_lin.reshape({rows, L.num_heads * d})), n2, needs, g, t0);
  }
  if (dk.defined()) {
    // the three parts of dn summed inside their GEMMs (proj_bwd's dsum)
    dn = proj_bwd(L, kK, L.cast(dk_lin.reshape({rows, L.num_kv_heads * d})), n2, needs, g, t0,
                  dn);
    dn = proj_bwd(L, kV, dv.transpose(1, 2).reshape({rows, L.num_kv_heads * d}), n2, needs, g,
                  t0, dn);
  }
  return dn;
}

// The input norm's backward of a chunk: dh + d(norm input).
at::Tensor input_norm_backward(const Layer& L, const at::Tensor& xc, const at::Tensor& dn,
                               const at::Tensor& dh, const std::vector<bool>& needs, Grads& g) {
  return dh + norm_bwd(L, kInputNorm, dn.view(xc.sizes()), xc, needs, g);
}

// Backward of attention_layer_forward, chunk by chunk from the last. A chunk recomputes its
// queries (and, without kept outputs, its attention and h), runs the MLP backward of its rows
// (part "layer"), then the o projection's and the attention's backward of its queries against
// the keys they see, adding into float32 dk / dv. The layer is causal, so once the chunks from
// c on are done, chunk c's keys have their whole gradient: their projections' backward and the
// input norm's follow at once, and h and dh never exist beyond one chunk. Eager's empty rows
// see every key, so with uniform_empty_rows (and more than one chunk) the keys wait for a
// second walk, with the q side's share of dn and dh kept whole in between.
Grads attention_layer_backward(const at::Tensor& dy, const Input& in, const Layer& L,
                               const Residuals& r, const std::vector<bool>& needs) {
  const at::Tensor& x = in.x;  // with a streamed input, for sizes and options only
  const int64_t d = L.head_dim();
  const bool layer = L.part_id == Part::kLayer;
  const std::vector<Chunk> cs = layer_chunks(L, x);
  const bool one = cs.size() == 1;
  const bool deferred = !one && L.uniform_empty_rows;
  Grads g(/*chunked=*/!one);
  // The keys: kept (fast), projected here before the first chunk, or the one chunk's own.
  Keys keys;
  if (r.k.defined()) {
    keys.k = r.k, keys.v = r.v;
  } else if (!one) {
    keys = project_keys(in, L, cs);
  }
  at::Tensor dk_acc, dv_acc, dn_q;
  if (!one) {
    const auto acc = x.options().dtype(at::promote_types(L.act_dtype(x), at::kFloat));
    dk_acc = heads_buffer(x, L.num_kv_heads, d, acc).zero_();
    dv_acc = heads_buffer(x, L.num_kv_heads, d, acc).zero_();
  }
  std::optional<EmptyRows> empty;
  if (L.uniform_empty_rows && keys.k.defined()) empty.emplace(L, keys.k, keys.v);
  for (auto it = cs.rbegin(); it != cs.rend(); ++it) {
    const Chunk& c = *it;
    const at::Tensor xc = in.of(c), dyc = c.of(dy);
    // The queries (and, for the only chunk without kept keys, the keys): recomputed unless
    // kept, and for their per-head norms' inputs.
    Projected p;
    if (!r.q.defined() || L.qk_norm()) {
      p = project(xc, L, c, keys.k.defined() && !(r.k.defined() && L.qk_norm())
                                ? Heads::kQueries : Heads::kAll);
    } else {
      p.n = L.cast(norm_fwd(L, kInputNorm, xc));
    }
    const at::Tensor q = r.q.defined() ? c.of(r.q, 2) : p.q;
    const at::Tensor& k = keys.k.defined() ? keys.k : p.k;
    const at::Tensor& v = keys.v.defined() ? keys.v : p.v;
    if (L.uniform_empty_rows && !empty) empty.emplace(L, k, v);
    at::Tensor out, lse;
    if (r.out.defined()) {
      out = c.of(r.out, 2), lse = c.of(r.lse, 2).contiguous();
    } else {
      std::tie(out, lse) = attend(L, c, q, k, v);
      if (empty) out = fix_empty_rows_forward(out, lse, empty->vmean.narrow(0, c.b0, c.nb));
      out = out.transpose(1, 2).contiguous().transpose(1, 2);
    }
    // The chunk's h, and the MLP backward of its rows.
    // The o projection's output: for h when it is not kept, and for the output norm's backward.
    at::Tensor o;
    if (L.has_norm(kAttnOutNorm) || (layer && !r.h.defined()))
      o = proj_fwd(L, kO, merge_heads(out), c.t0());
    at::Tensor dh = dyc;
    if (layer) {
      const at::Tensor h = r.h.defined()
                               ? c.of(r.h)
                               : xc + L.residual_scaled(norm_fwd(L, kAttnOutNorm, o));
      dh = mlp_backward(dyc, h, L, mlp_rows(r, c.t0(), c.nb * c.sc), needs, g, c.t0());
    }
    // The o projection's and the attention's backward.
    at::Tensor d_o = L.residual_scaled(L.cast(flat2(dh)));
    if (o.defined() && L.has_norm(kAttnOutNorm))
      d_o = L.cast(norm_bwd(L, kAttnOutNorm, d_o, flat2(o), needs, g));
    const at::Tensor dmerged =
        proj_bwd(L, kO, d_o, flat2(merge_heads(out)), needs, g, c.t0());
    const at::Tensor dout = dmerged.view({c.nb, c.sc, L.num_heads, d}).transpose(1, 2);
    at::Tensor dq, dk, dv;
    if (one) {
      std::tie(dq, dk, dv) = kernel::attention_bwd(
          dout, q, k, v, out, lse, L.key_padding_mask, L.segment_ids, L.window,
          /*causal=*/true, L.scale, /*q_offset=*/0, std::nullopt, std::nullopt, L.softcap);
    } else {
      dq = std::get<0>(kernel::attention_bwd(
          dout, q, c.keys(k, 2), c.keys(v, 2), out, lse, opt(c.keys(L.key_padding_mask)),
          opt(c.keys(L.segment_ids)), L.window, /*causal=*/true, L.scale, c.s0,
          c.keys(dk_acc, 2), c.keys(dv_acc, 2), L.softcap));
    }
    if (empty) dq = dq + empty->query_fix(L, c, dout, lse, q).to(dq.scalar_type());
    if (deferred) {  // the q side now, the keys after the last chunk
      if (!dn_q.defined()) dn_q = at::empty(x.sizes(), p.n.options());
      c.of(dn_q).copy_(
          projections_backward(L, c, p, dq, {}, {}, {}, {}, needs, g).view(xc.sizes()));
      if (!g.dx.defined()) g.dx = at::empty(x.sizes(), dh.options());
      c.of(g.dx).copy_(dh);
      continue;
    }
    if (one) {
      if (empty) {
        auto [dk_fix, dv_fix] = empty->key_fix(L, c, v);
        dk = dk + dk_fix.to(dk.scalar_type());
        dv = dv + dv_fix.to(dv.scalar_type());
      }
    } else {
      dk = c.of(dk_acc, 2).to(k.scalar_type());
      dv = c.of(dv_acc, 2).to(v.scalar_type());
    }
    const at::Tensor k_lin = !L.qk_norm() ? at::Tensor()
                             : keys.k_lin.defined() ? c.of(keys.k_lin) : p.k_lin;
    const at::Tensor dn = projections_backward(L, c, p, dq, dk, dv, k_lin, {}, needs, g);
    const at::Tensor dxc = input_norm_backward(L, xc, dn, dh, needs, g);
    if (one) {
      g.dx = dxc;
    } else {
      if (!g.dx.defined()) g.dx = at::empty(x.sizes(), dxc.options());
      c.of(g.dx).copy_(dxc);
    }
  }
  if (deferred) {  // every empty row is in: the keys' whole gradients, chunk by chunk
    for (const Chunk& c : cs) {
      const at::Tensor xc = in.of(c);
      auto [dk_fix, dv_fix] = empty->key_fix(L, c, c.of(keys.v, 2));
      const at::Tensor dk = c.of(dk_acc, 2).add_(dk_fix).to(keys.k.scalar_type());
      const at::Tensor dv = c.of(dv_acc, 2).add_(dv_fix).to(keys.v.scalar_type());
      Projected p;
      at::Tensor k_lin;
      if (L.qk_norm() && !keys.k_lin.defined()) {
        p = project(xc, L, c, Heads::kKeys);
        k_lin = p.k_lin;
      } else {
        p.n = L.cast(norm_fwd(L, kInputNorm, xc));
        if (L.qk_norm()) k_lin = c.of(keys.k_lin);
      }
      const at::Tensor dn = projections_backward(L, c, p, {}, dk, dv, k_lin,
                                                 c.of(dn_q).reshape({-1, x.size(2)}), needs, g);
      const at::Tensor dh = c.of(g.dx);
      dh.copy_(input_norm_backward(L, xc, dn, dh, needs, g));
    }
  }
  return g;
}

// ---- Ulysses sequence parallelism (sequence_parallel; the exchanges in csrc/ulysses.h) ------
//
// Each rank holds S of the N*S positions of every sequence. The attention goes in head rounds
// (sp_round_kv_heads: as many KV heads at a time as the byte cap allows for their k, v, dk, dv
// over the gathered sequence); a round's k and v go through one all-to-all each to (B, heads/N,
// N*S, D), this rank's share of the round's heads over the whole sequence, and the queries go
// in the rank's token chunks: a chunk's queries go to heads as N pieces, one per rank's chunk
// at its own global positions, each attends causally to the keys it sees (the masks gathered
// once), and the chunk's out and lse come back by all-to-all. Forward: the rank's k, v are
// projected chunk by chunk (norms and RoPE at its global positions; fast: q, k, v, kept) and
// every round's gathered; then per chunk its queries, their attention round by round, the o
// projection, residual and MLP. Backward: every round's k, v gathered again (kept or projected
// again) with float32 dk, dv sums over the gathered sequence; then per chunk the queries, out
// and lse (kept, or for min_memory recomputed by the forward's exchanges, their exchanged
// copies kept for the backward), the MLP's and the o projection's backward into dout, per
// round dout out and dq back (dk, dv adding up), the queries' projections' and input norm's
// backward; then dk, dv back (KV heads repeated for the exchange summed back) and per chunk
// the keys' projections' and input norm's backward. The residuals keep the local layout (the
// shapes of a call without sequence_parallel). Weight gradients are this rank's tokens'
// share: the caller sums them over the group. Chunks are single sequence rows (nb = 1), so
// LoRA dropout hashes global rows (Chunk::row). Whole tensors besides x, y, dy, dx and the
// kept residuals: every round's gathered k, v (and in the backward dk, dv), as many values as
// the rank's own k, v, which are dropped once exchanged; the rest is within a chunk.

struct SpContext {
  ulysses::Group g;
  int64_t rep;           // KV head repeats before the exchange (ulysses::kv_repeats)
  int64_t rounds;        // head rounds (sp_rounds)
  Layer heads;           // L with one round's heads on this rank and the gathered masks
  std::vector<Chunk> cs; // the rank's local chunks, nb = 1, global dropout rows
};

// The attention over the gathered sequence runs in head rounds: round j exchanges the KV
// heads [j*N*r, (j+1)*N*r) (of the KV heads as exchanged, repeated when fewer than N) and their
// query heads, so that each rank holds r KV heads and their query heads at a time. Within a
// round only the keys span the gathered sequence (the queries go in chunks, below), so r is
// the most (a divisor of the KV heads per rank) whose round fits the byte cap
// (csrc/chunking.h): per KV head its k, v and their gradient sums dk, dv over the gathered
// sequence, at the compute width (float32 at least). Returns r.
int64_t sp_round_kv_heads(const Layer& L, const at::Tensor& x, int64_t n, int64_t rep) {
  const int64_t kv = L.num_kv_heads * rep / n;
  const int64_t bytes = x.size(0) * x.size(1) * n * L.head_dim() * 4 *
                        std::max<int64_t>(4, at::elementSize(L.act_dtype(x)));
  int64_t r = kv;
  while (r > 1 && (kv % r != 0 || r * bytes > chunking::chunk_bytes())) --r;
  return r;
}

SpContext sp_context(const at::Tensor& x, const Layer& L, const char* op) {
  SpContext sp;
  sp.g = ulysses::resolve(L.sequence_parallel, op);
  const int64_t N = sp.g.size, B = x.size(0), S = x.size(1);
  sp.rep = ulysses::kv_repeats(sp.g, L.num_kv_heads);
  const int64_t r = sp_round_kv_heads(L, x, N, sp.rep);
  sp.rounds = L.num_kv_heads * sp.rep / (N * r);
  sp.heads = L;
  sp.heads.num_kv_heads = r;
  sp.heads.num_heads = r * (L.num_heads / (L.num_kv_heads * sp.rep));
  if (L.key_padding_mask)
    sp.heads.key_padding_mask = ulysses::gather_tokens(sp.g, *L.key_padding_mask);
  if (L.segment_ids) sp.heads.segment_ids = ulysses::gather_tokens(sp.g, *L.segment_ids);
  const int64_t rows = layer_chunk_rows(L, x);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s0 = 0; s0 < S; s0 += rows)
      sp.cs.push_back({b, 1, s0, std::min(rows, S - s0), S, N * S, sp.g.rank * S});
  return sp;
}

// The rank's q, k, v (B, H*, S, D) over its tokens (k, v with the KV heads repeated as
// exchanged).
struct LocalQkv {
  at::Tensor q, k, v;
};

// Round j's KV heads (dim 1 of a (B, Hkv, S, ...) tensor, as exchanged).
at::Tensor round_kv(const SpContext& sp, const at::Tensor& t, int64_t j) {
  const int64_t n = sp.g.size * sp.heads.num_kv_heads;
  return t.narrow(1, j * n, n);
}

// One head round's keys over the gathered sequence: k, v (B, r, N*S, D), this rank's KV heads
// of round j over every rank's tokens; in the backward the float32 (float64) sums of their
// gradients dk, dv; with uniform_empty_rows the values' mean and (backward) the empty rows'
// sums.
struct RoundKeys {
  at::Tensor k, v, dk, dv, vmean;
  std::optional<EmptyRows> empty;
};

RoundKeys sp_round_keys(const SpContext& sp, const LocalQkv& local, int64_t j, bool backward) {
  const Layer& H = sp.heads;
  RoundKeys rk;
  rk.k = ulysses::to_heads(sp.g, round_kv(sp, local.k, j));
  rk.v = ulysses::to_heads(sp.g, round_kv(sp, local.v, j));
  if (backward) {
    const auto acc = rk.k.options().dtype(at::promote_types(rk.k.scalar_type(), at::kFloat));
    const int64_t B = rk.k.size(0), r = rk.k.size(1), Sg = rk.k.size(2), d = rk.k.size(3);
    rk.dk = at::zeros({B, Sg, r, d}, acc).transpose(1, 2);
    rk.dv = at::zeros({B, Sg, r, d}, acc).transpose(1, 2);
    if (H.uniform_empty_rows) rk.empty.emplace(H, rk.k, rk.v);
  }
  if (H.uniform_empty_rows) rk.vmean = value_mean(H, rk.v);
  return rk;
}

// The queries go in chunks: local chunk c's queries of round j, (1, Hq of the round, sc, D),
// go to heads by one all-to-all as (1, this rank's query heads of the round, N*sc, D), piece i
// of N the positions of rank i's chunk c, i*S + s0 .. i*S + s0 + sc - 1 of the gathered
// sequence: the chunk of the gathered sequence that sp_piece returns. Each piece attends to
// the keys it sees there (causal, q_offset its first position), and the results come back to
// the rank's chunk by all-to-all.
Chunk sp_piece(const SpContext& sp, const Chunk& c, int64_t i) {
  return Chunk{c.b0, 1, i * c.S + c.s0, c.sc, sp.g.size * c.S};
}

// Piece i of an exchanged chunk (positions on dim 2).
at::Tensor piece(const at::Tensor& t, const Chunk& c, int64_t i) {
  return t.narrow(2, i * c.sc, c.sc);
}

// A chunk's queries of one round as exchanged, (1, h, N*sc, D), with the attention's out and
// lse there: what the backward of a recomputed chunk reuses instead of exchanging them again.
struct Exchanged {
  at::Tensor q, out, lse;
};

// The attention of local chunk c's queries q of round j: (out, lse) of the chunk, (1, Hq of
// the round, sc, D) and (1, Hq of the round, sc); `keep`: also the exchanged q, out, lse.
std::tuple<at::Tensor, at::Tensor> sp_attend_chunk(const SpContext& sp, const RoundKeys& rk,
                                                   const Chunk& c, const at::Tensor& q,
                                                   Exchanged* keep = nullptr) {
  const Layer& H = sp.heads;
  const at::Tensor qg = ulysses::to_heads(sp.g, q);  // (1, h, N*sc, D)
  const int64_t h = qg.size(1), rows = qg.size(2), d = qg.size(3);
  at::Tensor out = at::empty({1, rows, h, d}, qg.options()).transpose(1, 2);
  at::Tensor lse = at::empty({1, h, rows}, qg.options().dtype(at::kFloat));
  for (int64_t i = 0; i < sp.g.size; ++i) {
    const Chunk p = sp_piece(sp, c, i);
    auto [o, l] = attend(H, p, piece(qg, c, i), rk.k, rk.v);
    if (H.uniform_empty_rows) o = fix_empty_rows_forward(o, l, rk.vmean.narrow(0, c.b0, 1));
    piece(out, c, i).copy_(o);
    piece(lse.unsqueeze(-1), c, i).copy_(l.unsqueeze(-1));
  }
  if (keep) *keep = {qg, out, lse};
  return {ulysses::to_tokens(sp.g, out), ulysses::lse_to_tokens(sp.g, lse)};
}

// The attention's backward of local chunk c's queries of round j (q, out, dout (1, Hq of the
// round, sc, D), lse (1, Hq of the round, sc); q, out, lse not read when `ex` holds them as
// exchanged): adds the keys' gradients into rk.dk, rk.dv (and the empty rows into rk.empty's
// sums), returns the chunk's dq (1, Hq of the round, sc, D).
at::Tensor sp_attend_backward_chunk(const SpContext& sp, RoundKeys& rk, const Chunk& c,
                                    const at::Tensor& q, const at::Tensor& out,
                                    const at::Tensor& lse, const at::Tensor& dout,
                                    const Exchanged* ex = nullptr) {
  const Layer& H = sp.heads;
  const at::Tensor qg = ex ? ex->q : ulysses::to_heads(sp.g, q);
  const at::Tensor og = ex ? ex->out : ulysses::to_heads(sp.g, out);
  const at::Tensor lg = ex ? ex->lse : ulysses::lse_to_heads(sp.g, lse);
  const at::Tensor dg = ulysses::to_heads(sp.g, dout);
  at::Tensor dq = at::empty({1, qg.size(2), qg.size(1), qg.size(3)}, qg.options()).transpose(1, 2);
  for (int64_t i = 0; i < sp.g.size; ++i) {
    const Chunk p = sp_piece(sp, c, i);
    const at::Tensor qi = piece(qg, c, i), di = piece(dg, c, i);
    const at::Tensor li = piece(lg.unsqueeze(-1), c, i).squeeze(-1).contiguous();
    at::Tensor dqi = std::get<0>(kernel::attention_bwd(
        di, qi, p.keys(rk.k, 2), p.keys(rk.v, 2), piece(og, c, i), li,
        opt(p.keys(H.key_padding_mask)), opt(p.keys(H.segment_ids)), H.window,
        /*causal=*/true, H.scale, p.s0, p.keys(rk.dk, 2), p.keys(rk.dv, 2), H.softcap));
    if (rk.empty) dqi = dqi + rk.empty->query_fix(H, p, di, li, qi).to(dqi.scalar_type());
    piece(dq, c, i).copy_(dqi);
  }
  return ulysses::to_tokens(sp.g, dq);
}

// After every chunk of round j: the empty rows' share of the keys' gradients added, and dk, dv
// back to the rank's tokens, into dk_rep, dv_rep (the KV heads as exchanged).
void sp_finish_keys(const SpContext& sp, RoundKeys& rk, int64_t j, const at::Tensor& dk_rep,
                    const at::Tensor& dv_rep) {
  if (rk.empty) {
    const int64_t Sg = rk.k.size(2);
    auto [dk_fix, dv_fix] = rk.empty->key_fix(sp.heads, Chunk{0, rk.k.size(0), 0, Sg, Sg}, rk.v);
    rk.dk.add_(dk_fix), rk.dv.add_(dv_fix);
  }
  round_kv(sp, dk_rep, j).copy_(ulysses::to_tokens(sp.g, rk.dk.to(dk_rep.scalar_type())));
  round_kv(sp, dv_rep, j).copy_(ulysses::to_tokens(sp.g, rk.dv.to(dv_rep.scalar_type())));
}

// Every round's keys over the gathered sequence (sp_round_keys), from the rank's k, v (B, Hkv,
// S, D): given (kept), or projected here chunk by chunk and dropped once exchanged.
std::vector<RoundKeys> sp_all_keys(const at::Tensor& x, const Layer& L, const SpContext& sp,
                                   at::Tensor k, at::Tensor v, bool backward) {
  if (!k.defined()) {
    const auto act = x.options().dtype(L.act_dtype(x));
    k = heads_buffer(x, L.num_kv_heads, L.head_dim(), act);
    v = heads_buffer(x, L.num_kv_heads, L.head_dim(), act);
    for (const Chunk& c : sp.cs) {
      const Projected p = project(c.of(x), L, c, Heads::kKeys);
      c.of(k, 2).copy_(p.k), c.of(v, 2).copy_(p.v);
    }
  }
  const LocalQkv local{{}, ulysses::repeat_kv(k, sp.rep), ulysses::repeat_kv(v, sp.rep)};
  std::vector<RoundKeys> keys;
  for (int64_t j = 0; j < sp.rounds; ++j) keys.push_back(sp_round_keys(sp, local, j, backward));
  return keys;
}

// The attention of local chunk c's queries q (1, Hq, sc, D), every round: (out, lse) of the
// chunk, (1, Hq, sc, D) of (1, sc, Hq, D) memory and (1, Hq, sc), written into `out` and `lse`
// when given (views of kept residuals); `ex`: the exchanged q, out, lse of each round.
std::tuple<at::Tensor, at::Tensor> sp_attend_rounds(const SpContext& sp,
                                                    const std::vector<RoundKeys>& keys,
                                                    const Chunk& c, const at::Tensor& q,
                                                    at::Tensor out, at::Tensor lse,
                                                    std::vector<Exchanged>* ex = nullptr) {
  const int64_t hq = sp.g.size * sp.heads.num_heads;  // query heads a round
  if (!out.defined()) {
    out = at::empty({1, c.sc, q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    lse = at::empty({1, q.size(1), c.sc}, q.options().dtype(at::kFloat));
  }
  if (ex) ex->resize(sp.rounds);
  for (int64_t j = 0; j < sp.rounds; ++j) {
    auto [o, l] = sp_attend_chunk(sp, keys[j], c, q.narrow(1, j * hq, hq),
                                  ex ? &(*ex)[j] : nullptr);
    out.narrow(1, j * hq, hq).copy_(o);
    lse.narrow(1, j * hq, hq).copy_(l);
  }
  return {out, lse};
}

// Chunk by chunk after the keys: the chunk's queries (fast: every chunk's q, k, v first, kept),
// its attention round by round, the o projection, residual and MLP.
at::Tensor sp_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  const SpContext sp = sp_context(x, L, "decoder_layer");
  const bool layer = L.part_id == Part::kLayer, fast = L.preset_id == Preset::kFast;
  const bool keep = L.preset_id != Preset::kMinMemory;
  const int64_t d = L.head_dim();
  const auto act = x.options().dtype(L.act_dtype(x));
  if (fast) {
    r.q = heads_buffer(x, L.num_heads, d, act);
    r.k = heads_buffer(x, L.num_kv_heads, d, act);
    r.v = heads_buffer(x, L.num_kv_heads, d, act);
    for (const Chunk& c : sp.cs) {
      const Projected p = project(c.of(x), L, c, Heads::kAll);
      c.of(r.q, 2).copy_(p.q), c.of(r.k, 2).copy_(p.k), c.of(r.v, 2).copy_(p.v);
    }
  }
  const std::vector<RoundKeys> keys = sp_all_keys(x, L, sp, r.k, r.v, /*backward=*/false);
  if (keep) {
    r.out = heads_buffer(x, L.num_heads, d, act);
    r.lse = at::empty({x.size(0), L.num_heads, x.size(1)}, x.options().dtype(at::kFloat));
  }
  at::Tensor y;
  for (const Chunk& c : sp.cs) {
    const at::Tensor xc = c.of(x);
    at::Tensor out;
    {
      const at::Tensor q = fast ? c.of(r.q, 2) : project(xc, L, c, Heads::kQueries).q;
      out = std::get<0>(sp_attend_rounds(sp, keys, c, q, keep ? c.of(r.out, 2) : at::Tensor(),
                                         keep ? c.of(r.lse, 2) : at::Tensor()));
    }
    at::Tensor h = xc + L.residual_scaled(norm_fwd(
                            L, kAttnOutNorm, proj_fwd(L, kO, merge_heads(out), c.row())));
    out.reset();
    if (layer) {
      if (keep) {
        if (!r.h.defined()) r.h = at::empty(x.sizes(), h.options());
        c.of(r.h).copy_(h);
      }
      Residuals rc = mlp_rows(r, c.t0(), c.sc);  // local routing rows, global dropout rows
      h = mlp_forward(h, L, fast, rc, c.row());
      if (rc.gate.defined() && fast) {  // fast's gate/up (an MoE MLP keeps none)
        if (!r.gate.defined()) {
          r.gate = at::empty({x.size(0) * x.size(1), rc.gate.size(1)}, rc.gate.options());
          r.up = at::empty_like(r.gate);
        }
        r.gate.narrow(0, c.t0(), c.sc).copy_(rc.gate);
        r.up.narrow(0, c.t0(), c.sc).copy_(rc.up);
      }
    }
    if (!y.defined()) y = at::empty(x.sizes(), h.options());
    c.of(y).copy_(h);
  }
  return y;
}

Grads sp_backward(const at::Tensor& dy, const at::Tensor& x, const Layer& L,
                  const Residuals& r, const std::vector<bool>& needs) {
  const SpContext sp = sp_context(x, L, "decoder_layer_bwd");
  const int64_t d = L.head_dim(), hq = sp.g.size * sp.heads.num_heads;  // query heads a round
  const bool layer = L.part_id == Part::kLayer;
  const auto act = x.options().dtype(L.act_dtype(x));
  // The input norm's backward runs twice per chunk (the queries' share, then the keys').
  Grads g(/*chunked=*/true);
  // Every round's keys over the gathered sequence and their gradient sums (as many values as
  // the rank's own k, v, which are dropped once exchanged).
  std::vector<RoundKeys> keys = sp_all_keys(x, L, sp, r.k, r.v, /*backward=*/true);
  // Chunk by chunk: the queries (kept or projected), out and lse (kept or, for min_memory,
  // recomputed round by round, the exchanged q, out, lse kept for the backward), h and the
  // MLP's backward, the o projection's backward into dout, the attention's backward round by
  // round (dout goes out, dq comes back, dk, dv add up), the queries' projections' and the input
  // norm's backward.
  for (const Chunk& c : sp.cs) {
    const at::Tensor xc = c.of(x), dyc = c.of(dy);
    Projected p;
    at::Tensor q;  // (1, Hq, sc, D)
    auto queries = [&] {
      if (!r.q.defined() || L.qk_norm()) {
        p = project(xc, L, c, Heads::kQueries);  // q, and the q norm's input q_lin
      } else {
        p.n = L.cast(norm_fwd(L, kInputNorm, xc));
      }
      q = r.q.defined() ? c.of(r.q, 2) : p.q;
    };
    // The queries are needed before the MLP's backward only to recompute out; then only their
    // exchanged copies are kept through it (and q_lin, which the q norm's backward reads).
    std::vector<Exchanged> ex;
    at::Tensor out, lse;
    if (r.out.defined()) {
      out = c.of(r.out, 2), lse = c.of(r.lse, 2);
    } else {
      queries();
      std::tie(out, lse) = sp_attend_rounds(sp, keys, c, q, {}, {}, &ex);
      q.reset(), p.q.reset(), p.n.reset();
      if (!L.qk_norm()) p.q_lin.reset();
    }
    at::Tensor o;
    if (L.has_norm(kAttnOutNorm) || (layer && !r.h.defined()))
      o = proj_fwd(L, kO, merge_heads(out), c.row());
    at::Tensor dh = dyc;
    if (layer) {
      const at::Tensor h = r.h.defined() ? c.of(r.h)
                                         : xc + L.residual_scaled(norm_fwd(L, kAttnOutNorm, o));
      if (!L.has_norm(kAttnOutNorm)) o.reset();  // h holds it
      dh = mlp_backward(dyc, h, L, mlp_rows(r, c.t0(), c.sc), needs, g, c.row());
    }
    at::Tensor d_o = L.residual_scaled(L.cast(flat2(dh)));
    if (o.defined() && L.has_norm(kAttnOutNorm))
      d_o = L.cast(norm_bwd(L, kAttnOutNorm, d_o, flat2(o), needs, g));
    o.reset();
    const at::Tensor dout =
        proj_bwd(L, kO, d_o, flat2(merge_heads(out)), needs, g, c.row())
            .view({c.nb, c.sc, L.num_heads, d}).transpose(1, 2);
    d_o.reset();
    if (ex.empty()) {
      queries();
    } else {
      p.n = L.cast(norm_fwd(L, kInputNorm, xc));
    }
    at::Tensor dq = at::empty({1, c.sc, L.num_heads, d}, act).transpose(1, 2);
    for (int64_t j = 0; j < sp.rounds; ++j) {
      auto heads = [&](const at::Tensor& t) { return t.defined() ? t.narrow(1, j * hq, hq) : t; };
      dq.narrow(1, j * hq, hq).copy_(sp_attend_backward_chunk(
          sp, keys[j], c, heads(q), heads(out), heads(lse), heads(dout),
          ex.empty() ? nullptr : &ex[j]));
    }
    const at::Tensor dn = projections_backward(L, c, p, dq, {}, {}, {}, {}, needs, g);
    if (!g.dx.defined()) g.dx = at::empty(x.sizes(), dh.options());
    c.of(g.dx).copy_(input_norm_backward(L, xc, dn, dh, needs, g));
  }
  // dk, dv back to the rank's tokens (KV heads repeated for the exchange summed back), then the
  // keys' projections' and the input norm's backward chunk by chunk.
  const at::Tensor dk_rep = heads_buffer(x, L.num_kv_heads * sp.rep, d, act);
  const at::Tensor dv_rep = heads_buffer(x, L.num_kv_heads * sp.rep, d, act);
  for (int64_t j = 0; j < sp.rounds; ++j) {
    sp_finish_keys(sp, keys[j], j, dk_rep, dv_rep);
    keys[j] = RoundKeys();
  }
  const at::Tensor dk = ulysses::sum_kv(dk_rep, sp.rep);
  const at::Tensor dv = ulysses::sum_kv(dv_rep, sp.rep);
  for (const Chunk& c : sp.cs) {
    const at::Tensor xc = c.of(x);
    Projected p;
    if (L.qk_norm()) {
      p = project(xc, L, c, Heads::kKeys);  // the k norm's input k_lin
    } else {
      p.n = L.cast(norm_fwd(L, kInputNorm, xc));
    }
    const at::Tensor dn = projections_backward(
        L, c, p, {}, c.of(dk, 2), c.of(dv, 2), p.k_lin,
        at::zeros({c.nb * c.sc, x.size(2)}, p.n.options()), needs, g);
    const at::Tensor dh = c.of(g.dx);
    dh.copy_(input_norm_backward(L, xc, dn, dh, needs, g));
  }
  return g;
}

// ---- the whole call ------------------------------------------------------------------------

// router_stats' (3, E) sums before any token: zeros in float32 (float64 for float64).
at::Tensor empty_router_stats(const at::Tensor& x, const Layer& L) {
  return at::zeros({3, L.moe_w(kRouter).size(0)},
                   x.options().dtype(at::promote_types(L.act_dtype(x), at::kFloat)));
}

at::Tensor layer_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  if (L.moe() && has_mlp(L.part_id)) {  // the routing of every token, filled chunk by chunk
    const int64_t t = x.size(0) * x.size(1), k = L.num_experts_per_tok;
    r.topk_idx = at::empty({t, k}, x.options().dtype(at::kInt));
    r.topk_w = at::empty({t, k},
                         x.options().dtype(at::promote_types(L.act_dtype(x), at::kFloat)));
    if (L.router_logits)  // the op's second output, filled chunk by chunk
      r.router_logits = at::empty({t, L.moe_w(kRouter).size(0)},
                                  x.options().dtype(L.act_dtype(x)));
    if (L.router_stats)  // or the load-balancing statistics, summed chunk by chunk
      r.router_stats = empty_router_stats(x, L);
    r.stats_w = stats_weights(x, L);
  }
  if (L.part_id == Part::kMlp) return mlp_forward(x, L, L.preset_id == Preset::kFast, r, 0);
  if (!L.sequence_parallel.empty()) return sp_forward(x, L, r);
  return attention_layer_forward(x, L, r);
}

Grads layer_backward(const at::Tensor& dy, const Input& in, const Layer& L,
                     const Residuals& r, const std::vector<bool>& needs) {
  // A streamed input is read chunk by chunk by the attention layer's walk; the other
  // backwards read it whole, copied to the device here.
  const at::Tensor x =
      in.host.defined() && (L.part_id == Part::kMlp || !L.sequence_parallel.empty())
          ? in.host.to(in.x.options(), /*non_blocking=*/true, /*copy=*/true)
          : in.x;
  if (L.part_id != Part::kMlp && !L.sequence_parallel.empty())
    return sp_backward(dy, x, L, r, needs);
  if (L.part_id != Part::kMlp) return attention_layer_backward(dy, in, L, r, needs);
  Grads g(/*chunked=*/false);
  g.dx = mlp_backward(dy, x, L, r, needs, g, 0);
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
  if (has_mlp(L.part_id) && L.has_dense_mlp()) {
    r.gate = at::empty({b * s, L.proj(kGate).size(0)}, act);
    r.up = at::empty({b * s, L.proj(kGate).size(0)}, act);
  }
  if (has_mlp(L.part_id) && L.moe()) {
    r.topk_idx = at::empty({b * s, L.num_experts_per_tok}, x.options().dtype(at::kInt));
    r.topk_w = at::empty({b * s, L.num_experts_per_tok},
                         x.options().dtype(at::promote_types(L.act_dtype(x), at::kFloat)));
    if (L.router_logits)
      r.router_logits = at::empty({b * s, L.moe_w(kRouter).size(0)},
                                  x.options().dtype(L.act_dtype(x)));
    if (L.router_stats) r.router_stats = empty_router_stats(x, L);
  }
  return r;
}

// The token chunk rows, whose chunks' exchanges must pair up across the ranks.
constexpr const char* kSpChunkRowsField =
    "the same token chunk rows (chunk_rows, or the rows CKPT_EXT_CHUNK_BYTES gives)";

// What every rank of the sequence_parallel group must pass alike for the exchanges to pair
// up (each field's count fixed; zeros where this rank's layer could not be built).
std::vector<ulysses::Field> sp_fields(const at::Tensor& x, const Layer* L,
                                      const ulysses::Group& g) {
  const bool x3 = x.defined() && x.dim() == 3;
  auto dtype = [](const OptTensor& t) {
    return t ? static_cast<int64_t>(t->scalar_type()) + 1 : int64_t{0};
  };
  std::vector<ulysses::Field> f = {
      {"x of the same shape (B, S, H) (S: its share of the sequence)",
       {x3 ? x.size(0) : -1, x3 ? x.size(1) : -1, x3 ? x.size(2) : -1}},
      {"x of the same dtype and device type (codes)",
       {x.defined() ? static_cast<int64_t>(x.scalar_type()) : -1,
        x.defined() ? static_cast<int64_t>(x.device().type()) : -1}}};
  if (!L || !x3) {
    f.push_back({"the same num_heads, num_kv_heads, head_dim, part, preset, compute dtype and "
                 "head rounds", std::vector<int64_t>(7, 0)});
    f.push_back({"the same kinds of masks (key_padding_mask and segment_ids: present, dtype)",
                 {0, 0}});
    f.push_back({kSpChunkRowsField, {0}});
    return f;
  }
  const int64_t rep = ulysses::kv_repeats(g, L->num_kv_heads);
  const int64_t kv = L->num_kv_heads * rep / g.size;
  const int64_t rounds = kv > 0 ? kv / sp_round_kv_heads(*L, x, g.size, rep) : 0;
  f.push_back({"the same num_heads, num_kv_heads, head_dim, part, preset, compute dtype and "
               "head rounds (the head rounds follow CKPT_EXT_CHUNK_BYTES, which must then "
               "be the same on every rank)",
               {L->num_heads, L->num_kv_heads, L->head_dim(), static_cast<int64_t>(L->part_id),
                static_cast<int64_t>(L->preset_id), static_cast<int64_t>(L->act_dtype(x)),
                rounds}});
  f.push_back({"the same kinds of masks (key_padding_mask and segment_ids: present, dtype code)",
               {dtype(L->key_padding_mask), dtype(L->segment_ids)}});
  f.push_back({kSpChunkRowsField, {layer_chunk_rows(*L, x)}});
  return f;
}

// make_layer and the checks (check_layer, then `more`). Under sequence_parallel every rank's
// verdict is agreed first (ulysses::agree: one all-gather of a small record), so bad input on
// one rank refuses on every rank before any exchange. A group name that does not resolve
// refuses on the ranks that passed it (there is no group to tell the others through).
template <class Make, class More>
Layer checked_layer(const char* op, const at::Tensor& x, c10::string_view sequence_parallel,
                    const Make& make, const More& more) {
  if (sequence_parallel.empty()) {
    Layer L = make();
    check_layer(op, x, L);
    more(L);
    return L;
  }
  const ulysses::Group g = ulysses::resolve(sequence_parallel, op);
  std::optional<Layer> L;
  std::exception_ptr error;
  try {
    L.emplace(make());
    check_layer(op, x, *L);
    more(*L);
  } catch (...) {
    error = std::current_exception();
  }
  ulysses::agree(g, op, x.defined() ? x.device() : c10::Device(c10::kCPU), error,
                 sp_fields(x, error ? nullptr : &*L, g));
  return std::move(*L);
}

}  // namespace

// ---- ops -----------------------------------------------------------------------------------

FwdResult decoder_layer_fwd(const at::Tensor& x LAYER_PARAMS) {
  const char* op = "decoder_layer";
  const Layer L = checked_layer(
      op, x, sequence_parallel,
      [&] { return make_layer(weights, LAYER_TENSORS_OF_PARAMS, LAYER_OPTIONS_OF_PARAMS, op); },
      [](const Layer&) {});
  auto logits_of = [&](const Residuals& r) {
    if (r.router_stats.defined()) return r.router_stats;
    return r.router_logits.defined() ? r.router_logits : at::empty({0}, x.options());
  };
  if (x.numel() == 0) {
    const Residuals r = empty_residuals(x, L);
    return {at::empty_like(x, at::MemoryFormat::Contiguous), pack(r, L), logits_of(r)};
  }
  Residuals r;
  at::Tensor y = layer_forward(x, L, r).contiguous();
  return {y, pack(r, L), logits_of(r)};
}

namespace {
std::atomic<bool> streamed_input_check{false};
}  // namespace

void set_streamed_input_check(bool on) { streamed_input_check.store(on); }

BwdResult decoder_layer_bwd(const at::Tensor& dy, const at::Tensor& x_given LAYER_PARAMS,
                            at::TensorList saved, const c10::List<bool>& needs_grad,
                            const OptTensor& drouter_logits) {
  const char* op = "decoder_layer_bwd";
  // The input may have stayed in host memory (ckpt_ext.offload's streamed inputs): on another
  // device than dy, the device the layer computes on. The backward then reads it a chunk at a
  // time (Input); x stands in for it (see Input). set_streamed_input_check(true) makes every
  // call read its input so, copying chunks on one device too: the CPU tests' way to run it.
  const bool streamed = x_given.defined() && dy.defined() && x_given.numel() > 0 &&
                        (x_given.device() != dy.device() || streamed_input_check.load());
  const at::Tensor x =
      streamed ? at::empty({1}, x_given.options().device(dy.device()))
                     .fill_(std::numeric_limits<double>::quiet_NaN())
                     .expand(x_given.sizes())
               : x_given;
  const Layer L = checked_layer(
      op, x, sequence_parallel,
      [&] { return make_layer(weights, LAYER_TENSORS_OF_PARAMS, LAYER_OPTIONS_OF_PARAMS, op); },
      [&](const Layer&) {
        checks::check_shape(op, "dy", dy, x.sizes(), "(the shape of x)");
        CKPT_CHECK_VALUE(static_cast<int64_t>(needs_grad.size()) == kNumSlots, op,
                         "needs_grad must have one entry per weight slot (", kNumSlots,
                         "), got ", needs_grad.size());
      });
  std::vector<bool> needs(kNumSlots);
  for (int64_t s = 0; s < kNumSlots; ++s)
    needs[s] = needs_grad.get(s) && L.at(s).defined() && uses_slot(L.part_id, s);
  Grads g(/*chunked=*/false);
  if (x.numel() == 0) {
    g.dx = at::zeros_like(x, at::MemoryFormat::Contiguous);
    for (int64_t s = 0; s < kNumSlots; ++s)
      if (needs[s]) g.dw[s] = at::zeros_like(L.at(s));
  } else {
    Residuals r = unpack(saved, L, op);
    r.stats_w = stats_weights(x, L);
    if (drouter_logits && drouter_logits->defined() && L.router_stats) {
      checks::check_shape(op, "drouter_logits", *drouter_logits,
                          {3, L.moe_w(kRouter).size(0)},
                          "(3, num_experts): the forward's router_stats");
      r.drouter_stats = *drouter_logits;
    } else if (drouter_logits && drouter_logits->defined()) {
      CKPT_CHECK_VALUE(L.router_logits, op,
                       "drouter_logits is given but router_logits is False (the forward "
                       "returned no router logits)");
      checks::check_shape(op, "drouter_logits", *drouter_logits,
                          {x.size(0) * x.size(1), L.moe_w(kRouter).size(0)},
                          "(B*S, num_experts): the forward's router_logits");
      r.drouter_logits = *drouter_logits;
    }
    g = layer_backward(dy.to(x.scalar_type()), Input{x, streamed ? x_given : at::Tensor()}, L,
                       r, needs);
    g.finish(L);
  }
  // Slots without a gradient come back as empty (0,) tensors (a Tensor[] holds no None), one
  // each: outputs of an op must not alias each other.
  for (auto& d : g.dw)
    if (!d.defined()) d = at::empty({0}, x.options());
  return {g.dx.contiguous(), g.dw};
}

}  // namespace layer
}  // namespace ckpt_ext
