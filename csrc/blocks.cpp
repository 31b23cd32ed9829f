// The fused LLaMA decoder layer: one C++ autograd Function over two opaque ops.
//
//   decoder_layer       the user-facing op. Autocast key: fixes the compute dtype. Autograd
//                       key: DecoderLayerFn, which calls the two ops below and saves the
//                       preset's residuals. Below autograd (no grad): the forward alone.
//   decoder_layer_fwd   forward: (y, residuals). Residuals are exactly what the preset keeps.
//   decoder_layer_bwd   backward: recomputes what the preset did not keep, returns gradients.
//
// Because forward and backward are single ops with fakes (ckpt_ext/blocks.py), torch.compile
// (AOTAutograd) cannot trace into them: a compiled model saves the preset's residuals, not
// what the partitioner would choose from the kernel ops inside.
//
//   preset       forward keeps (besides x and the weights)   backward recomputes
//   fast         q, k, v (post-RoPE), out, lse, h, gate, up   norms, SwiGLU product, softmax tiles
//   balanced     out, lse, h                                  + q/k/v and RoPE, gate/up tile-wise
//   min_memory   nothing                                      + attention forward and o_proj
//
// (h = x + attention output, the MLP input.) `part` selects the whole layer ("layer"), the
// attention sublayer x + o_proj(attn(...)) ("attention") or the MLP sublayer
// h + down(silu(gate) * up) ("mlp"); a sublayer keeps its share of the residuals above.
//
// Weights travel as one list of named slots (kSlotNames: HF parameter names relative to the
// decoder layer); a projection is the four slots weight, bias, lora_A, lora_B, absent ones
// None. A LoRA projection computes x W^T + b + scaling * (dropout(x) A^T) B^T; the dropout
// mask is a hash of (dropout_seed, projection, element) (csrc/lora_dropout.h), so every
// recompute and the backward see the forward's masks.
//
// Mixed precision: with compute_dtype (set by the Autocast kernel from the autocast dtype),
// the layer computes what HF's modules compute under autocast: norms in the residual dtype
// (statistics in fp32), projections and attention in compute_dtype (weights cast transiently,
// never saved), residual adds in the residual dtype (fp32 when the master weights are fp32).
//
// Shapes: x (B, S, H); q (B, Hq, S, D); k, v (B, Hkv, S, D); out (B, Hq, S, D) (v and out
// laid out (B, S, H*, D) in memory);
// lse (B, Hq, S) fp32; gate, up (B*S, I); weights in nn.Linear layout.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "lora_dropout.h"

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
                 const OptTensor& mask, const OptTensor& seg, std::optional<int64_t> window,
                 double scale) {
  static auto op = op_handle<T2(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, std::optional<int64_t>,
                                bool, double)>("ckpt_ext::attention_fwd");
  return op.call(q, k, v, mask, seg, window, /*causal=*/true, scale);
}

T3 attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 const OptTensor& mask, const OptTensor& seg, std::optional<int64_t> window,
                 double scale) {
  static auto op = op_handle<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const OptTensor&, std::optional<int64_t>,
                                bool, double)>("ckpt_ext::attention_bwd");
  return op.call(dout, q, k, v, out, lse, mask, seg, window, /*causal=*/true, scale);
}

at::Tensor lora_dropout_op(const at::Tensor& x, const at::Tensor& seed, int64_t stream, double p) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>(
      "ckpt_ext::lora_dropout");
  return op.call(x, seed, stream, p);
}

// The SwiGLU ops' adapter arguments: lora [] or [A_gate, B_gate, A_up, B_up, A_down, B_down];
// scaling [] or 3 factors; dropout [] or 3 probabilities; seed for a dropout > 0.
struct MlpLora {
  c10::List<OptTensor> lora;
  std::vector<double> scaling, dropout;
  OptTensor seed;
};

T3 swiglu_fwd(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
              const at::Tensor& wd, const OptTensor& bg, const OptTensor& bu,
              const OptTensor& bd, const MlpLora& l, bool return_gate_up) {
  static auto op = op_handle<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const c10::List<OptTensor>&,
                                c10::ArrayRef<double>, bool, c10::ArrayRef<double>,
                                const OptTensor&)>("ckpt_ext::swiglu_fwd");
  return op.call(x, wg, wu, wd, bg, bu, bd, l.lora, l.scaling, return_gate_up, l.dropout,
                 l.seed);
}

// needs_grad: [w_gate, w_up, w_down, b_gate, b_up, b_down, A_gate, B_gate, A_up, B_up, A_down,
// B_down]; what is not wanted is never computed and comes back empty.
using SwigluGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor, std::vector<at::Tensor>>;
SwigluGrads swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& wg,
                       const at::Tensor& wu, const at::Tensor& wd, const OptTensor& bg,
                       const OptTensor& bu, const OptTensor& bd, const MlpLora& l,
                       const OptTensor& gate, const OptTensor& up,
                       const c10::List<bool>& needs_grad) {
  static auto op = op_handle<SwigluGrads(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
      const c10::List<OptTensor>&, c10::ArrayRef<double>, const OptTensor&, const OptTensor&,
      const c10::List<bool>&, c10::ArrayRef<double>, const OptTensor&)>("ckpt_ext::swiglu_bwd");
  return op.call(dy, x, wg, wu, wd, bg, bu, bd, l.lora, l.scaling, gate, up, needs_grad,
                 l.dropout, l.seed);
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

// ---- weight slots ----------------------------------------------------------------------------

enum Norm : int64_t { kInputNorm = 0, kQNorm, kKNorm, kPostNorm, kNumNorms };
enum Proj : int64_t { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kNumProjs };
enum ProjPart : int64_t { kWeight = 0, kBias, kLoraA, kLoraB, kNumProjParts };
constexpr int64_t kNumSlots =
    int64_t{kNumNorms} + int64_t{kNumProjs} * int64_t{kNumProjParts};

constexpr int64_t slot(Norm n) { return n; }
constexpr int64_t slot(Proj p, ProjPart part) {
  return int64_t{kNumNorms} + int64_t{p} * int64_t{kNumProjParts} + int64_t{part};
}

const std::array<const char*, kNumNorms> kNormNames = {
    "input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "post_attention_layernorm.weight"};
const std::array<const char*, kNumProjs> kProjNames = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
const std::array<const char*, kNumProjParts> kProjPartNames = {"weight", "bias", "lora_A",
                                                                "lora_B"};

std::string slot_name(int64_t s) {
  if (s < kNumNorms) return kNormNames[s];
  const int64_t i = s - kNumNorms;
  return std::string(kProjNames[i / kNumProjParts]) + "." + kProjPartNames[i % kNumProjParts];
}

// ---- options -------------------------------------------------------------------------------

enum class Preset { kFast, kBalanced, kMinMemory };
enum class Part { kLayer, kAttention, kMlp };

Preset parse_preset(c10::string_view name, const char* op) {
  if (name == "fast") return Preset::kFast;
  if (name == "balanced") return Preset::kBalanced;
  if (name == "min_memory") return Preset::kMinMemory;
  CKPT_CHECK_VALUE(false, op, "preset must be one of 'fast', 'balanced', 'min_memory', got '",
                   std::string(name), "'");
}

Part parse_part(c10::string_view name, const char* op) {
  if (name == "layer") return Part::kLayer;
  if (name == "attention") return Part::kAttention;
  if (name == "mlp") return Part::kMlp;
  CKPT_CHECK_VALUE(false, op, "part must be one of 'layer', 'attention', 'mlp', got '",
                   std::string(name), "'");
}

bool has_attention(Part p) { return p != Part::kMlp; }
bool has_mlp(Part p) { return p != Part::kAttention; }

// Everything of a call but x and the residuals.
struct Layer {
  std::vector<at::Tensor> w;  // kNumSlots, undefined = absent
  at::Tensor cos, sin;
  OptTensor mask, seg;
  std::optional<int64_t> window;
  bool uniform_empty_rows = false;   // rows with no key average all values (HF eager)
  std::vector<double> lora_scaling;  // kNumProjs, or empty without adapters
  std::vector<double> lora_dropout;  // kNumProjs, or empty without dropout
  OptTensor seed;                    // dropout_seed
  int64_t hq, hkv;
  double eps, scale;
  std::optional<at::ScalarType> compute_dtype;
  Part part;
  Preset preset;

  const at::Tensor& at(int64_t s) const { return w[s]; }
  const at::Tensor& norm(Norm n) const { return w[slot(n)]; }
  const at::Tensor& proj(Proj p, ProjPart part = kWeight) const { return w[slot(p, part)]; }
  int64_t head_dim() const { return proj(kQ).size(0) / hq; }
  bool qk_norm() const { return norm(kQNorm).defined(); }
  // t in the compute dtype (a transient copy when it differs; t itself otherwise).
  at::Tensor cast(const at::Tensor& t) const {
    return t.defined() && compute_dtype && t.scalar_type() != *compute_dtype
               ? t.to(*compute_dtype)
               : t;
  }
  OptTensor cast_opt(const at::Tensor& t) const {
    return t.defined() ? OptTensor(cast(t)) : std::nullopt;
  }
  at::ScalarType act_dtype(const at::Tensor& x) const {
    return compute_dtype.value_or(x.scalar_type());
  }
  double lora_scale(Proj p) const { return lora_scaling.empty() ? 0.0 : lora_scaling[p]; }
  double dropout_p(Proj p) const {
    return has_lora(p) && !lora_dropout.empty() ? lora_dropout[p] : 0.0;
  }
  // The adapter's input of projection p, dropout applied (inp in the LoRA dtype).
  at::Tensor lora_input(Proj p, const at::Tensor& inp) const {
    return dropout_p(p) > 0.0 ? lora_dropout_op(inp, *seed, p, dropout_p(p)) : inp;
  }
  bool has_lora(Proj p) const { return proj(p, kLoraA).defined(); }
  // The dtype of the low-rank term: the compute dtype, or the adapter's own (PEFT keeps fp32
  // adapters on a half-precision base and computes their term in fp32).
  at::ScalarType lora_dtype(Proj p) const {
    return compute_dtype.value_or(proj(p, kLoraA).scalar_type());
  }
  bool mlp_has_lora() const { return has_lora(kGate) || has_lora(kUp) || has_lora(kDown); }
};

Layer make_layer(const c10::List<OptTensor>& weights, const OptTensor& cos,
                 const OptTensor& sin, const OptTensor& mask, const OptTensor& seg,
                 std::optional<int64_t> window, bool uniform_empty_rows,
                 c10::ArrayRef<double> lora_scaling, c10::ArrayRef<double> lora_dropout,
                 const OptTensor& seed, int64_t hq, int64_t hkv, double eps, double scale,
                 std::optional<at::ScalarType> compute_dtype, c10::string_view part,
                 c10::string_view preset, const char* op) {
  CKPT_CHECK_VALUE(static_cast<int64_t>(weights.size()) == kNumSlots, op, "weights must have ",
                   kNumSlots, " slots (ckpt_ext.blocks.WEIGHT_SLOTS), got ", weights.size());
  Layer L;
  L.w.reserve(kNumSlots);
  for (const OptTensor& t : weights) L.w.push_back(checks::absent(t) ? at::Tensor() : *t);
  L.cos = cos.value_or(at::Tensor());
  L.sin = sin.value_or(at::Tensor());
  L.mask = checks::absent(mask) ? std::nullopt : mask;
  L.seg = checks::absent(seg) ? std::nullopt : seg;
  L.window = window;
  L.uniform_empty_rows = uniform_empty_rows;
  L.lora_scaling.assign(lora_scaling.begin(), lora_scaling.end());
  L.lora_dropout.assign(lora_dropout.begin(), lora_dropout.end());
  L.seed = checks::absent(seed) ? std::nullopt : seed;
  L.hq = hq;
  L.hkv = hkv;
  L.eps = eps;
  L.scale = scale;
  L.compute_dtype = compute_dtype;
  L.part = parse_part(part, op);
  L.preset = parse_preset(preset, op);
  return L;
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
  CKPT_CHECK_VALUE(L.seed.has_value(), op,
                   "dropout_seed is required when lora_dropout has a probability > 0");
  dropout::read_seed(op, "dropout_seed", *L.seed);
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
  if (has_attention(L.part)) {
    CKPT_CHECK_VALUE(L.hq > 0 && L.hkv > 0, op,
                     "num_heads and num_kv_heads must be positive, got ", L.hq, " and ", L.hkv);
    CKPT_CHECK_VALUE(L.hq % L.hkv == 0, op, "num_kv_heads must divide num_heads=", L.hq,
                     ", got ", L.hkv);
    const at::Tensor& wq = L.proj(kQ);
    CKPT_CHECK_VALUE(wq.defined() && wq.dim() == 2 && wq.size(0) % L.hq == 0, op,
                     "self_attn.q_proj.weight must be (num_heads * head_dim, H) with num_heads=",
                     L.hq, ", got ", wq.defined() ? checks::shape_str(wq.sizes()) : "None");
    const int64_t d = L.head_dim();
    check_weight(op, L, slot(kInputNorm), x, {h}, "to match x's hidden size");
    check_proj(op, L, kQ, x, L.hq * d, h);
    check_proj(op, L, kK, x, L.hkv * d, h);
    check_proj(op, L, kV, x, L.hkv * d, h);
    check_proj(op, L, kO, x, h, L.hq * d);
    CKPT_CHECK_VALUE(L.qk_norm() == L.norm(kKNorm).defined(), op,
                     "self_attn.q_norm.weight and self_attn.k_norm.weight come together");
    if (L.qk_norm()) {
      check_weight(op, L, slot(kQNorm), x, {d}, "(head_dim,)");
      check_weight(op, L, slot(kKNorm), x, {d}, "(head_dim,)");
    }
    CKPT_CHECK_VALUE(L.cos.defined() && L.sin.defined(), op,
                     "position_embeddings (cos, sin) are required for the attention");
    checks::check_dim(op, "cos", L.cos, 3, "(B or 1, S, head_dim)");
    CKPT_CHECK_VALUE(L.cos.size(0) == 1 || L.cos.size(0) == b, op,
                     "cos must have batch size 1 or B=", b, ", got shape ",
                     checks::shape_str(L.cos.sizes()));
    checks::check_shape(op, "cos", L.cos, {L.cos.size(0), s, d}, "(B or 1, S, head_dim)");
    checks::check_shape(op, "sin", L.sin, L.cos.sizes(), "(the shape of cos)");
    CKPT_CHECK_VALUE(!L.cos.requires_grad() && !L.sin.requires_grad(), op,
                     "gradients with respect to cos/sin are not computed; pass position "
                     "embeddings that do not require grad (detach them)");
    if (!L.compute_dtype) {
      CKPT_CHECK_TYPE(L.cos.scalar_type() == x.scalar_type(), op, "cos is ",
                      checks::dtype_str(L.cos.scalar_type()), " but x is ",
                      checks::dtype_str(x.scalar_type()),
                      "; outside autocast position embeddings share the input's dtype");
    }
  }
  if (has_mlp(L.part)) {
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
    const at::Tensor u = at::linear(L.lora_input(p, inp.to(ld)), L.proj(p, kLoraA).to(ld));
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
    const at::Tensor dyl = dy2.to(ld), inpl = L.lora_input(p, inp2.to(ld));
    const at::Tensor dyb = dyl.mm(b);  // (T, r)
    // dropout is linear and its own adjoint: the input's gradient gets the forward's mask
    dinp.add_(L.lora_input(p, dyb.mm(a).mul_(s)).to(dinp.scalar_type()));
    if (needs[slot(p, kLoraB)]) set_grad(g, L, slot(p, kLoraB), dyl.t().mm(inpl.mm(a.t())).mul_(s));
    if (needs[slot(p, kLoraA)]) set_grad(g, L, slot(p, kLoraA), dyb.t().mm(inpl).mul_(s));
  }
  return dinp;
}

at::Tensor flat2(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// ---- residuals -----------------------------------------------------------------------------

struct Residuals {
  at::Tensor q, k, v, out, lse, h, gate, up;
};

using Member = at::Tensor Residuals::*;

// What (part, preset) keeps, in the order of decoder_layer_fwd's `saved` output.
std::vector<Member> kept(Part part, Preset preset) {
  std::vector<Member> m;
  if (preset == Preset::kMinMemory) return m;
  if (has_attention(part)) {
    if (preset == Preset::kFast) m.insert(m.end(), {&Residuals::q, &Residuals::k, &Residuals::v});
    m.insert(m.end(), {&Residuals::out, &Residuals::lse});
  }
  if (part == Part::kLayer) m.push_back(&Residuals::h);
  if (has_mlp(part) && preset == Preset::kFast) m.insert(m.end(), {&Residuals::gate, &Residuals::up});
  return m;
}

std::vector<at::Tensor> pack(const Residuals& r, const Layer& L) {
  std::vector<at::Tensor> out;
  for (Member m : kept(L.part, L.preset)) out.push_back(r.*m);
  return out;
}

Residuals unpack(at::TensorList saved, const Layer& L, const char* op) {
  const auto members = kept(L.part, L.preset);
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
  p.n = L.cast(rms_norm_fwd(x, L.norm(kInputNorm), L.eps));
  p.q_lin = proj_fwd(L, kQ, p.n).view({b, s, L.hq, d});
  p.k_lin = proj_fwd(L, kK, p.n).view({b, s, L.hkv, d});
  p.v = proj_fwd(L, kV, p.n).view({b, s, L.hkv, d}).transpose(1, 2);
  const at::Tensor qh = L.qk_norm() ? rms_norm_fwd(p.q_lin, L.norm(kQNorm), L.eps) : p.q_lin;
  const at::Tensor kh = L.qk_norm() ? rms_norm_fwd(p.k_lin, L.norm(kKNorm), L.eps) : p.k_lin;
  // rope keeps its input's layout: q, k stay (B, H, S, D) views of (B, S, H, D) memory, the
  // layout attention reads, and their gradients come back alike (merged with views).
  std::tie(p.q, p.k) = rope_fwd(qh.transpose(1, 2), kh.transpose(1, 2), L.cos, L.sin);
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
  const at::Tensor vmean = per_query_head(r.v.mean(2, /*keepdim=*/true), L.hq / L.hkv);
  at::Tensor fixed = at::empty_like(r.out);  // keeps out's (B, S, Hq, D) memory layout
  at::where_out(fixed, empty_rows(r.lse).to(at::kBool), vmean.to(r.out.scalar_type()), r.out);
  r.out = fixed;
}

void fix_empty_rows_backward(const Layer& L, const Residuals& r, const at::Tensor& dout,
                             at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t groups = L.hq / L.hkv, s = r.k.size(2);
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
  dk = dk + per_kv_head(dk_fix, L.hkv).to(dk.scalar_type());
  dv = dv + per_kv_head(dv_fix.contiguous(), L.hkv).to(dv.scalar_type());
}

// y = x + o_proj(attention(q, k, v)); fills r.q/k/v/out/lse.
at::Tensor attention_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  Projected p = project(x, L);
  r.q = p.q, r.k = p.k, r.v = p.v;
  std::tie(r.out, r.lse) = attention_fwd(p.q, p.k, p.v, L.mask, L.seg, L.window, L.scale);
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
    p.n = L.cast(rms_norm_fwd(x, L.norm(kInputNorm), L.eps));
  }
  if (!r.out.defined()) {
    std::tie(r.out, r.lse) = attention_fwd(r.q, r.k, r.v, L.mask, L.seg, L.window, L.scale);
    if (L.uniform_empty_rows) fix_empty_rows_forward(L, r);
  }

  const at::Tensor dy2 = L.cast(flat2(dy));
  const at::Tensor dmerged = proj_bwd(L, kO, dy2, flat2(merge_heads(r.out)), needs, g);
  const at::Tensor dout = dmerged.view({b, sl, L.hq, d}).transpose(1, 2);
  auto [dq, dk, dv] =
      attention_bwd(dout, r.q, r.k, r.v, r.out, r.lse, L.mask, L.seg, L.window, L.scale);
  if (L.uniform_empty_rows) fix_empty_rows_backward(L, r, dout, dq, dk, dv);
  auto [dqh, dkh] = rope_bwd(dq, dk, L.cos, L.sin);
  at::Tensor dq_lin = dqh.transpose(1, 2), dk_lin = dkh.transpose(1, 2);  // (B, S, H*, D)
  if (L.qk_norm()) {
    at::Tensor dqn, dkn;
    const at::Tensor &wqn = L.norm(kQNorm), &wkn = L.norm(kKNorm);
    std::tie(dq_lin, dqn) = rms_norm_bwd(
        dq_lin.to(at::promote_types(p.q_lin.scalar_type(), wqn.scalar_type())), p.q_lin, wqn,
        L.eps);
    std::tie(dk_lin, dkn) = rms_norm_bwd(
        dk_lin.to(at::promote_types(p.k_lin.scalar_type(), wkn.scalar_type())), p.k_lin, wkn,
        L.eps);
    if (needs[slot(kQNorm)]) set_grad(g, L, slot(kQNorm), dqn);
    if (needs[slot(kKNorm)]) set_grad(g, L, slot(kKNorm), dkn);
  }
  const at::Tensor n2 = flat2(p.n);
  at::Tensor dn = proj_bwd(L, kQ, L.cast(dq_lin.reshape({b * sl, L.hq * d})), n2, needs, g);
  dn.add_(proj_bwd(L, kK, L.cast(dk_lin.reshape({b * sl, L.hkv * d})), n2, needs, g));
  dn.add_(proj_bwd(L, kV, dv.transpose(1, 2).reshape({b * sl, L.hkv * d}), n2, needs, g));
  const at::Tensor& wn = L.norm(kInputNorm);
  auto [dxn, dwn] = rms_norm_bwd(
      dn.view(x.sizes()).to(at::promote_types(x.scalar_type(), wn.scalar_type())), x, wn,
      L.eps);
  if (needs[slot(kInputNorm)]) set_grad(g, L, slot(kInputNorm), dwn);
  return dy + dxn;
}

// ---- MLP sublayer --------------------------------------------------------------------------

// The normed MLP input, (T, H) in the compute dtype.
at::Tensor mlp_input(const at::Tensor& h, const Layer& L) {
  return L.cast(flat2(rms_norm_fwd(h, L.norm(kPostNorm), L.eps)));
}

// The SwiGLU ops' adapter arguments: [A_gate, B_gate, A_up, B_up, A_down, B_down] (cast to
// the compute dtype under autocast, their own dtype otherwise), the three factors, and the
// dropout probabilities with the seed (the ops number gate/up/down 4/5/6, as the layer does).
constexpr std::array<Proj, 3> kMlpProjs = {kGate, kUp, kDown};

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
    l.seed = L.seed;
  } else {
    l.dropout.clear();
  }
  return l;
}

// y = h + down(silu(gate(m)) * up(m)); fills r.gate/up when `keep_gate_up`.
at::Tensor mlp_forward(const at::Tensor& h, const Layer& L, bool keep_gate_up, Residuals& r) {
  const at::Tensor m2 = mlp_input(h, L);
  auto [y2, gate, up] =
      swiglu_fwd(m2, L.cast(L.proj(kGate)), L.cast(L.proj(kUp)), L.cast(L.proj(kDown)),
                 L.cast_opt(L.proj(kGate, kBias)), L.cast_opt(L.proj(kUp, kBias)),
                 L.cast_opt(L.proj(kDown, kBias)), mlp_lora(L), keep_gate_up);
  if (keep_gate_up) r.gate = gate, r.up = up;
  return h + y2.view(h.sizes());
}

at::Tensor mlp_backward(const at::Tensor& dy, const at::Tensor& h, const Layer& L,
                        const Residuals& r, const std::vector<bool>& needs, Grads& g) {
  const at::Tensor m2 = mlp_input(h, L);
  // The ops' gradient order: weights, biases, then the adapters, as in mlp_lora.
  std::vector<int64_t> order;
  for (ProjPart part : {kWeight, kBias})
    for (Proj p : kMlpProjs) order.push_back(slot(p, part));
  for (Proj p : kMlpProjs)
    for (ProjPart part : {kLoraA, kLoraB}) order.push_back(slot(p, part));
  c10::List<bool> wanted;
  for (int64_t s : order) wanted.push_back(needs[s]);
  OptTensor gate, up;
  if (r.gate.defined()) gate = r.gate, up = r.up;
  auto [dm2, dwg, dwu, dwd, dbg, dbu, dbd, dlora] =
      swiglu_bwd(L.cast(flat2(dy)), m2, L.cast(L.proj(kGate)), L.cast(L.proj(kUp)),
                 L.cast(L.proj(kDown)), L.cast_opt(L.proj(kGate, kBias)),
                 L.cast_opt(L.proj(kUp, kBias)), L.cast_opt(L.proj(kDown, kBias)), mlp_lora(L),
                 gate, up, wanted);
  const std::array<at::Tensor*, 6> base = {&dwg, &dwu, &dwd, &dbg, &dbu, &dbd};
  for (size_t j = 0; j < order.size(); ++j) {
    if (!needs[order[j]]) continue;
    set_grad(g, L, order[j], j < base.size() ? *base[j] : dlora[j - base.size()]);
  }
  const at::Tensor& wn = L.norm(kPostNorm);
  auto [dhn, dwn] = rms_norm_bwd(
      dm2.view(h.sizes()).to(at::promote_types(h.scalar_type(), wn.scalar_type())), h, wn, L.eps);
  if (needs[slot(kPostNorm)]) set_grad(g, L, slot(kPostNorm), dwn);
  return dy + dhn;
}

// ---- the whole call ------------------------------------------------------------------------

at::Tensor layer_forward(const at::Tensor& x, const Layer& L, Residuals& r) {
  const bool fast = L.preset == Preset::kFast;
  switch (L.part) {
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
  switch (L.part) {
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
  if (has_attention(L.part)) {
    const int64_t d = L.head_dim();
    r.q = at::empty({b, s, L.hq, d}, act).transpose(1, 2);
    r.k = at::empty({b, s, L.hkv, d}, act).transpose(1, 2);
    r.v = at::empty({b, s, L.hkv, d}, act).transpose(1, 2);
    r.out = at::empty({b, s, L.hq, d}, act).transpose(1, 2);
    r.lse = at::empty({b, L.hq, s}, x.options().dtype(at::kFloat));
  }
  r.h = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (has_mlp(L.part)) {
    r.gate = at::empty({b * s, L.proj(kGate).size(0)}, act);
    r.up = at::empty({b * s, L.proj(kGate).size(0)}, act);
  }
  return r;
}

// ---- ops -----------------------------------------------------------------------------------

#define LAYER_PARAMS                                                                          \
  const c10::List<OptTensor>&weights, const OptTensor &cos, const OptTensor &sin,           \
      const OptTensor &key_padding_mask, const OptTensor &segment_ids,                        \
      std::optional<int64_t> window, bool uniform_empty_rows,                                  \
      c10::ArrayRef<double> lora_scaling, c10::ArrayRef<double> lora_dropout,                  \
      const OptTensor &dropout_seed, int64_t num_heads,                                        \
      int64_t num_kv_heads, double eps, double scale,                                          \
      std::optional<at::ScalarType> compute_dtype, c10::string_view part,                      \
      c10::string_view preset
#define LAYER_ARGS                                                                            \
  weights, cos, sin, key_padding_mask, segment_ids, window, uniform_empty_rows, lora_scaling,  \
      lora_dropout, dropout_seed, num_heads, num_kv_heads, eps, scale, compute_dtype, part,    \
      preset

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layer_fwd(const at::Tensor& x,
                                                                  LAYER_PARAMS) {
  const char* op = "decoder_layer";
  const Layer L = make_layer(LAYER_ARGS, op);
  check_layer(op, x, L);
  if (x.numel() == 0) return {at::empty_like(x, at::MemoryFormat::Contiguous),
                              pack(empty_residuals(x, L), L)};
  Residuals r;
  at::Tensor y = layer_forward(x, L, r).contiguous();
  return {y, pack(r, L)};
}

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layer_bwd(
    const at::Tensor& dy, const at::Tensor& x, LAYER_PARAMS, at::TensorList saved,
    const c10::List<bool>& needs_grad) {
  const char* op = "decoder_layer_bwd";
  const Layer L = make_layer(LAYER_ARGS, op);
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
  // Slots without a gradient come back as empty (0,) tensors (a Tensor[] holds no None).
  const at::Tensor none = at::empty({0}, x.options());
  for (auto& d : g.dw)
    if (!d.defined()) d = none;
  return {g.dx.contiguous(), g.dw};
}

// ---- autograd: DecoderLayerFn over the two ops ---------------------------------------------

struct Options {  // the non-tensor arguments, carried through Function::apply
  std::optional<int64_t> window;
  bool uniform_empty_rows;
  std::vector<double> lora_scaling, lora_dropout;
  int64_t num_heads, num_kv_heads;
  double eps, scale;
  std::optional<at::ScalarType> compute_dtype;
  std::string part, preset;
  std::vector<int64_t> present;  // the weight slots given (Function::apply takes defined tensors)
};

void save_options(AutogradContext* ctx, const Options& o) {
  auto& d = ctx->saved_data;
  d["window"] = o.window;
  d["uniform_empty_rows"] = o.uniform_empty_rows;
  d["lora_scaling"] = c10::List<double>(o.lora_scaling);
  d["lora_dropout"] = c10::List<double>(o.lora_dropout);
  d["num_heads"] = o.num_heads;
  d["num_kv_heads"] = o.num_kv_heads;
  d["eps"] = o.eps;
  d["scale"] = o.scale;
  d["compute_dtype"] = o.compute_dtype;
  d["part"] = o.part;
  d["preset"] = o.preset;
  d["present"] = c10::List<int64_t>(o.present);
}

Options load_options(AutogradContext* ctx) {
  auto& d = ctx->saved_data;
  Options o;
  o.window = d["window"].toOptional<int64_t>();
  o.uniform_empty_rows = d["uniform_empty_rows"].toBool();
  o.lora_scaling = d["lora_scaling"].toDoubleVector();
  o.lora_dropout = d["lora_dropout"].toDoubleVector();
  o.num_heads = d["num_heads"].toInt();
  o.num_kv_heads = d["num_kv_heads"].toInt();
  o.eps = d["eps"].toDouble();
  o.scale = d["scale"].toDouble();
  o.compute_dtype = d["compute_dtype"].toOptional<at::ScalarType>();
  o.part = d["part"].toStringRef();
  o.preset = d["preset"].toStringRef();
  o.present = d["present"].toIntVector();
  return o;
}

// The signature of decoder_layer without x (decoder_layer_fwd's; decoder_layer_bwd adds dy
// before and saved, needs_grad after).
#define LAYER_SIG                                                                             \
  const c10::List<OptTensor>&, const OptTensor&, const OptTensor&, const OptTensor&,          \
      const OptTensor&, std::optional<int64_t>, bool, c10::ArrayRef<double>,                  \
      c10::ArrayRef<double>, const OptTensor&, int64_t, int64_t, double, double,              \
      std::optional<at::ScalarType>, c10::string_view, c10::string_view
using LayerSig = at::Tensor(const at::Tensor&, LAYER_SIG);
using FwdSig = std::tuple<at::Tensor, std::vector<at::Tensor>>(const at::Tensor&, LAYER_SIG);
using BwdSig = std::tuple<at::Tensor, std::vector<at::Tensor>>(
    const at::Tensor&, const at::Tensor&, LAYER_SIG, at::TensorList, const c10::List<bool>&);

// The op's weights list from the given tensors (one per slot in `present`).
c10::List<OptTensor> as_list(at::TensorList given, const std::vector<int64_t>& present) {
  c10::List<OptTensor> l(std::vector<OptTensor>(kNumSlots, std::nullopt));
  for (size_t j = 0; j < present.size(); ++j) l.set(present[j], given[j]);
  return l;
}

OptTensor as_opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Saved-tensor layout of DecoderLayerFn: x, cos, sin, mask, segment ids, dropout seed, the
// given weights (Options::present), then the residuals.
enum SavedSlot : int64_t { kSavedX = 0, kSavedCos, kSavedSin, kSavedMask, kSavedSeg,
                           kSavedSeed, kSavedWeights };

struct DecoderLayerFn : public torch::autograd::Function<DecoderLayerFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               at::TensorList weights, const OptTensor& cos,
                               const OptTensor& sin, const OptTensor& mask,
                               const OptTensor& seg, const OptTensor& seed, const Options& o) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op_handle<FwdSig>("ckpt_ext::decoder_layer_fwd");
    auto [y, saved] = fwd.call(x, as_list(weights, o.present), cos, sin, mask, seg, o.window,
                               o.uniform_empty_rows, o.lora_scaling, o.lora_dropout, seed,
                               o.num_heads, o.num_kv_heads, o.eps, o.scale, o.compute_dtype,
                               o.part, o.preset);
    variable_list to_save = {x, cos.value_or(at::Tensor()), sin.value_or(at::Tensor()),
                             mask.value_or(at::Tensor()), seg.value_or(at::Tensor()),
                             seed.value_or(at::Tensor())};
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    to_save.insert(to_save.end(), saved.begin(), saved.end());
    ctx->save_for_backward(to_save);
    save_options(ctx, o);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    CKPT_CHECK(!at::GradMode::is_enabled(), "decoder_layer",
               "double backward (create_graph=True) through a fused decoder layer is not "
               "supported: its backward is one opaque op. For higher-order gradients use "
               "policy 'none' or 'torch' with attention that has a double backward (HF: "
               "attn_implementation='eager'; ckpt_ext.modules: inside "
               "torch.nn.attention.sdpa_kernel(SDPBackend.MATH))");
    // Unpack before the guard: unpacking may run an outer checkpoint's recompute.
    const variable_list t = ctx->get_saved_variables();
    at::AutoDispatchBelowADInplaceOrView guard;
    const Options o = load_options(ctx);
    const int64_t n = static_cast<int64_t>(o.present.size());
    const at::TensorList w(t.data() + kSavedWeights, n);
    const at::TensorList saved(t.data() + kSavedWeights + n, t.size() - kSavedWeights - n);
    c10::List<bool> needs;
    for (int64_t s = 0; s < kNumSlots; ++s) needs.push_back(false);
    for (int64_t j = 0; j < n; ++j) needs.set(o.present[j], ctx->needs_input_grad(1 + j));
    static auto bwd = op_handle<BwdSig>("ckpt_ext::decoder_layer_bwd");
    auto [dx, dw] = bwd.call(grad_outputs[0], t[kSavedX], as_list(w, o.present),
                             as_opt(t[kSavedCos]), as_opt(t[kSavedSin]), as_opt(t[kSavedMask]),
                             as_opt(t[kSavedSeg]), o.window, o.uniform_empty_rows,
                             o.lora_scaling, o.lora_dropout, as_opt(t[kSavedSeed]), o.num_heads,
                             o.num_kv_heads, o.eps, o.scale, o.compute_dtype, o.part, o.preset,
                             saved, needs);
    variable_list grads = {dx};
    for (int64_t j = 0; j < n; ++j)
      grads.push_back(needs.get(o.present[j]) ? dw[o.present[j]] : at::Tensor());
    grads.resize(grads.size() + 6);  // cos, sin, mask, segment ids, seed, options
    return grads;
  }
};

Options make_options(std::optional<int64_t> window, bool uniform_empty_rows,
                     c10::ArrayRef<double> lora_scaling, c10::ArrayRef<double> lora_dropout,
                     int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                     std::optional<at::ScalarType> compute_dtype, c10::string_view part,
                     c10::string_view preset) {
  return {window, uniform_empty_rows,
          std::vector<double>(lora_scaling.begin(), lora_scaling.end()),
          std::vector<double>(lora_dropout.begin(), lora_dropout.end()), num_heads,
          num_kv_heads, eps, scale, compute_dtype, std::string(part), std::string(preset), {}};
}

at::Tensor decoder_layer_autograd(const at::Tensor& x, LAYER_PARAMS) {
  Options o = make_options(window, uniform_empty_rows, lora_scaling, lora_dropout, num_heads,
                           num_kv_heads, eps, scale, compute_dtype, part, preset);
  std::vector<at::Tensor> given;
  for (int64_t s = 0; s < static_cast<int64_t>(weights.size()); ++s) {
    const OptTensor t = weights.get(s);
    if (!checks::absent(t)) given.push_back(*t), o.present.push_back(s);
  }
  return DecoderLayerFn::apply(x, at::TensorList(given), cos, sin, key_padding_mask,
                               segment_ids, dropout_seed, o)[0];
}

// Below autograd (no grad, inference tensors): the forward alone, nothing kept.
at::Tensor decoder_layer_plain(const at::Tensor& x, LAYER_PARAMS) {
  static auto fwd = op_handle<FwdSig>("ckpt_ext::decoder_layer_fwd");
  return std::get<0>(fwd.call(x, LAYER_ARGS));
}

// Under autocast: compute in the autocast dtype (unless the caller fixed compute_dtype), with
// the inputs left as they are (see the header comment).
template <c10::DeviceType device>
at::Tensor decoder_layer_autocast(const at::Tensor& x, LAYER_PARAMS) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  static auto layer = op_handle<LayerSig>("ckpt_ext::decoder_layer");
  std::optional<at::ScalarType> dtype = compute_dtype;
  if (!dtype && x.device().type() == device && at::isFloatingType(x.scalar_type()) &&
      x.scalar_type() != at::kDouble) {
    dtype = at::autocast::get_autocast_dtype(device);
  }
  return layer.call(x, weights, cos, sin, key_padding_mask, segment_ids, window,
                    uniform_empty_rows, lora_scaling, lora_dropout, dropout_seed, num_heads,
                    num_kv_heads, eps, scale, dtype, part, preset);
}

}  // namespace

// The slot names of the `weights` list, in order (read by ckpt_ext/blocks.py).
std::vector<std::string> layer_weight_slots() {
  std::vector<std::string> names;
  for (int64_t s = 0; s < kNumSlots; ++s) names.push_back(slot_name(s));
  return names;
}

TORCH_LIBRARY_IMPL(ckpt_ext, Autograd, m) { m.impl("decoder_layer", decoder_layer_autograd); }

TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCPU, m) {
  m.impl("decoder_layer", decoder_layer_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCUDA, m) {
  m.impl("decoder_layer", decoder_layer_autocast<c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) {
  m.impl("decoder_layer", decoder_layer_plain);
  m.impl("decoder_layer_fwd", decoder_layer_fwd);
  m.impl("decoder_layer_bwd", decoder_layer_bwd);
}

}  // namespace ckpt_ext
