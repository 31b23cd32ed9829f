// Rotary position embedding (HF apply_rotary_pos_emb), forward and backward, q and k in one
// launch. Entry point and the math are in rowwise.cuh (RopeArgs, rope()).
//
// Work layout: block b handles the positions p = b, b + gridDim.x, ... of the (B * S) grid;
// for a position it holds its cos/sin pairs in registers and applies them to every head of q
// and then of k (heads 0 .. Hq + Hkv - 1). threadIdx.x walks the "units" of a head row (a unit
// is W column pairs (i, i + R/2), W = 16 / sizeof(q) on the vector path, 1 otherwise, and then,
// with partial rotary embeddings (R < D), W of the D - R columns that are copied);
// threadIdx.y walks the heads. A warp thus reads whole 16-byte-vector head rows.
#include <algorithm>
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "rowwise.cuh"

namespace ckpt_ext {
namespace cuda {
namespace {

using detail::from_f32;
using detail::to_f32;
using detail::VecIO;

constexpr int kRopeThreads = 256;

// W consecutive elements of T at p, as float32 (vector load when kVec).
template <typename T, int W, bool kVec>
__device__ __forceinline__ void load_w(const T* __restrict__ p, float (&f)[W]) {
  if constexpr (kVec) {
    VecIO<T, W>::load(p, f);
  } else {
    static_assert(W == 1, "the scalar path moves one element");
    f[0] = to_f32(*p);
  }
}

template <typename T, int W, bool kVec>
__device__ __forceinline__ void store_w(T* __restrict__ p, const float (&f)[W]) {
  if constexpr (kVec) {
    VecIO<T, W>::store(p, f);
  } else {
    static_assert(W == 1, "the scalar path moves one element");
    *p = from_f32<T>(f[0]);
  }
}

// T: q/k dtype; CT: cos/sin dtype. See rowwise.cuh for the formulas.
template <typename T, typename CT, bool kBackward, bool kVec>
__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const RopeArgs a) {
  constexpr int W = kVec ? 16 / static_cast<int>(sizeof(T)) : 1;
  const T* __restrict__ q = static_cast<const T*>(a.q);
  const T* __restrict__ k = static_cast<const T*>(a.k);
  T* __restrict__ q_out = static_cast<T*>(a.q_out);
  T* __restrict__ k_out = static_cast<T*>(a.k_out);
  const CT* __restrict__ cos = static_cast<const CT*>(a.cos);
  const CT* __restrict__ sin = static_cast<const CT*>(a.sin);
  const int64_t seq = a.seq;
  const int half = static_cast<int>(a.rot_dim / 2);
  const int units = half / W;  // the vector path is only taken when W divides R / 2 and D - R
  const int pass_units = static_cast<int>(a.head_dim - a.rot_dim) / W;
  const int heads_q = static_cast<int>(a.heads_q);
  const int heads = heads_q + static_cast<int>(a.heads_k);
  const int64_t positions = a.batch * seq;
  // Row (b, s) of head hd, counting q's heads first and then k's: its input and output.
  auto head_rows = [&](int hd, int64_t b, int64_t s, const T*& in, T*& out) {
    const bool is_q = hd < heads_q;
    const int64_t head = is_q ? hd : hd - heads_q;
    const int64_t* is = is_q ? a.q_stride : a.k_stride;
    const int64_t* os = is_q ? a.q_out_stride : a.k_out_stride;
    in = (is_q ? q : k) + b * is[0] + head * is[1] + s * is[2];
    out = (is_q ? q_out : k_out) + b * os[0] + head * os[1] + s * os[2];
  };

  for (int64_t pos = blockIdx.x; pos < positions; pos += gridDim.x) {
    const int64_t b = pos / seq;
    const int64_t s = pos - b * seq;
    const CT* cr = cos + b * a.cos_stride[0] + s * a.cos_stride[1];
    const CT* sr = sin + b * a.sin_stride[0] + s * a.sin_stride[1];
    for (int u = static_cast<int>(threadIdx.x); u < units + pass_units;
         u += static_cast<int>(blockDim.x)) {
      if (u >= units) {  // columns R.. pass through
        const int i = 2 * half + (u - units) * W;
        for (int hd = static_cast<int>(threadIdx.y); hd < heads;
             hd += static_cast<int>(blockDim.y)) {
          const T* in;
          T* out;
          head_rows(hd, b, s, in, out);
          float x1[W];
          load_w<T, W, kVec>(in + i, x1);
          store_w<T, W, kVec>(out + i, x1);
        }
        continue;
      }
      const int i = u * W;  // first column of the first half; its partner is i + half
      float c1[W], c2[W], s1[W], s2[W];
      load_w<CT, W, kVec>(cr + i, c1);
      load_w<CT, W, kVec>(cr + half + i, c2);
      load_w<CT, W, kVec>(sr + i, s1);
      load_w<CT, W, kVec>(sr + half + i, s2);
      for (int hd = static_cast<int>(threadIdx.y); hd < heads; hd += static_cast<int>(blockDim.y)) {
        const T* in;
        T* out;
        head_rows(hd, b, s, in, out);
        float x1[W], x2[W], o1[W], o2[W];
        load_w<T, W, kVec>(in + i, x1);
        load_w<T, W, kVec>(in + half + i, x2);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if constexpr (kBackward) {
            o1[j] = x1[j] * c1[j] + x2[j] * s2[j];
            o2[j] = x2[j] * c2[j] - x1[j] * s1[j];
          } else {
            o1[j] = x1[j] * c1[j] - x2[j] * s1[j];
            o2[j] = x2[j] * c2[j] + x1[j] * s2[j];
          }
        }
        store_w<T, W, kVec>(out + i, o1);
        store_w<T, W, kVec>(out + half + i, o2);
      }
    }
  }
}

template <typename T>
struct Tag {
  using type = T;
};

// Can every row start of a (rows of) T array with these element strides be vector-moved?
template <typename T, int W>
bool strides_aligned(const void* p, const int64_t* strides, int count) {
  if (!detail::vec_aligned<T, W>(p, 0, 1)) return false;
  for (int d = 0; d < count; ++d)
    if (!detail::vec_aligned<T, W>(p, strides[d], 2)) return false;
  return true;
}

template <typename T, typename CT>
cudaError_t launch_rope(const RopeArgs& a, bool backward, cudaStream_t stream) {
  constexpr int W = 16 / static_cast<int>(sizeof(T));
  const int64_t half = a.rot_dim / 2, pass = a.head_dim - a.rot_dim;
  const bool vec = half % W == 0 && pass % W == 0 && strides_aligned<T, W>(a.q, a.q_stride, 3) &&
                   strides_aligned<T, W>(a.k, a.k_stride, 3) &&
                   strides_aligned<T, W>(a.q_out, a.q_out_stride, 3) &&
                   strides_aligned<T, W>(a.k_out, a.k_out_stride, 3) &&
                   strides_aligned<CT, W>(a.cos, a.cos_stride, 2) &&
                   strides_aligned<CT, W>(a.sin, a.sin_stride, 2);
  const int units = static_cast<int>(vec ? (half + pass) / W : half + pass);
  const int heads = static_cast<int>(a.heads_q + a.heads_k);
  // threadIdx.x covers a head row's units; threadIdx.y splits the heads into equal rounds
  // (e.g. 40 heads with room for 32 -> 2 rounds of 20 rather than 32 + 8).
  const int tx = std::min(units, kRopeThreads);
  const int ty_max = std::max(1, kRopeThreads / tx);
  const int rounds = (heads + ty_max - 1) / ty_max;
  const int ty = (heads + rounds - 1) / rounds;
  const dim3 block(tx, ty);
  const int grid = static_cast<int>(std::min<int64_t>(a.batch * a.seq, INT_MAX));
  if (vec) {
    if (backward) rope_kernel<T, CT, true, true><<<grid, block, 0, stream>>>(a);
    else rope_kernel<T, CT, false, true><<<grid, block, 0, stream>>>(a);
  } else {
    if (backward) rope_kernel<T, CT, true, false><<<grid, block, 0, stream>>>(a);
    else rope_kernel<T, CT, false, false><<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope(const RopeArgs& a, bool backward, DType qk_dtype, DType cs_dtype,
                 cudaStream_t stream) {
  if (a.batch < 0 || a.seq < 0 || a.heads_q < 0 || a.heads_k < 0 || a.head_dim < 0 ||
      a.head_dim % 2 != 0 || a.head_dim > INT_MAX || a.heads_q + a.heads_k > INT_MAX ||
      a.rot_dim < 0 || a.rot_dim > a.head_dim || a.rot_dim % 2 != 0)
    return cudaErrorInvalidValue;
  if (a.batch == 0 || a.seq == 0 || a.head_dim == 0 || a.heads_q + a.heads_k == 0)
    return cudaSuccess;
  if (a.cos == nullptr || a.sin == nullptr ||
      (a.heads_q > 0 && (a.q == nullptr || a.q_out == nullptr)) ||
      (a.heads_k > 0 && (a.k == nullptr || a.k_out == nullptr)))
    return cudaErrorInvalidValue;
  auto with_cs = [&](auto ttag) -> cudaError_t {
    using T = typename decltype(ttag)::type;
    switch (cs_dtype) {
      case DType::kFloat32:
        return launch_rope<T, float>(a, backward, stream);
      case DType::kFloat16:
        return launch_rope<T, __half>(a, backward, stream);
      case DType::kBFloat16:
        return launch_rope<T, __nv_bfloat16>(a, backward, stream);
    }
    return cudaErrorInvalidValue;
  };
  switch (qk_dtype) {
    case DType::kFloat32:
      return with_cs(Tag<float>{});
    case DType::kFloat16:
      return with_cs(Tag<__half>{});
    case DType::kBFloat16:
      return with_cs(Tag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace ckpt_ext
