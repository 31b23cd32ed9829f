// Row-wise CUDA kernels of ckpt_ext: RMSNorm (forward, fused residual-add forward, backward)
// and rotary position embedding (forward and backward).
//
// This header is CUDA/C++ only (no torch): entry points take raw device pointers, sizes and
// strides counted in elements, and a cudaStream_t; they return the cudaError_t of the launch
// (cudaGetLastError after the last kernel, or cudaErrorInvalidValue for bad arguments). The
// torch-facing launchers that check tensors and pick dtypes are in rowwise_launch.cpp.
//
// Supported element types: float32, float16, bfloat16. All arithmetic is in float32; every
// output element is rounded once to its storage type.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace ckpt_ext {
namespace cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---- RMSNorm, HF LlamaRMSNorm semantics ---------------------------------------------------
// x is viewed as (rows, n): row r starts at x + r * x_row_stride, its n elements are
// contiguous. weight is (n,) contiguous. Outputs are contiguous (rows, n).
//   rstd = 1 / sqrt(mean_j(x[r, j]^2) + eps)                              (float32)
//   y[r, j] = weight[j] * float(XT(x[r, j] * rstd))  rounded to the output type
// Dtypes: x and weight each float32, float16 or bfloat16. The output (y, and dy in backward)
// has torch.promote_types(x, weight): x's dtype when weight has it, float32 otherwise.
// Rows may be 0 (nothing is launched); n must be in [1, 2^31).
cudaError_t rms_norm_fwd(const void* x, int64_t x_row_stride, const void* weight, void* y,
                         int64_t rows, int64_t n, float eps, DType x_dtype, DType w_dtype,
                         cudaStream_t stream);

// s = XT(x + residual) (rounded to x's dtype as torch's add would), y = rms_norm(s).
// residual has x's dtype; sum (rows, n) contiguous in x's dtype.
cudaError_t add_rms_norm_fwd(const void* x, int64_t x_row_stride, const void* residual,
                             int64_t residual_row_stride, const void* weight, void* y,
                             void* sum, int64_t rows, int64_t n, float eps, DType x_dtype,
                             DType w_dtype, cudaStream_t stream);

// Number of float32 elements of workspace that rms_norm_bwd needs for (rows, n) on the
// current device: one partial dweight row of n floats per block of the first stage.
cudaError_t rms_norm_bwd_workspace_size(int64_t rows, int64_t n, DType x_dtype,
                                        int64_t* num_floats);

// Backward of rms_norm_fwd; rstd is recomputed from x. dy (rows, n) has the output dtype
// (see above), row stride dy_row_stride. With n_j = x_j * rstd and g_j = dy_j * weight_j
// (float32):
//   dx[r, j]   = rstd * (g_j - n_j * mean_k(g_k * n_k))          dx (rows, n) contiguous, XT
//   dweight[j] = sum_r dy[r, j] * float(XT(n[r, j]))             (n,), weight's dtype
// dweight is reduced deterministically: stage 1 writes one float32 partial row per block into
// workspace (workspace_floats >= rms_norm_bwd_workspace_size), stage 2 sums the partial rows
// of each column in a fixed order. No atomics: bitwise identical results run to run.
cudaError_t rms_norm_bwd(const void* dy, int64_t dy_row_stride, const void* x,
                         int64_t x_row_stride, const void* weight, void* dx, void* dweight,
                         float* workspace, int64_t workspace_floats, int64_t rows, int64_t n,
                         float eps, DType x_dtype, DType w_dtype, cudaStream_t stream);

// ---- rotary position embedding, HF apply_rotary_pos_emb semantics ---------------------------
// q (B, Hq, S, D) and k (B, Hkv, S, D) with arbitrary strides for the first three dims and a
// contiguous last dim; cos/sin (Bc, S, R) with Bc in {1, B} (a batch stride of 0 broadcasts)
// and a contiguous last dim. q_out (B, Hq, S, D) and k_out (B, Hkv, S, D) likewise take any
// strides for the first three dims with a contiguous last dim (the launcher gives them the
// layout of q and k: checks::rope_out_like).
// Only the first R = rot_dim dims rotate (partial rotary embeddings; R = D: all of them); the
// other D - R are copied. With h = R / 2 and i < h (all in float32, rounded once to q's dtype):
//   forward:  out[i]     = a[i] * cos[i]     - a[i + h] * sin[i]
//             out[i + h] = a[i + h] * cos[i + h] + a[i] * sin[i + h]
//   backward (the transpose, a = dout):
//             out[i]     = a[i] * cos[i]     + a[i + h] * sin[i + h]
//             out[i + h] = a[i + h] * cos[i + h] - a[i] * sin[i]
// q and k share one dtype; cos and sin share one dtype (any of the three). D and R must be
// even, R <= D.
struct RopeArgs {
  const void* q = nullptr;
  int64_t q_stride[3] = {0, 0, 0};  // element strides of (B, Hq, S)
  const void* k = nullptr;
  int64_t k_stride[3] = {0, 0, 0};  // element strides of (B, Hkv, S)
  void* q_out = nullptr;
  int64_t q_out_stride[3] = {0, 0, 0};  // element strides of q_out's (B, Hq, S)
  void* k_out = nullptr;
  int64_t k_out_stride[3] = {0, 0, 0};  // element strides of k_out's (B, Hkv, S)
  const void* cos = nullptr;
  int64_t cos_stride[2] = {0, 0};   // element strides of (batch, S); batch stride 0 = broadcast
  const void* sin = nullptr;
  int64_t sin_stride[2] = {0, 0};
  int64_t batch = 0, heads_q = 0, heads_k = 0, seq = 0, head_dim = 0;
  int64_t rot_dim = 0;  // R: the rotated dims of a head, the first R of its D
};

cudaError_t rope(const RopeArgs& args, bool backward, DType qk_dtype, DType cs_dtype,
                 cudaStream_t stream);

}  // namespace cuda
}  // namespace ckpt_ext

// ---- device helpers shared by rms_norm.cu and rope.cu (CUDA translation units only) -------
#if defined(__CUDACC__)
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ckpt_ext {
namespace cuda {
namespace detail {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to T and widened back: the value `v.to(T)` holds in torch.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// V consecutive elements of T moved as 8-, 16- or 32-byte vectors (one uint2, one uint4 or
// two uint4), widened to / narrowed from float32. The pointer must be kAlign-aligned.
template <typename T, int V>
struct VecIO {
  static constexpr int kBytes = V * static_cast<int>(sizeof(T));
  static constexpr int kAlign = kBytes < 16 ? kBytes : 16;
  static_assert(kBytes == 8 || kBytes == 16 || kBytes == 32, "vector must be 8, 16 or 32 bytes");

  __device__ __forceinline__ static void load(const T* __restrict__ p, float (&f)[V]) {
    T t[V];
    if constexpr (kBytes == 8) {
      const uint2 r = *reinterpret_cast<const uint2*>(p);
      memcpy(t, &r, sizeof(r));
    } else {
#pragma unroll
      for (int c = 0; c < kBytes / 16; ++c) {
        const uint4 r = reinterpret_cast<const uint4*>(p)[c];
        memcpy(reinterpret_cast<char*>(t) + 16 * c, &r, sizeof(r));
      }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = to_f32(t[i]);
  }

  __device__ __forceinline__ static void store(T* __restrict__ p, const float (&f)[V]) {
    T t[V];
#pragma unroll
    for (int i = 0; i < V; ++i) t[i] = from_f32<T>(f[i]);
    if constexpr (kBytes == 8) {
      uint2 r;
      memcpy(&r, t, sizeof(r));
      *reinterpret_cast<uint2*>(p) = r;
    } else {
#pragma unroll
      for (int c = 0; c < kBytes / 16; ++c) {
        uint4 r;
        memcpy(&r, reinterpret_cast<const char*>(t) + 16 * c, sizeof(r));
        reinterpret_cast<uint4*>(p)[c] = r;
      }
    }
  }
};

// Host: can every row of an array of T (base p, row stride in elements) be moved with
// VecIO<T, V>? Row starts must all be kAlign-aligned; the stride is irrelevant for one row.
template <typename T, int V>
inline bool vec_aligned(const void* p, int64_t row_stride, int64_t rows) {
  constexpr int64_t kAlign = VecIO<T, V>::kAlign;
  if (reinterpret_cast<uintptr_t>(p) % kAlign != 0) return false;
  return rows <= 1 || (row_stride * static_cast<int64_t>(sizeof(T))) % kAlign == 0;
}

// Sum over the 32 lanes of a warp with a fixed xor butterfly: every lane gets the same,
// run-to-run identical value.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace detail
}  // namespace cuda
}  // namespace ckpt_ext
#endif  // __CUDACC__
