// The one place where every ckpt_ext operator schema is declared.
//
// Implementations are registered per dispatch key elsewhere:
//   CPU       ATen reference implementations (csrc/*_cpu.cpp), always built
//   CUDA      Triton launchers from kernels/ (registered from Python, ckpt_ext/_backend.py)
//             and CUDA C++ launchers (csrc/cuda/*.cpp, CUDA build only)
//   Autograd  C++ autograd Functions of the block ops (csrc/blocks.cpp)
//
// Conventions shared by all kernel ops:
//   * attention tensors are (B, H, S, D): q (B, Hq, S, D), k/v (B, Hkv, S, D), Hq % Hkv == 0;
//     lse is float32 (B, Hq, S) and equals -inf for a query row with nothing to attend (its
//     output row is 0 and its gradients are 0);
//   * key_padding_mask is bool (B, S), True = this key may be attended;
//   * SwiGLU ops take tokens flattened to x (T, H); weights in nn.Linear layout
//     (w_gate, w_up: (I, H); w_down: (H, I));
//   * an output that does not apply (no bias, gate/up not requested) is an empty (0,) tensor.
#include <torch/library.h>

TORCH_LIBRARY(ckpt_ext, m) {
  // ---- attention ---------------------------------------------------------------------------
  // Key j is visible from query i iff every rule given allows it: causal j <= i;
  // key_padding_mask[b, j]; segment_ids[b, i] == segment_ids[b, j] (int32/int64 (B, S), packed
  // sequences); window > 0, HF's sliding window: i - window < j (and j < i + window when not
  // causal); None or window >= S is no window. scale: finite, > 0.
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
        "Tensor? segment_ids, int? window, bool causal, float scale) -> (Tensor out, Tensor lse)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? segment_ids, int? window, bool causal, float scale) "
        "-> (Tensor dq, Tensor dk, Tensor dv)");

  // ---- SwiGLU MLP: y = (silu(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd ------------------------
  // return_gate_up=False: gate/up are never materialised and come back empty.
  m.def("swiglu_fwd(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? b_gate, "
        "Tensor? b_up, Tensor? b_down, bool return_gate_up) -> (Tensor y, Tensor gate, Tensor up)");
  // gate/up given: use them (save="gate_up"); absent: recompute them from x (save="input").
  m.def("swiglu_bwd(Tensor dy, Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "Tensor? b_gate, Tensor? b_up, Tensor? b_down, Tensor? gate, Tensor? up) -> "
        "(Tensor dx, Tensor dw_gate, Tensor dw_up, Tensor dw_down, Tensor db_gate, "
        "Tensor db_up, Tensor db_down)");

  // ---- RMSNorm over the last dim, HF LlamaRMSNorm semantics ---------------------------------
  // y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, float eps) -> (Tensor dx, Tensor dweight)");
  // s = x + residual; y = rms_norm(s). Returns (y, s).
  m.def("add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor y, Tensor sum)");

  // ---- rotary embedding, HF apply_rotary_pos_emb semantics ----------------------------------
  // q (B, Hq, S, D), k (B, Hkv, S, D), cos/sin (B or 1, S, D):
  // q_out = q * cos + rotate_half(q) * sin, with rotate_half(x) = cat(-x[D/2:], x[:D/2]).
  m.def("rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor q_out, Tensor k_out)");
  m.def("rope_bwd(Tensor dq_out, Tensor dk_out, Tensor cos, Tensor sin) -> (Tensor dq, Tensor dk)");

  // ---- block ops: C++ autograd Functions at the Autograd key (csrc/blocks.cpp) --------------
  // x, h: (B, S, H). preset: "fast" | "balanced" | "min_memory" decides what forward saves;
  // backward recomputes the rest through the kernel ops above. Weights in nn.Linear layout;
  // q_norm_weight/k_norm_weight (D,) are Qwen3's per-head norms. Causal attention.
  // Attention sublayer: x + o_proj(attention(rope(q, k), v)), q/k/v from rms_norm(x).
  m.def("attention_block(Tensor x, Tensor norm_weight, Tensor w_q, Tensor w_k, Tensor w_v, "
        "Tensor w_o, Tensor? b_q, Tensor? b_k, Tensor? b_v, Tensor? b_o, Tensor? q_norm_weight, "
        "Tensor? k_norm_weight, Tensor cos, Tensor sin, Tensor? key_padding_mask, int num_heads, "
        "int num_kv_heads, float eps, float scale, str preset) -> Tensor");
  // MLP sublayer: h + down(silu(gate(m)) * up(m)), m = rms_norm(h).
  m.def("mlp_block(Tensor h, Tensor norm_weight, Tensor w_gate, Tensor w_up, Tensor w_down, "
        "Tensor? b_gate, Tensor? b_up, Tensor? b_down, float eps, str preset) -> Tensor");
  // The whole decoder layer: mlp_block(attention_block(x)).
  m.def("decoder_layer(Tensor x, Tensor input_norm_weight, Tensor w_q, Tensor w_k, Tensor w_v, "
        "Tensor w_o, Tensor? b_q, Tensor? b_k, Tensor? b_v, Tensor? b_o, Tensor? q_norm_weight, "
        "Tensor? k_norm_weight, Tensor cos, Tensor sin, Tensor? key_padding_mask, "
        "Tensor post_norm_weight, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? b_gate, "
        "Tensor? b_up, Tensor? b_down, int num_heads, int num_kv_heads, float eps, float scale, "
        "str preset) -> Tensor");
}
