// The fused LLaMA decoder layer: what a call is made of. Every file of the layer reads it:
//   csrc/ckpt_ext.cpp        the three schemas (LAYER_SCHEMA)
//   csrc/layer_math.cpp      decoder_layer_fwd / decoder_layer_bwd: the layer's math
//   csrc/layer_autograd.cpp  decoder_layer: the autograd Function over those two ops, and the
//                            Autocast and below-autograd kernels
//
//   decoder_layer       the user-facing op: (y, router_logits), the second an MoE layer's
//                       router logits with the option router_logits, its (3, E) load-balancing
//                       statistics with router_stats (else empty). Autocast
//                       key: fixes the compute dtype. Autograd key: DecoderLayerFn, which
//                       calls the two ops below and saves the preset's residuals. Below
//                       autograd (no grad): the forward alone.
//   decoder_layer_fwd   forward: (y, residuals, router_logits). Residuals are exactly what the
//                       preset keeps.
//   decoder_layer_bwd   backward: recomputes what the preset did not keep, returns gradients
//                       (given the router logits' gradient, adds it to the router's).
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
// (h = x + attention output, the MLP input.) A mixture-of-experts MLP (num_experts_per_tok > 0)
// keeps its routing decision (topk_idx, topk_w: 8 k bytes per token) in every preset, min_memory
// included, and no gate/up (fast neither): its backward recomputes each chunk's expert gate/up.
// `part` selects the whole layer ("layer"), the
// attention sublayer x + o_proj(attn(...)) ("attention") or the MLP sublayer
// h + down(act(gate) * up) ("mlp"; act = silu, or gelu_tanh: `activation`); a sublayer keeps
// its share of the residuals above.
//
// A family whose sublayers norm their output before the residual add (Gemma 2/3, OLMo-2: an
// output norm slot given) keeps the same residuals: its backward recomputes the sublayer's
// output, which the norm's backward reads. That is the o projection from out (min_memory
// recomputes it anyway) and the MLP's whole forward once more, since the down projection's
// output is needed before the SwiGLU backward starts.
//
// Weights travel as one list of named slots (LLaMA's HF parameter names relative to the decoder
// layer, and two output norms that LLaMA lacks, see Norm below); a projection is the four slots weight, bias, lora_A, lora_B, absent ones None. A
// LoRA projection computes x W^T + b + scaling * (dropout(x) A^T) B^T; the dropout mask is a
// hash of (dropout_seed, projection, element) (csrc/lora_dropout.h), so every recompute and
// the backward see the forward's masks.
//
// Mixed precision: with compute_dtype (set by the Autocast kernel from the autocast dtype),
// the layer computes what HF's modules compute under autocast: norms in the residual dtype
// (statistics in fp32), projections and attention in compute_dtype (weights cast transiently,
// never saved), residual adds in the residual dtype (fp32 when the master weights are fp32).
//
// Shapes: x (B, S, H); q (B, Hq, S, D); k, v (B, Hkv, S, D); out (B, Hq, S, D) (v and out
// laid out (B, S, H*, D) in memory); lse (B, Hq, S) fp32; gate, up (B*S, I); weights in
// nn.Linear layout.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "checks.h"

namespace ckpt_ext {
namespace layer {

using OptTensor = std::optional<at::Tensor>;

// ---- the op's arguments, spelled once ------------------------------------------------------
//
// decoder_layer(Tensor x, <the list below>) -> Tensor, in this order. Each row is
// X(KIND, schema type, C++ parameter type, name, default); KIND says how the autograd Function
// carries the argument from forward to backward:
//   WEIGHTS  the slot list (its given tensors are the Function's differentiable inputs)
//   TENSOR   an optional tensor without a gradient, saved with save_for_backward
//   OPTION   a value, kept in the autograd context's saved_data
// default is the schema's "=value" ("" for none), so the registered schema carries it; Python
// builds its record of the arguments (ckpt_ext.blocks.LayerOptions) from that schema. A new
// argument is its row (with its line below), its use in csrc/layer_math.cpp, and the caller
// that sets it; the schemas, the kernels' signatures, the autograd Function, the Python record
// and the fakes follow from the list.
//
//   weights             the layer's tensors in the named slots below (kNumSlots)
//                       (ckpt_ext.blocks.WEIGHT_SLOTS), None where absent
//   cos, sin            (B or 1, S, D), required unless part is "mlp"
//   key_padding_mask,
//   segment_ids,
//   window              as in attention_fwd; the layer is causal
//   uniform_empty_rows  a query row with no key to attend averages all values uniformly, as
//                       HF's eager attention computes it (the kernels' rule otherwise: 0)
//   lora_scaling        one factor per projection (q, k, v, o, gate, up, down), or [] without
//                       adapters
//   lora_dropout        [] or one dropout probability per projection, applied to the
//                       adapter's input (lora_dropout with stream = the projection's index)
//   dropout_seed        required when a dropout probability is > 0 (backward replays the
//                       forward's masks from it)
//   lora_streams        [] (each projection hashes its masks with stream = its index) or one
//                       stream per projection: projections of one fused module (Phi-3's
//                       qkv_proj, gate_up_proj) share one input, one adapter and so one mask,
//                       and are given one stream
//   expert_lora_scaling [] without adapters on the MoE experts, else two factors: the LoRA
//                       scaling of mlp.experts.gate_up_proj and of mlp.experts.down_proj (the
//                       factors' slots below; 0 for a weight without them). No dropout: PEFT
//                       refuses it on expert parameters
//   num_heads,
//   num_kv_heads, eps   the attention's heads (num_kv_heads None: num_heads); the norms'
//                       epsilon
//   scale               the attention's softmax scale (None: 1 / sqrt(head_dim))
//   softcap             > 0: Gemma 2's attention logit soft-capping, each scaled score s
//                       becomes softcap * tanh(s / softcap) (as attention_fwd); 0: none
//   sequence_parallel   "" (none), or the registered name of a torch.distributed group
//                       (ProcessGroup.group_name) of N ranks over which every sequence is
//                       split: this rank holds positions rank*S .. rank*S + S - 1 of each
//                       (cos/sin at those positions, key_padding_mask / segment_ids (B, S) of
//                       its tokens) and the attention runs Ulysses-style, q/k/v exchanged by
//                       all-to-all (csrc/ulysses.h); every rank passes the same shapes and
//                       options. LoRA dropout hashes the global row b*N*S + rank*S + s. An
//                       MoE MLP routes and runs the experts on the rank's own tokens (its
//                       router_logits are those tokens' rows)
//   rope_interleaved    false: RoPE rotates the pairs (i, i + R/2) of the first R dims (LLaMA's
//                       rotate_half); true: the pairs (2i, 2i + 1) (GLM, Helium, ERNIE 4.5),
//                       by the angle of the tables' column i either way (cos/sin keep HF's
//                       half-split layout, (B or 1, S, R))
//   qk_norm_after_rope  false: the q/k norms norm the projections and RoPE rotates their
//                       output (Qwen3, Gemma 3, OLMo-2); true: RoPE rotates the projections and
//                       the norms norm that (Hunyuan); no effect without q/k norms
//   norm_offset         every RMSNorm multiplies by (norm_offset + weight): 0 for LLaMA, 1 for
//                       Gemma's (1 + w)
//   norm_cast_last      false: the normalized input is cast to the input's dtype, then
//                       multiplied by the weight (LLaMA; the result takes the promoted dtype);
//                       true: the weight is applied in float32 (at least) and the result cast to
//                       the input's dtype (Gemma, OLMo-2). Under bf16 they round differently.
//   residual_scale      each sublayer's output is multiplied by it before the residual add
//                       (Granite's residual_multiplier; 1: LLaMA)
//   compute_dtype       the dtype of the projections and attention (None: the weights';
//                       set from torch.autocast by the Autocast kernel)
//   activation          the MLP's gate activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU,
//                       Gemma's gelu_pytorch_tanh), csrc/activation.h
//   num_experts_per_tok 0: the MLP is the dense gated MLP of the mlp.*_proj slots; k > 0: a
//                       mixture of experts (the MoE slots below), each token routed to k
//                       experts (csrc/moe_math.h)
//   router              the MoE router's scores over the experts' logits: "softmax" | "sigmoid"
//                       (in float32, then top-k)
//   norm_topk_prob      the k selected scores are divided by their sum (Mixtral always;
//                       Qwen-MoE and OLMoE by their config's flag)
//   router_logits       an MoE layer also returns its router's logits m Wr^T (B*S, E), in
//                       the dtype of the MLP input m (the compute dtype): what HF's router
//                       returns and transformers collects with output_router_logits=True.
//                       They are differentiable (a load-balancing loss on them reaches the
//                       router weight and x through the op's backward); computed anyway for
//                       the routing, they cost one (B*S, E) output, nothing saved. False: the
//                       op's second output is an empty (0,) tensor
//   router_stats        an MoE layer returns instead of its logits the O(E) statistics of
//                       HF's load-balancing loss (moe::router_stats, csrc/moe_math.h): a
//                       (3, E) tensor in float32 (float64 for a float64 compute dtype), the
//                       key_padding_mask-weighted sums over its tokens of the top-k counts, of
//                       the softmax probabilities (differentiable: the backward adds their
//                       gradient to the router's, recomputing the logits per chunk) and of
//                       the token weights. Excludes router_logits; not with sequence_parallel
//   part                "layer" | "attention" | "mlp"
//   preset              "fast" | "balanced" | "min_memory": what forward keeps
//   chunk_rows          None: the layer's token chunks hold the rows the byte cap gives
//                       (csrc/chunking.h layer_chunk_rows / mlp_chunk_rows: chunk_bytes, read
//                       at each call, and the CUDA minimum); n >= 1: n token rows a chunk, the
//                       layer's and its MLP's (whole sequences packed while they fit), neither
//                       the cap nor the CUDA minimum applied: ckpt_ext.plan.choose_chunk_rows
//                       picks it for time where memory allows. The autograd Function saves it
//                       with the other options, so the backward walks the forward's chunks
#define CKPT_DECODER_LAYER_ARGS(X, ...)                                                  \
  X(WEIGHTS, "Tensor?[]", const c10::List<OptTensor>&, weights, "", __VA_ARGS__)            \
  X(TENSOR, "Tensor?", const OptTensor&, cos, "=None", __VA_ARGS__)                         \
  X(TENSOR, "Tensor?", const OptTensor&, sin, "=None", __VA_ARGS__)                         \
  X(TENSOR, "Tensor?", const OptTensor&, key_padding_mask, "=None", __VA_ARGS__)            \
  X(TENSOR, "Tensor?", const OptTensor&, segment_ids, "=None", __VA_ARGS__)                 \
  X(OPTION, "int?", std::optional<int64_t>, window, "=None", __VA_ARGS__)                   \
  X(OPTION, "bool", bool, uniform_empty_rows, "=False", __VA_ARGS__)                        \
  X(OPTION, "float[]", c10::ArrayRef<double>, lora_scaling, "=[]", __VA_ARGS__)             \
  X(OPTION, "float[]", c10::ArrayRef<double>, lora_dropout, "=[]", __VA_ARGS__)             \
  X(TENSOR, "Tensor?", const OptTensor&, dropout_seed, "=None", __VA_ARGS__)                \
  X(OPTION, "int[]", c10::ArrayRef<int64_t>, lora_streams, "=[]", __VA_ARGS__)              \
  X(OPTION, "float[]", c10::ArrayRef<double>, expert_lora_scaling, "=[]", __VA_ARGS__)      \
  X(OPTION, "int", int64_t, num_heads, "=1", __VA_ARGS__)                                   \
  X(OPTION, "int?", std::optional<int64_t>, num_kv_heads, "=None", __VA_ARGS__)             \
  X(OPTION, "float", double, eps, "=1e-06", __VA_ARGS__)                                    \
  X(OPTION, "float?", std::optional<double>, scale, "=None", __VA_ARGS__)                   \
  X(OPTION, "float", double, softcap, "=0.", __VA_ARGS__)                                   \
  X(OPTION, "str", c10::string_view, sequence_parallel, "=\"\"", __VA_ARGS__)               \
  X(OPTION, "bool", bool, rope_interleaved, "=False", __VA_ARGS__)                          \
  X(OPTION, "bool", bool, qk_norm_after_rope, "=False", __VA_ARGS__)                        \
  X(OPTION, "float", double, norm_offset, "=0.", __VA_ARGS__)                               \
  X(OPTION, "bool", bool, norm_cast_last, "=False", __VA_ARGS__)                            \
  X(OPTION, "float", double, residual_scale, "=1.", __VA_ARGS__)                            \
  X(OPTION, "ScalarType?", std::optional<at::ScalarType>, compute_dtype, "=None", __VA_ARGS__)\
  X(OPTION, "str", c10::string_view, activation, "=\"silu\"", __VA_ARGS__)                  \
  X(OPTION, "int", int64_t, num_experts_per_tok, "=0", __VA_ARGS__)                         \
  X(OPTION, "str", c10::string_view, router, "=\"softmax\"", __VA_ARGS__)                  \
  X(OPTION, "bool", bool, norm_topk_prob, "=False", __VA_ARGS__)                            \
  X(OPTION, "bool", bool, router_logits, "=False", __VA_ARGS__)                             \
  X(OPTION, "bool", bool, router_stats, "=False", __VA_ARGS__)                              \
  X(OPTION, "str", c10::string_view, part, "=\"layer\"", __VA_ARGS__)                       \
  X(OPTION, "str", c10::string_view, preset, "=\"balanced\"", __VA_ARGS__)                \
  X(OPTION, "int?", std::optional<int64_t>, chunk_rows, "=None", __VA_ARGS__)

// What the list generates. The first five start each argument with a comma, to follow x
// (or dy, x):
//   "decoder_layer(Tensor x" LAYER_SCHEMA ") -> Tensor"     the schema text, with the defaults
//   LAYER_SCHEMA_REQUIRED                                   the same without defaults (for an
//                                                           op whose arguments go on after them)
//   f(const at::Tensor& x LAYER_PARAMS)                     a kernel's parameters
//   op.call(x LAYER_ARGS)                                   passing them on
//   T(const at::Tensor& LAYER_SIG)                          the C++ signature
//   op.call(x LAYER_ARGS_OF(w, t, o))                       the arguments from a weights list
//                                                           w, a LayerTensors t and a
//                                                           LayerOptions o
//   CKPT_LAYER_EACH(TENSOR | OPTION, F)                     F(param type, name) for each
//                                                           argument of that kind
#define CKPT_LAYER_SCHEMA_(kind, schema, param, name, dflt, ...) ", " schema " " #name dflt
#define CKPT_LAYER_PARAM_(kind, schema, param, name, dflt, ...) , param name
#define CKPT_LAYER_ARG_(kind, schema, param, name, dflt, ...) , name
#define CKPT_LAYER_TYPE_(kind, schema, param, name, dflt, ...) , param
#define CKPT_LAYER_SCHEMA_REQUIRED_(kind, schema, param, name, dflt, ...) ", " schema " " #name
#define LAYER_SCHEMA CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_SCHEMA_, )
#define LAYER_SCHEMA_REQUIRED CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_SCHEMA_REQUIRED_, )
#define LAYER_PARAMS CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_PARAM_, )
#define LAYER_ARGS CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_ARG_, )
#define LAYER_SIG CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_TYPE_, )

#define CKPT_LAYER_OF_(kind, schema, param, name, dflt, w, t, o) , CKPT_LAYER_OF_##kind(name, w, t, o)
#define CKPT_LAYER_OF_WEIGHTS(name, w, t, o) w
#define CKPT_LAYER_OF_TENSOR(name, w, t, o) t.name
#define CKPT_LAYER_OF_OPTION(name, w, t, o) o.name
#define LAYER_ARGS_OF(w, t, o) CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_OF_, w, t, o)

#define CKPT_LAYER_PICK_(kind, schema, param, name, dflt, want, f) \
  CKPT_LAYER_PICK_##want##_##kind(f, param, name)
#define CKPT_LAYER_PICK_TENSOR_WEIGHTS(f, param, name)
#define CKPT_LAYER_PICK_TENSOR_TENSOR(f, param, name) f(param, name)
#define CKPT_LAYER_PICK_TENSOR_OPTION(f, param, name)
#define CKPT_LAYER_PICK_OPTION_WEIGHTS(f, param, name)
#define CKPT_LAYER_PICK_OPTION_TENSOR(f, param, name)
#define CKPT_LAYER_PICK_OPTION_OPTION(f, param, name) f(param, name)
#define CKPT_LAYER_EACH(want, f) CKPT_DECODER_LAYER_ARGS(CKPT_LAYER_PICK_, want, f)

// An OPTION as it is kept once the call has returned (a list or a string is copied).
inline std::vector<double> store(c10::ArrayRef<double> a) { return a.vec(); }
inline std::vector<int64_t> store(c10::ArrayRef<int64_t> a) { return a.vec(); }
inline std::string store(c10::string_view s) { return std::string(s); }
template <class T>
T store(const T& v) {
  return v;
}
template <class Param>
using Stored = decltype(store(std::declval<Param>()));

// The TENSOR arguments, as given.
struct LayerTensors {
#define CKPT_LAYER_FIELD_(param, name) OptTensor name;
  CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_FIELD_)
#undef CKPT_LAYER_FIELD_
};

// The OPTION arguments, kept (Stored) so that they outlive the call.
struct LayerOptions {
#define CKPT_LAYER_FIELD_(param, name) Stored<param> name;
  CKPT_LAYER_EACH(OPTION, CKPT_LAYER_FIELD_)
#undef CKPT_LAYER_FIELD_

  // Into / out of an autograd context's saved_data, one entry per option, by name. Context is
  // torch::autograd::AutogradContext, a template parameter so that this header, which every
  // file of the layer includes, does not pull in the autograd headers.
  template <class Context>
  void save(Context* ctx) const {
    auto& d = ctx->saved_data;
#define CKPT_LAYER_SAVE_(param, name) d[#name] = to_ivalue(name);
    CKPT_LAYER_EACH(OPTION, CKPT_LAYER_SAVE_)
#undef CKPT_LAYER_SAVE_
  }

  template <class Context>
  static LayerOptions load(Context* ctx) {
    auto& d = ctx->saved_data;
    LayerOptions o;
#define CKPT_LAYER_LOAD_(param, name) o.name = from_ivalue<decltype(o.name)>(d[#name]);
    CKPT_LAYER_EACH(OPTION, CKPT_LAYER_LOAD_)
#undef CKPT_LAYER_LOAD_
    return o;
  }

 private:
  template <class T>
  static c10::IValue to_ivalue(const T& v) {
    return c10::IValue(v);
  }
  static c10::IValue to_ivalue(const std::vector<double>& v) { return c10::List<double>(v); }
  static c10::IValue to_ivalue(const std::vector<int64_t>& v) { return c10::List<int64_t>(v); }
  template <class T>
  static T from_ivalue(const c10::IValue& v) {
    if constexpr (std::is_same_v<T, std::vector<double>>) {
      return v.toDoubleVector();
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      return v.toIntVector();
    } else if constexpr (std::is_same_v<T, std::string>) {
      return v.toStringRef();
    } else {
      return v.to<T>();
    }
  }
};

// LayerTensors / LayerOptions from a kernel's LAYER_PARAMS.
#define CKPT_LAYER_NAME_(param, name) name,
#define CKPT_LAYER_STORE_(param, name) ::ckpt_ext::layer::store(name),
#define LAYER_TENSORS_OF_PARAMS \
  ::ckpt_ext::layer::LayerTensors { CKPT_LAYER_EACH(TENSOR, CKPT_LAYER_NAME_) }
#define LAYER_OPTIONS_OF_PARAMS \
  ::ckpt_ext::layer::LayerOptions { CKPT_LAYER_EACH(OPTION, CKPT_LAYER_STORE_) }

// ---- weight slots ----------------------------------------------------------------------------

// The norms by role. kInputNorm and kPostNorm are the pre-norms of the attention and of the
// MLP (LLaMA's input_layernorm and post_attention_layernorm); kAttnOutNorm and kMlpOutNorm norm
// a sublayer's output before the residual add (Gemma 2/3's post_attention_layernorm and
// post_feedforward_layernorm, OLMo-2's likewise). Every norm is optional: an absent one is the
// identity (OLMo-2 has no pre-norms, LLaMA no output norms). q/k norms are per head, weight
// (head_dim,) (Qwen3, Gemma 3), or over the whole projection, weight (heads * head_dim,)
// (OLMo-2).
enum Norm : int64_t { kInputNorm = 0, kQNorm, kKNorm, kPostNorm, kAttnOutNorm, kMlpOutNorm,
                      kNumNorms };
enum Proj : int64_t { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kNumProjs };
enum ProjPart : int64_t { kWeight = 0, kBias, kLoraA, kLoraB, kNumProjParts };
// ---- MoE slots (num_experts_per_tok > 0), after the projections' -----------------------------
// The router's weight (E, H) (HF's mlp.gate.weight), the routed experts in transformers 5's
// layout, gate_up_proj (E, 2I, H) (gate rows first, then up) and down_proj (E, H, I), and the
// optional sigmoid gate (1, H) of the shared expert (Qwen2-MoE). The shared expert itself is
// the dense MLP's slots mlp.gate_proj / up_proj / down_proj (with their biases and adapters):
// with them given, the MoE's output is routed + shared (times the gate's sigmoid when given).
// Then PEFT's LoRA factors of the two expert weights (LoraConfig(target_parameters=...)), in
// PEFT's layouts: gate_up_proj's lora_A (r E, H) and lora_B (2I, r E), down_proj's lora_A
// (r E, I) and lora_B (H, r E), expert e's A_e = A.view(E, r, in)[e] and B_e =
// B.view(out, r, E)[:, :, e] (csrc/moe_math.h), with the scalings expert_lora_scaling.
enum MoeSlot : int64_t { kRouter = 0, kExpertsGateUp, kExpertsDown, kSharedGate,
                         kExpertsGateUpLoraA, kExpertsGateUpLoraB, kExpertsDownLoraA,
                         kExpertsDownLoraB, kNumMoeSlots };
constexpr int64_t kFirstMoeSlot = int64_t{kNumNorms} + int64_t{kNumProjs} * int64_t{kNumProjParts};
constexpr int64_t kNumSlots = kFirstMoeSlot + int64_t{kNumMoeSlots};

constexpr int64_t slot(Norm n) { return n; }
constexpr int64_t slot(Proj p, ProjPart part) {
  return int64_t{kNumNorms} + int64_t{p} * int64_t{kNumProjParts} + int64_t{part};
}
constexpr int64_t slot(MoeSlot m) { return kFirstMoeSlot + int64_t{m}; }
constexpr bool is_moe_slot(int64_t s) { return s >= kFirstMoeSlot; }

inline const std::array<const char*, kNumNorms> kNormNames = {
    "input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "post_attention_layernorm.weight", "attention_output_norm.weight", "mlp_output_norm.weight"};
inline const std::array<const char*, kNumProjs> kProjNames = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
inline const std::array<const char*, kNumProjParts> kProjPartNames = {"weight", "bias", "lora_A",
                                                                "lora_B"};

inline const std::array<const char*, kNumMoeSlots> kMoeNames = {
    "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
    "mlp.shared_expert_gate.weight", "mlp.experts.gate_up_proj.lora_A",
    "mlp.experts.gate_up_proj.lora_B", "mlp.experts.down_proj.lora_A",
    "mlp.experts.down_proj.lora_B"};

inline std::string slot_name(int64_t s) {
  if (s < kNumNorms) return kNormNames[s];
  if (is_moe_slot(s)) return kMoeNames[s - kFirstMoeSlot];
  const int64_t i = s - kNumNorms;
  return std::string(kProjNames[i / kNumProjParts]) + "." + kProjPartNames[i % kNumProjParts];
}

// ---- part and preset ---------------------------------------------------------------------------

enum class Preset { kFast, kBalanced, kMinMemory };
enum class Part { kLayer, kAttention, kMlp };

inline Preset parse_preset(c10::string_view name, const char* op) {
  if (name == "fast") return Preset::kFast;
  if (name == "balanced") return Preset::kBalanced;
  if (name == "min_memory") return Preset::kMinMemory;
  CKPT_CHECK_VALUE(false, op, "preset must be one of 'fast', 'balanced', 'min_memory', got '",
                   std::string(name), "'");
}

inline Part parse_part(c10::string_view name, const char* op) {
  if (name == "layer") return Part::kLayer;
  if (name == "attention") return Part::kAttention;
  if (name == "mlp") return Part::kMlp;
  CKPT_CHECK_VALUE(false, op, "part must be one of 'layer', 'attention', 'mlp', got '",
                   std::string(name), "'");
}

inline bool has_attention(Part p) { return p != Part::kMlp; }
inline bool has_mlp(Part p) { return p != Part::kAttention; }

// Whether part p reads weight slot s: a sublayer ignores the other sublayer's slots (given a
// whole layer's weights, those get no gradient).
inline bool uses_slot(Part p, int64_t s) {
  if (p == Part::kLayer) return true;
  const bool mlp_slot = s == slot(kPostNorm) || s == slot(kMlpOutNorm) || is_moe_slot(s) ||
                        (s >= slot(kGate, kWeight) && s < slot(kDown, kWeight) + kNumProjParts);
  return mlp_slot == (p == Part::kMlp);
}

// ---- one call ------------------------------------------------------------------------------

// Everything of a call but x and the residuals: the arguments (TENSOR ones absent = nullopt),
// the weights by slot, part and preset parsed.
struct Layer : LayerTensors, LayerOptions {
  std::vector<at::Tensor> w;  // kNumSlots, undefined = absent
  Part part_id;
  Preset preset_id;
  // The options given as None, resolved (these hide LayerOptions' optional fields of the same
  // names): num_kv_heads = num_heads; scale = 1 / sqrt(head_dim), 1 without a q projection.
  int64_t num_kv_heads;
  double scale;
  // The adapter factors converted for the ops, by slot, once per call (layer_math.cpp's
  // lora_factor): the token chunks of a call share them.
  mutable std::vector<at::Tensor> factor_cache = std::vector<at::Tensor>(kNumSlots);

  const at::Tensor& at(int64_t s) const { return w[s]; }
  const at::Tensor& norm(Norm n) const { return w[slot(n)]; }
  const at::Tensor& proj(Proj p, ProjPart part = kWeight) const { return w[slot(p, part)]; }
  int64_t head_dim() const { return proj(kQ).size(0) / num_heads; }
  bool has_norm(Norm n) const { return norm(n).defined(); }
  bool qk_norm() const { return has_norm(kQNorm); }
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
  bool has_lora(Proj p) const { return proj(p, kLoraA).defined(); }
  // The stream projection p's dropout masks hash (lora_streams).
  int64_t stream(Proj p) const { return lora_streams.empty() ? int64_t{p} : lora_streams[p]; }
  // The dtype of the low-rank term: the compute dtype, or the adapter's own (PEFT keeps fp32
  // adapters on a half-precision base and computes their term in fp32).
  at::ScalarType lora_dtype(Proj p) const {
    return compute_dtype.value_or(proj(p, kLoraA).scalar_type());
  }
  bool mlp_has_lora() const { return has_lora(kGate) || has_lora(kUp) || has_lora(kDown); }
  // A mixture-of-experts MLP (num_experts_per_tok > 0), its MoE slots, and whether it has a
  // shared expert (the dense MLP slots given beside the experts).
  bool moe() const { return num_experts_per_tok > 0; }
  const at::Tensor& moe_w(MoeSlot m) const { return w[slot(m)]; }
  bool has_dense_mlp() const { return proj(kGate).defined(); }
  bool experts_lora() const {
    return moe_w(kExpertsGateUpLoraA).defined() || moe_w(kExpertsDownLoraA).defined();
  }
  // A sublayer's output (or its gradient) times residual_scale: t itself when that is 1, else
  // a new tensor (t may be a view of the caller's).
  at::Tensor residual_scaled(const at::Tensor& t) const {
    return residual_scale == 1.0 ? t : t.mul(residual_scale);
  }
};

// ---- residuals -----------------------------------------------------------------------------

// Every tensor a preset may keep, named (the names ckpt_ext.blocks reads, kResidualNames).
// topk_idx (B*S, k) int32 and topk_w (B*S, k) float32 (float64 for a float64 compute dtype): an
// MoE layer's routing decision (every
// preset keeps it, so that no recompute routes differently).
#define CKPT_LAYER_RESIDUALS(X) X(q) X(k) X(v) X(out) X(lse) X(h) X(gate) X(up) X(topk_idx) X(topk_w)

struct Residuals {
#define CKPT_LAYER_RESIDUAL_(name) at::Tensor name;
  CKPT_LAYER_RESIDUALS(CKPT_LAYER_RESIDUAL_)
#undef CKPT_LAYER_RESIDUAL_
  // Never kept: with router_logits, the forward's (B*S, E) router logits (an output of the
  // op) and, in the backward, their gradient (undefined when none reached them).
  at::Tensor router_logits, drouter_logits;
  // With router_stats: the forward's (3, E) statistics (summed chunk by chunk) and, in the
  // backward, their gradient (undefined when none reached them).
  at::Tensor router_stats, drouter_stats;
  // With router_stats and a key padding mask: the rows' weights in those statistics (the mask
  // flattened to (B*S,), 1 = a real token), an input read by the MLP calls, not kept.
  at::Tensor stats_w;
};

using Member = at::Tensor Residuals::*;

// What (part, preset) keeps, in the order of decoder_layer_fwd's `saved` output; with an MoE
// MLP (moe) the routing decision in every preset and no gate/up (fast keeps no expert's).
inline std::vector<Member> kept(Part part, Preset preset, bool moe = false) {
  // push_back, not insert of an initializer list: GCC 12 at -O3 reads the latter as an
  // out-of-bounds copy (-Warray-bounds / -Wstringop-overflow false positives)
  std::vector<Member> m;
  m.reserve(8);
  auto add = [&m](std::initializer_list<Member> ms) {
    for (Member x : ms) m.push_back(x);
  };
  if (moe && has_mlp(part)) add({&Residuals::topk_idx, &Residuals::topk_w});
  if (preset == Preset::kMinMemory) return m;
  if (has_attention(part)) {
    if (preset == Preset::kFast) add({&Residuals::q, &Residuals::k, &Residuals::v});
    add({&Residuals::out, &Residuals::lse});
  }
  if (part == Part::kLayer) m.push_back(&Residuals::h);
  if (has_mlp(part) && preset == Preset::kFast && !moe) add({&Residuals::gate, &Residuals::up});
  return m;
}

inline const char* residual_name(Member m) {
#define CKPT_LAYER_RESIDUAL_NAME_(name) \
  if (m == &Residuals::name) return #name;
  CKPT_LAYER_RESIDUALS(CKPT_LAYER_RESIDUAL_NAME_)
#undef CKPT_LAYER_RESIDUAL_NAME_
  TORCH_INTERNAL_ASSERT(false, "not a residual");
}

// ---- the two ops (csrc/layer_math.cpp) -----------------------------------------------------

// (y, saved, router_logits): router_logits (B*S, E) with the option router_logits, the (3, E)
// statistics with router_stats, else an empty (0,) tensor.
using FwdResult = std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor>;
using BwdResult = std::tuple<at::Tensor, std::vector<at::Tensor>>;  // (dx, dweights)

FwdResult decoder_layer_fwd(const at::Tensor& x LAYER_PARAMS);
// drouter_logits: the gradient of the forward's second output, router_logits or router_stats
// (nullopt: none).
BwdResult decoder_layer_bwd(const at::Tensor& dy, const at::Tensor& x LAYER_PARAMS,
                            at::TensorList saved, const c10::List<bool>& needs_grad,
                            const OptTensor& drouter_logits);
// Test hook: every decoder_layer_bwd reads its input as a streamed one (chunks copied), also
// when it is on the layer's device (ckpt_ext._C.set_streamed_input_check).
void set_streamed_input_check(bool on);

}  // namespace layer
}  // namespace ckpt_ext
