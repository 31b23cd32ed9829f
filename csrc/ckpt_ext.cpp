// The one place where every ckpt_ext operator schema is declared.
//
// Implementations are registered per dispatch key elsewhere:
//   CPU       ATen reference implementations (csrc/*_cpu.cpp), always built
//   CUDA      Triton launchers from kernels/ (registered from Python, ckpt_ext/_backend.py)
//             and CUDA C++ launchers (csrc/cuda/*.cpp, CUDA build only)
//   Autograd  the C++ autograd Function of the decoder layer (csrc/layer_autograd.cpp)
//   Autocast  decoder_layer: fixes the compute dtype (csrc/layer_autograd.cpp); every other op: runs
//             with autocast off (below), whatever autocast state it is called under
//
// Conventions shared by all kernel ops:
//   * attention tensors are (B, H, S, D): q (B, Hq, S, D), k/v (B, Hkv, S, D), Hq % Hkv == 0;
//     lse is float32 (B, Hq, S) and equals -inf for a query row with nothing to attend (its
//     output row is 0 and its gradients are 0);
//   * key_padding_mask is bool (B, S), True = this key may be attended;
//   * SwiGLU ops take tokens flattened to x (T, H); weights in nn.Linear layout
//     (w_gate, w_up: (I, H); w_down: (H, I));
//   * an output that does not apply (no bias, gate/up not requested) is an empty (0,) tensor.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>

#include "layer_spec.h"

TORCH_LIBRARY(ckpt_ext, m) {
  // ---- attention ---------------------------------------------------------------------------
  // Key j is visible from query i iff every rule given allows it: causal j <= i;
  // key_padding_mask[b, j]; segment_ids[b, i] == segment_ids[b, j] (int32/int64 (B, S), packed
  // sequences); window > 0, HF's sliding window: i - window < j (and j < i + window when not
  // causal); None or window >= S is no window. scale: finite, > 0.
  // Query chunks: q may hold Sq <= Sk rows, the queries at positions q_offset..q_offset+Sq-1
  // of the Sk keys (q_offset >= 0, q_offset + Sq <= Sk); i above is that global position, the
  // masks are (B, Sk) and out / lse / dq have q's Sq rows. dk_acc / dv_acc (B, Hkv, Sk, D),
  // float32 (float64 accepted for float64 q), any strides, given together: the chunk's dK / dV
  // are added into them in place and dk / dv come back as empty (0,) tensors.
  // softcap > 0: Gemma 2's logit soft-capping, each scaled score s becomes
  // softcap * tanh(s / softcap) before the rules above and the softmax; 0: no cap (finite,
  // >= 0).
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
        "Tensor? segment_ids, int? window, bool causal, float scale, int q_offset=0, "
        "float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? segment_ids, int? window, bool causal, float scale, "
        "int q_offset=0, Tensor(a!)? dk_acc=None, Tensor(b!)? dv_acc=None, float softcap=0.0) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");

  // ---- LoRA dropout with a replayable mask (csrc/lora_dropout.h) ----------------------------
  // x with each element of its (numel / size(-1), size(-1)) view kept with probability 1 - p
  // and scaled by 1 / (1 - p), else 0. The mask is a hash of (seed, stream, row, column), so
  // the same arguments give the same mask on every device; seed: a CPU integer tensor with one
  // element; 0 <= p < 1. The op is its own adjoint (backward applies it to the gradient).
  // Streams: the decoder layer numbers its projections q, k, v, o, gate, up, down = 0..6, and
  // the SwiGLU ops use the same numbers (4, 5, 6) for their adapters' inputs. row_offset >= 0:
  // x's rows are rows row_offset.. of a larger tensor (a token chunk), masked as there.
  m.def("lora_dropout(Tensor x, Tensor seed, int stream, float p, int row_offset=0) -> Tensor");

  // ---- SwiGLU MLP with optional LoRA adapters ------------------------------------------------
  //   gate = x Wg^T + bg + s_g (x Ag^T) Bg^T,  up likewise,
  //   y = (silu(gate) * up) Wd^T + bd + s_d ((silu(gate) * up) Ad^T) Bd^T.
  // lora: [] or [A_gate, B_gate, A_up, B_up, A_down, B_down], each None or a tensor (A (r, in),
  // B (out, r); a projection has both or neither; any float dtype, the low-rank terms are
  // computed in float32 (float64 with a float64 operand)); lora_scaling: [] or (s_g, s_u, s_d).
  // lora_dropout (trailing, optional): [] or the 3 dropout probabilities of the adapters'
  // inputs (gate, up, down), applied as lora_dropout(input converted to the LoRA dtype,
  // dropout_seed, 4 | 5 | 6, p); dropout_seed is required when one of them is > 0;
  // dropout_row_offset >= 0: x's rows are rows dropout_row_offset.. of a larger input (a token
  // chunk), and the masks are those of these global rows. dropout_streams: [] (streams 4, 5,
  // 6) or the 3 streams of gate, up, down (equal streams: one mask, e.g. a fused gate_up_proj).
  // return_gate_up=False: gate/up are never materialised and come back empty.
  // activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gelu(approximate="tanh")) in place of
  // silu above (csrc/activation.h).
  m.def("swiglu_fwd(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? b_gate, "
        "Tensor? b_up, Tensor? b_down, Tensor?[] lora, float[] lora_scaling, "
        "bool return_gate_up, float[] lora_dropout=[], Tensor? dropout_seed=None, "
        "int dropout_row_offset=0, int[] dropout_streams=[], str activation=\"silu\") -> "
        "(Tensor y, Tensor gate, "
        "Tensor up)");
  // gate/up given: use them (save="gate_up"); absent: recompute them from x (save="input").
  // needs_grad: 12 flags [w_gate, w_up, w_down, b_gate, b_up, b_down, A_gate, B_gate, A_up,
  // B_up, A_down, B_down]; a gradient not wanted (or whose tensor is absent) is not computed
  // and comes back empty. dlora has 6 entries in the order of lora, each in its adapter's dtype.
  // activation: as in swiglu_fwd (the forward's).
  // dw_gate_sum / dw_up_sum / dw_down_sum: a wanted weight gradient's sum over token chunks
  // (float32, or x's dtype; the fused layer's chunks): the op returns sum_beta * sum + dw in
  // that gradient's place, in the sum's dtype, computed inside the GEMM (addmm, with
  // out_dtype for a float32 sum of half-precision operands on CUDA); sum_beta 0 (the first
  // chunk) ignores the sum's contents.
  // lora_a_gate_sum .. lora_b_down_sum (the order of lora): a wanted adapter gradient's sum
  // over token chunks (float32 or float64, the factor's shape; the fused layer's chunks): the
  // op returns sum + d in that gradient's place, in the sum's dtype (added inside the
  // gradient's GEMM where the adapter's products are float32, as in the Triton kernels).
  m.def("swiglu_bwd(Tensor dy, Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "Tensor? b_gate, Tensor? b_up, Tensor? b_down, Tensor?[] lora, float[] lora_scaling, "
        "Tensor? gate, Tensor? up, bool[] needs_grad, float[] lora_dropout=[], "
        "Tensor? dropout_seed=None, int dropout_row_offset=0, int[] dropout_streams=[], "
        "str activation=\"silu\", Tensor? dw_gate_sum=None, Tensor? dw_up_sum=None, "
        "Tensor? dw_down_sum=None, float sum_beta=0.0, Tensor? lora_a_gate_sum=None, "
        "Tensor? lora_b_gate_sum=None, Tensor? lora_a_up_sum=None, Tensor? lora_b_up_sum=None, "
        "Tensor? lora_a_down_sum=None, Tensor? lora_b_down_sum=None) -> "
        "(Tensor dx, Tensor dw_gate, Tensor dw_up, Tensor dw_down, Tensor db_gate, "
        "Tensor db_up, Tensor db_down, Tensor[] dlora)");

  // ---- RMSNorm over the last dim, HF LlamaRMSNorm semantics ---------------------------------
  // y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, float eps) -> (Tensor dx, Tensor dweight)");
  // s = x + residual; y = rms_norm(s). Returns (y, s).
  m.def("add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor y, Tensor sum)");

  // ---- rotary embedding, HF apply_rotary_pos_emb semantics ----------------------------------
  // q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (B or 1, S, R), R even, R <= D:
  // q_out = q * cos + rotate_half(q) * sin, with rotate_half(x) = cat(-x[R/2:], x[:R/2]), on
  // the first R dims of each head; the other D - R dims are copied (partial rotary embeddings,
  // HF's partial_rotary_factor).
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor q_out, Tensor k_out)");
  m.def("rope_bwd(Tensor dq_out, Tensor dk_out, Tensor cos, Tensor sin) -> (Tensor dq, Tensor dk)");

  // ---- the fused decoder layer (csrc/layer_spec.h: its arguments, spelled once) ----------
  // x (B, S, H), then LAYER_SCHEMA: the arguments listed and described in that header.
  // router_logits: an MoE layer's router logits (B*S, E) with the option router_logits, or
  // its (3, E) load-balancing statistics with router_stats (a differentiable output), else an
  // empty (0,) tensor.
  m.def("decoder_layer(Tensor x" LAYER_SCHEMA ") -> (Tensor y, Tensor router_logits)");
  // The forward and backward of decoder_layer as opaque ops (what torch.compile sees): the
  // forward returns the preset's residuals, the backward recomputes the rest. needs_grad: one
  // flag per weight slot; slots without a gradient come back as empty (0,) tensors;
  // drouter_logits: the gradient of the forward's router_logits output (the logits or the
  // statistics; None: none reached them).
  m.def("decoder_layer_fwd(Tensor x" LAYER_SCHEMA
        ") -> (Tensor y, Tensor[] saved, Tensor router_logits)");
  m.def("decoder_layer_bwd(Tensor dy, Tensor x" LAYER_SCHEMA_REQUIRED
        ", Tensor[] saved, bool[] needs_grad, Tensor? drouter_logits=None) -> (Tensor dx, "
        "Tensor[] dweights)");

  // ---- LM head + cross-entropy loss, never holding the (T, V) logits ------------------------
  // hidden (T, H) (tokens flattened), weight (V, H) (nn.Linear layout), bias None or (V,) of
  // weight's dtype, labels (T,) int64 in [0, V) or == ignore_index. logits = hidden weight^T +
  // bias exist only a chunk / tile at a time. float32 outputs (float64 for float64 inputs):
  // The loss reads z = logit_scale logits, soft-capped when softcap > 0:
  // z = softcap tanh(logit_scale logits / softcap) (Granite passes 1 / logits_scaling, Gemma 2
  // its final_logit_softcapping); logit_scale finite > 0, softcap finite >= 0 (0: no cap).
  //   lse  (T,) = logsumexp_v z[t, v]
  //   loss (T,) = lse[t] - z[t, labels[t]], and 0 where labels[t] == ignore_index.
  m.def("linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
        "int ignore_index, float logit_scale=1., float softcap=0.) -> (Tensor loss, "
        "Tensor lse)");
  // dloss (T,) of loss's dtype, any strides (an expanded scalar for a mean): the logits are
  // recomputed from hidden and weight and turned into dlogits = dloss (softmax(z) -
  // onehot(labels)) dz/dlogits (0 on ignored tokens), dz/dlogits = logit_scale (1 - tanh^2)
  // under the cap, which give dhidden (T, H), dweight (V, H) and dbias (V,) (empty (0,)
  // without bias), in hidden's dtype. output_mask [dhidden, dweight, dbias] says which to
  // form: one not asked for is never computed and comes back empty (0,).
  m.def("linear_cross_entropy_bwd(Tensor dloss, Tensor hidden, Tensor weight, Tensor? bias, "
        "Tensor labels, Tensor lse, int ignore_index, bool[3] output_mask, "
        "float logit_scale=1., float softcap=0.) -> (Tensor dhidden, Tensor dweight, "
        "Tensor dbias)");
}

namespace {

// Kernel ops compute in the dtypes they are given. Autocast neither casts their inputs nor
// reaches the ATen ops inside them (on any device type): a backward op, run under whatever
// autocast state the caller's backward is in, computes in the dtypes its forward chose
// (decoder_layer records that choice as compute_dtype; the LM head casts before its op).
void without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

constexpr std::array<const char*, 14> kKernelOps = {
    "attention_fwd", "attention_bwd", "lora_dropout", "swiglu_fwd", "swiglu_bwd",
    "rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "rope_fwd", "rope_bwd",
    "decoder_layer_fwd", "decoder_layer_bwd", "linear_cross_entropy_fwd",
    "linear_cross_entropy_bwd"};

void register_without_autocast(torch::Library& m) {
  for (const char* name : kKernelOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&without_autocast>());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCPU, m) { register_without_autocast(m); }
TORCH_LIBRARY_IMPL(ckpt_ext, AutocastCUDA, m) { register_without_autocast(m); }
