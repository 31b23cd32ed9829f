// The byte cap of the kernels' transient token chunks, and the fused layer's rows per chunk.
//
// Kernels that walk tokens in chunks to bound a (rows, N) intermediate (the LM head's (rows, V)
// logits, the layer's working set) size their chunks from one setting, the cap: the most bytes
// one such intermediate may take. Its value is the typed setting `chunk_bytes` of
// ckpt_ext.config (environment variable CKPT_EXT_CHUNK_BYTES, parsed there, once), which
// Python hands over with set_chunk_bytes whenever it changes; read at each call. A chunk has
// at least one row, so a row wider than the cap still runs, one row at a time. The default
// (64 MiB, until Python sets one) keeps the CPU LM head's speed: each chunk re-reads the whole
// (V, H) weight three times, so fewer rows per chunk cost time (T 512, H 256, fp32, 2 cores:
// fwd+bwd at V 32000 took 1.03 / 0.76 / 0.70 s with 16 / 32 / 64 MiB, at V 128256 6.6 / 4.7 /
// 3.6 s).
//
// The rows of the fused decoder layer's chunks are defined here once (layer_chunk_rows,
// mlp_chunk_rows), and those of the CPU SwiGLU and linear cross-entropy kernels
// (swiglu_chunk_rows, lce_chunk_rows); ckpt_ext.plan reads the same functions through
// ckpt_ext._C.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ckpt_ext {
namespace chunking {

constexpr int64_t kDefaultChunkBytes = int64_t{64} << 20;

inline std::atomic<int64_t>& cap_setting() {
  static std::atomic<int64_t> cap{kDefaultChunkBytes};
  return cap;
}

// The cap in bytes (ckpt_ext.config's chunk_bytes).
inline int64_t chunk_bytes() { return cap_setting().load(std::memory_order_relaxed); }

// Set by ckpt_ext.config (a positive number of bytes, checked there).
inline void set_chunk_bytes(int64_t bytes) {
  cap_setting().store(std::max<int64_t>(1, bytes), std::memory_order_relaxed);
}

// Rows per chunk for rows of row_bytes bytes each within `cap`: as many as fit, at least 1.
inline int64_t rows_within(int64_t cap, int64_t row_bytes) {
  return std::max<int64_t>(1, cap / std::max<int64_t>(1, row_bytes));
}

// Rows per chunk within the current cap.
inline int64_t chunk_rows(int64_t row_bytes) { return rows_within(chunk_bytes(), row_bytes); }

// The elements one token holds in a chunk of the layer's FFN, at the compute width: a dense
// SwiGLU's three (rows, I) tensors (the Triton backward's dh, dgate and dup; intermediate = I,
// 0 without a dense MLP or shared expert); an MoE FFN (top_k > 0) adds the k sorted copies of
// its experts' backward at their largest (csrc/moe_math.cpp: max(3 H + 5 I_e, H + 7 I_e) each,
// I_e = expert_intermediate), the (rows, H) sum they are added into, and the router's (rows, E)
// logits, scores and their gradient.
inline int64_t ffn_row_width(int64_t intermediate, int64_t hidden = 0, int64_t experts = 0,
                             int64_t top_k = 0, int64_t expert_intermediate = 0) {
  int64_t width = 3 * intermediate;
  if (top_k > 0) {
    width += top_k * std::max(3 * hidden + 5 * expert_intermediate,
                              hidden + 7 * expert_intermediate) +
             hidden + 3 * experts;
  }
  return width;
}

// The attention kernels' query rows per program on CUDA (the Triton tiles' BLOCK_M).
constexpr int64_t kAttentionTileRows = 128;
// Waves of attention programs a chunk should give a GPU at least.
constexpr int64_t kOccupancyWaves = 2;

// The fewest query rows per chunk that fill a GPU of `sms` multiprocessors: the attention
// launches one program per (tile of tile_rows query rows, query head) of a chunk's sequence,
// so a chunk of r rows gives ceil(r / tile_rows) * heads programs, and `waves` waves take
// ceil(waves * sms / heads) whole tiles (LLaMA-3-8B's 32 heads on an H100's 132 SMs: 9 tiles,
// 1,152 rows). 0 (no minimum) when any argument is not positive: the CPU.
inline int64_t occupancy_min_rows(int64_t sms, int64_t heads,
                                  int64_t tile_rows = kAttentionTileRows,
                                  int64_t waves = kOccupancyWaves) {
  if (sms <= 0 || heads <= 0 || tile_rows <= 0 || waves <= 0) return 0;
  return (waves * sms + heads - 1) / heads * tile_rows;
}

// The fewest token rows per chunk of the layer (and of its FFN) on CUDA, for its GEMMs. Each
// chunk past the first adds its weight gradients (whole (out, in) matrices) into float32 sums:
// about 10 bytes of memory traffic per weight element, against the 2 r FLOPs per element of
// the chunk's weight-gradient GEMM over r rows (and as much again for d input and for the
// forward a backward re-runs). On an H100 or H200 (about 0.8 dense bf16 PFLOP/s, 3-4.8 TB/s)
// the sums cost about 900 / r of that GEMM: 2.3x at the 390 FFN rows a 64 MiB cap gives
// LLaMA-3-8B, 7% of the three GEMMs at 4,096 rows. The extra transient at 4,096 rows is well
// under a GiB at 8B dims (the plan counts it). A batch that fits is one chunk, with no sums.
// An MoE layer needs it more: each chunk past the first adds every expert's weight gradient
// (csrc/moe_math.cpp grouped_outer_add: a grouped GEMM and a sum per block of experts; one
// GEMM and one sum per expert with fp64 or unaligned sizes), and its per-token working set
// makes the cap's chunks short (Qwen3-30B-A3B: 203 rows at 64 MiB, so a 32K sequence took
// 162 chunks, each of 256 per-expert launches before the blocks). The price there is memory: its
// 4,096 rows hold 1.3 GiB, which shortens the plan's longest MoE sequences by 6-12% (about
// 47,000 tokens).
constexpr int64_t kGemmMinRows = 4096;

// The fewest rows per layer chunk on CUDA: the attention's occupancy and the GEMMs' minimum.
inline int64_t cuda_min_rows(int64_t sms, int64_t heads) {
  return std::max(occupancy_min_rows(sms, heads), kGemmMinRows);
}

inline std::atomic<int64_t>& sms_setting() {
  static std::atomic<int64_t> sms{0};
  return sms;
}

// The multiprocessors of the CUDA device the layers run on (0 until Python sets it, at the
// first CUDA call of the fused layer: ckpt_ext.blocks); the CPU never reads it.
inline int64_t cuda_sms() { return sms_setting().load(std::memory_order_relaxed); }
inline void set_cuda_sms(int64_t sms) {
  sms_setting().store(std::max<int64_t>(0, sms), std::memory_order_relaxed);
}

// How one token chunk's gradient product (a weight's, a LoRA factor's) joins the sum over
// the chunks (csrc/layer_math.cpp Grads::addmm):
//   kProduct   one chunk: the product is the gradient (the GEMM rounds it once)
//   kInGemm    the GEMM adds it into the sum (addmm, beta 0 for the first chunk): a float32 or
//              float64 product into a sum of its own dtype anywhere; a half-precision one into
//              a float32 sum through addmm's out_dtype, which only CUDA has
//              (fp32_out_ok: the installed ATen accepts it, probed once per process)
//   kAddAfter  the product in its dtype, then added to the float32 sum (the CPU's path for
//              half-precision operands: ATen has no CPU kernel for addmm.dtype_out)
// The sum is cast to the slot's dtype once, at the end.
enum class ChunkSum : int64_t { kProduct = 0, kInGemm = 1, kAddAfter = 2 };

inline ChunkSum chunk_sum(bool chunked, bool half_operands, bool cuda, bool fp32_out_ok) {
  if (!chunked) return ChunkSum::kProduct;
  if (!half_operands) return ChunkSum::kInGemm;
  return cuda && fp32_out_ok ? ChunkSum::kInGemm : ChunkSum::kAddAfter;
}

// Tokens per chunk of the fused layer's attention sublayer or whole layer: a chunk's
// per-token working set at the compute width and at least float32 (the CPU kernels'
// precision): the attention's q, out, dout and dq (4 Hq D, q_width = Hq D) and, with the FFN,
// its ffn_row_width (0 for the attention sublayer), which the FFN's backward holds while the
// chunk's q and out wait for the attention's; at least min_rows (cuda_min_rows on CUDA, 0 on
// the CPU), which may pass the cap.
inline int64_t layer_chunk_rows(int64_t q_width, int64_t ffn_width, int64_t element_size,
                                int64_t cap, int64_t min_rows = 0) {
  return std::max(min_rows,
                  rows_within(cap, (4 * q_width + ffn_width) * std::max<int64_t>(4, element_size)));
}

// Tokens per chunk of the layer's FFN: its ffn_row_width at the compute width (at least
// float32), at least min_rows (kGemmMinRows on CUDA, 0 on the CPU), which may pass the cap.
inline int64_t mlp_chunk_rows(int64_t ffn_width, int64_t element_size, int64_t cap,
                              int64_t min_rows = 0) {
  return std::max(min_rows, rows_within(cap, ffn_width * std::max<int64_t>(4, element_size)));
}

// The CPU SwiGLU MLP's (rows, I) buffers per token chunk (csrc/swiglu_cpu.cpp): forward 4
// (2 when it returns gate and up for backward), backward 6 (4 when gate and up are given).
inline int64_t swiglu_buffers(bool backward, bool gate_up) {
  return backward ? (gate_up ? 4 : 6) : (gate_up ? 2 : 4);
}

// Tokens per chunk of the CPU SwiGLU MLP: its `buffers` (rows, I) tensors at the compute
// dtype's element size together within `cap`.
inline int64_t swiglu_chunk_rows(int64_t intermediate, int64_t buffers, int64_t element_size,
                                 int64_t cap) {
  return rows_within(cap, buffers * std::max<int64_t>(intermediate, 1) * element_size);
}

// Tokens per chunk of the CPU linear cross-entropy (csrc/linear_cross_entropy_cpu.cpp):
// `buffers` (rows, V) logits tensors at the compute dtype's element size within `cap` (one,
// two in the backward of a soft-capped head).
inline int64_t lce_chunk_rows(int64_t vocab, int64_t element_size, int64_t buffers,
                              int64_t cap) {
  return rows_within(cap, buffers * vocab * element_size);
}

}  // namespace chunking
}  // namespace ckpt_ext
