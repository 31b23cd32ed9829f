// RMSNorm kernels (HF LlamaRMSNorm semantics): forward, fused residual-add forward, backward
// with a deterministic two-stage dweight reduction. Entry points are declared in rowwise.cuh.
//
// Work layout. A "team" owns one row at a time and walks rows with a grid stride:
//   * block teams (n large): the whole block, 64..512 threads, is one team;
//   * warp teams (n small, <= 128 vectors): each of the kWarpTeams warps of a block is a team.
// Inside a row, lane l of a team handles the vectors l, l + team_size, ... (V = 16 / sizeof(x)
// elements each) when every row start is 16-byte aligned ("vector path"), then the tail
// columns [n / V * V, n) one element at a time; otherwise every column one at a time
// ("scalar path"). All sums are float32 and are reduced in a fixed order, so results are
// bitwise reproducible for a given device and shape.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "rowwise.cuh"

namespace ckpt_ext {
namespace cuda {
namespace {

using detail::from_f32;
using detail::round_to;
using detail::to_f32;
using detail::VecIO;
using detail::warp_sum;

constexpr int kMaxThreads = 512;  // largest block used by the row kernels
constexpr int kWarpTeams = 4;     // warps (= rows in flight) per block in warp-team mode

// Elements of x per 16-byte vector.
template <typename XT>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(XT));

// Output dtype of y = weight * x_normed, torch.promote_types(x, weight): x's dtype when weight
// has it; float32 for any two different dtypes among float32, float16, bfloat16.
template <typename XT, typename WT>
using OutT = std::conditional_t<std::is_same_v<XT, WT>, XT, float>;

// A team of threads that owns one row at a time (see the file comment).
template <int kTeams>
struct Team {
  static constexpr bool kWarp = kTeams > 1;
  __device__ __forceinline__ int lane() const {
    return kWarp ? static_cast<int>(threadIdx.x & 31) : static_cast<int>(threadIdx.x);
  }
  __device__ __forceinline__ int size() const { return kWarp ? 32 : static_cast<int>(blockDim.x); }
  __device__ __forceinline__ int index() const {
    return kWarp ? static_cast<int>(threadIdx.x >> 5) : 0;
  }
  __device__ __forceinline__ int64_t first_row() const {
    return static_cast<int64_t>(blockIdx.x) * kTeams + index();
  }
  __device__ __forceinline__ int64_t row_step() const {
    return static_cast<int64_t>(gridDim.x) * kTeams;
  }
  // (sum of v.x, sum of v.y) over the team; every thread of the team gets the same value,
  // summed in a fixed order. Block teams go through `scratch` (32 float2 of shared memory)
  // and synchronise the block twice, so every thread of the block must call this.
  __device__ __forceinline__ float2 sum(float2 v, float2* scratch) const {
    v.x = warp_sum(v.x);
    v.y = warp_sum(v.y);
    if constexpr (!kWarp) {
      const int warp = static_cast<int>(threadIdx.x >> 5);
      const int num_warps = static_cast<int>(blockDim.x >> 5);
      if ((threadIdx.x & 31) == 0) scratch[warp] = v;
      __syncthreads();
      v = make_float2(0.f, 0.f);
      for (int w = 0; w < num_warps; ++w) {
        v.x += scratch[w].x;
        v.y += scratch[w].y;
      }
      __syncthreads();  // scratch is reused by the next row
    }
    return v;
  }
};

// rstd = 1 / sqrt(sumsq / n + eps), with IEEE-rounded division, sqrt and reciprocal (these
// intrinsics keep their accuracy under --use_fast_math).
__device__ __forceinline__ float inv_rms(float sumsq, int n, float eps) {
  const float mean_sq = __fadd_rn(__fdiv_rn(sumsq, static_cast<float>(n)), eps);
  return __frcp_rn(__fsqrt_rn(mean_sq));
}

// Loads the vectors v = first + u * step (u < kU) of a row into f[u], as float32; vectors at
// or past nvec read as zeros. kResidual: f = float(XT(x + r)), the sum as torch rounds it.
// All kU loads are independent, so they are in flight together.
template <typename XT, int V, int kU, bool kResidual>
__device__ __forceinline__ void load_chunk(float (&f)[kU][V], const XT* __restrict__ xr,
                                           const XT* __restrict__ rr, int first, int step,
                                           int nvec) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int v = first + u * step;
    if (v < nvec) {
      VecIO<XT, V>::load(xr + v * V, f[u]);
      if constexpr (kResidual) {
        float r[V];
        VecIO<XT, V>::load(rr + v * V, r);
#pragma unroll
        for (int i = 0; i < V; ++i) f[u][i] = round_to<XT>(f[u][i] + r[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) f[u][i] = 0.f;
    }
  }
}

// ---- forward -------------------------------------------------------------------------------
// x (rows, n) with row stride x_stride; residual (rows, n) with row stride res_stride
// (kResidual); w (n,); y (rows, n) contiguous in OutT; s (rows, n) contiguous in XT
// (kResidual). Per row: s = XT(x + residual) (or s = x), rstd = inv_rms(sum s^2),
// y = OT(w * float(XT(s * rstd))).
// Vector path: lane l handles vectors l + u * team_size of each chunk of kFwdUnroll *
// team_size vectors. The launch config makes one chunk cover the row whenever the block is
// not at its size cap; the row then stays in registers between the two passes ("cached"),
// otherwise pass 2 re-reads it (from L1/L2 mostly).
constexpr int kFwdUnroll = 4;

template <typename XT, typename WT, int kTeams, bool kVec, bool kResidual>
__global__ void __launch_bounds__(kTeams > 1 ? 32 * kTeams : kMaxThreads)
    rms_norm_fwd_kernel(const XT* __restrict__ x, int64_t x_stride, const XT* __restrict__ res,
                        int64_t res_stride, const WT* __restrict__ w,
                        OutT<XT, WT>* __restrict__ y, XT* __restrict__ s, int64_t rows, int n,
                        float eps) {
  using OT = OutT<XT, WT>;
  constexpr int V = kVecElems<XT>;
  constexpr int kU = kFwdUnroll;
  __shared__ float2 scratch[32];
  const Team<kTeams> team;
  const int lane = team.lane();
  const int tsize = team.size();
  const int nvec = kVec ? n / V : 0;  // columns [0, nvec * V) move as vectors
  const int chunk = kU * tsize;
  const bool cached = nvec <= chunk;

  for (int64_t row = team.first_row(); row < rows; row += team.row_step()) {
    const XT* xr = x + row * x_stride;
    const XT* rr = kResidual ? res + row * res_stride : nullptr;
    XT* sr = kResidual ? s + row * static_cast<int64_t>(n) : nullptr;
    OT* yr = y + row * static_cast<int64_t>(n);

    // Pass 1: sum of squares of the (summed) input; the sum is written out here.
    float f[kU][V];
    float sumsq = 0.f;
    for (int base = lane; base < nvec; base += chunk) {
      load_chunk<XT, V, kU, kResidual>(f, xr, rr, base, tsize, nvec);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if constexpr (kResidual) {
          const int v = base + u * tsize;
          if (v < nvec) VecIO<XT, V>::store(sr + v * V, f[u]);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) sumsq += f[u][i] * f[u][i];  // zeros past nvec add 0
      }
    }
#pragma unroll 4
    for (int c = nvec * V + lane; c < n; c += tsize) {
      float fc = to_f32(xr[c]);
      if constexpr (kResidual) {
        fc = round_to<XT>(fc + to_f32(rr[c]));
        sr[c] = from_f32<XT>(fc);
      }
      sumsq += fc * fc;
    }
    const float rstd = inv_rms(team.sum(make_float2(sumsq, 0.f), scratch).x, n, eps);

    // Pass 2: y. (x + residual is recomputed bit-exactly when re-read, never read back from s.)
    for (int base = lane; base < nvec; base += chunk) {
      if (!cached) load_chunk<XT, V, kU, kResidual>(f, xr, rr, base, tsize, nvec);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = base + u * tsize;
        if (v < nvec) {
          float wf[V], o[V];
          VecIO<WT, V>::load(w + v * V, wf);
#pragma unroll
          for (int i = 0; i < V; ++i) o[i] = wf[i] * round_to<XT>(f[u][i] * rstd);
          VecIO<OT, V>::store(yr + v * V, o);
        }
      }
    }
#pragma unroll 4
    for (int c = nvec * V + lane; c < n; c += tsize) {
      float fc = to_f32(xr[c]);
      if constexpr (kResidual) fc = round_to<XT>(fc + to_f32(rr[c]));
      yr[c] = from_f32<OT>(to_f32(w[c]) * round_to<XT>(fc * rstd));
    }
  }
}

// ---- backward, stage 1 ---------------------------------------------------------------------
// dy (rows, n) in OutT with row stride dy_stride; x (rows, n) with row stride x_stride;
// w (n,); dx (rows, n) contiguous in XT; partial (gridDim.x, n) float32.
// Per row, with nn = x * rstd and g = dy * w:
//   pass 1: sumsq = sum x^2, gx = sum g * x  ->  rstd, mean_gn = mean(g * nn) = rstd * gx / n
//   pass 2: dx = rstd * (g - nn * mean_gn); acc[col] += dy * float(XT(nn))
// x and dy chunks of kBwdUnroll * team_size vectors stay in registers between the passes when
// one chunk covers the row (as for the forward).
// Each thread accumulates only the columns it owns (the same ones on every row of the
// block), in its team's accumulator:
//   kSmemAcc: shared memory, kTeams regions of n floats; vector column v * V + j lives at
//             j * nvec + v (consecutive lanes hit consecutive banks), tail column c at c.
//             At the end the block sums its teams' regions in team order into partial row
//             blockIdx.x.
//   else:     (block teams only; n too large for shared memory) partial row blockIdx.x itself,
//             in natural column order.
constexpr int kBwdUnroll = 2;

template <typename XT, typename WT, int kTeams, bool kVec, bool kSmemAcc>
__global__ void __launch_bounds__(kTeams > 1 ? 32 * kTeams : kMaxThreads)
    rms_norm_bwd_kernel(const OutT<XT, WT>* __restrict__ dy, int64_t dy_stride,
                        const XT* __restrict__ x, int64_t x_stride, const WT* __restrict__ w,
                        XT* __restrict__ dx, float* __restrict__ partial, int64_t rows, int n,
                        float eps) {
  static_assert(kSmemAcc || kTeams == 1, "warp teams accumulate dweight in shared memory");
  using OT = OutT<XT, WT>;
  constexpr int V = kVecElems<XT>;
  constexpr int kU = kBwdUnroll;
  extern __shared__ float smem_acc[];
  __shared__ float2 scratch[32];
  const Team<kTeams> team;
  const int lane = team.lane();
  const int tsize = team.size();
  const int nvec = kVec ? n / V : 0;
  const int chunk = kU * tsize;
  const bool cached = nvec <= chunk;
  float* acc = kSmemAcc ? smem_acc + static_cast<int64_t>(team.index()) * n
                        : partial + static_cast<int64_t>(blockIdx.x) * n;
  // Position of vector column v * V + j in acc (see above).
  auto vslot = [nvec](int v, int j) { return kSmemAcc ? j * nvec + v : v * V + j; };

  for (int v = lane; v < nvec; v += tsize) {
#pragma unroll
    for (int j = 0; j < V; ++j) acc[vslot(v, j)] = 0.f;
  }
  for (int c = nvec * V + lane; c < n; c += tsize) acc[c] = 0.f;

  for (int64_t row = team.first_row(); row < rows; row += team.row_step()) {
    const XT* xr = x + row * x_stride;
    const OT* dyr = dy + row * dy_stride;
    XT* dxr = dx + row * static_cast<int64_t>(n);

    // Pass 1: sum x^2 and sum (dy * w) * x.
    float xf[kU][V], df[kU][V];
    float sumsq = 0.f, gx = 0.f;
    for (int base = lane; base < nvec; base += chunk) {
      load_chunk<XT, V, kU, false>(xf, xr, nullptr, base, tsize, nvec);
      load_chunk<OT, V, kU, false>(df, dyr, nullptr, base, tsize, nvec);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = base + u * tsize;
        if (v < nvec) {
          float wf[V];
          VecIO<WT, V>::load(w + v * V, wf);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            sumsq += xf[u][i] * xf[u][i];
            gx += df[u][i] * wf[i] * xf[u][i];
          }
        }
      }
    }
#pragma unroll 4
    for (int c = nvec * V + lane; c < n; c += tsize) {
      const float xc = to_f32(xr[c]);
      sumsq += xc * xc;
      gx += to_f32(dyr[c]) * to_f32(w[c]) * xc;
    }
    const float2 tot = team.sum(make_float2(sumsq, gx), scratch);
    const float rstd = inv_rms(tot.x, n, eps);
    const float mean_gn = __fdiv_rn(tot.y * rstd, static_cast<float>(n));

    // Pass 2: dx and the dweight contributions.
    for (int base = lane; base < nvec; base += chunk) {
      if (!cached) {
        load_chunk<XT, V, kU, false>(xf, xr, nullptr, base, tsize, nvec);
        load_chunk<OT, V, kU, false>(df, dyr, nullptr, base, tsize, nvec);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = base + u * tsize;
        if (v < nvec) {
          float wf[V], o[V];
          VecIO<WT, V>::load(w + v * V, wf);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float nn = xf[u][i] * rstd;
            acc[vslot(v, i)] += df[u][i] * round_to<XT>(nn);
            o[i] = rstd * (df[u][i] * wf[i] - nn * mean_gn);
          }
          VecIO<XT, V>::store(dxr + v * V, o);
        }
      }
    }
#pragma unroll 4
    for (int c = nvec * V + lane; c < n; c += tsize) {
      const float nn = to_f32(xr[c]) * rstd;
      const float dc = to_f32(dyr[c]);
      acc[c] += dc * round_to<XT>(nn);
      dxr[c] = from_f32<XT>(rstd * (dc * to_f32(w[c]) - nn * mean_gn));
    }
  }

  if constexpr (kSmemAcc) {
    __syncthreads();
    float* out = partial + static_cast<int64_t>(blockIdx.x) * n;
    for (int c = static_cast<int>(threadIdx.x); c < n; c += static_cast<int>(blockDim.x)) {
      const int slot = c < nvec * V ? (c % V) * nvec + c / V : c;
      float t = 0.f;
#pragma unroll
      for (int k = 0; k < kTeams; ++k) t += smem_acc[static_cast<int64_t>(k) * n + slot];
      out[c] = t;
    }
  }
}

// ---- backward, stage 2 ---------------------------------------------------------------------
// dweight[c] = WT(sum_p partial[p, c]) for partial (num_partials, n). Block (32, 16): column
// blockIdx.x * 32 + threadIdx.x; thread row y sums p = y, y + 16, ... in order, then the 16
// per-thread sums are added in y order. Fixed order: deterministic.
constexpr int kSumCols = 32;
constexpr int kSumRows = 16;

template <typename WT>
__global__ void __launch_bounds__(kSumCols* kSumRows)
    rms_norm_dweight_kernel(const float* __restrict__ partial, int64_t num_partials, int n,
                            WT* __restrict__ dweight) {
  __shared__ float tile[kSumRows][kSumCols + 1];
  const int col = static_cast<int>(blockIdx.x) * kSumCols + static_cast<int>(threadIdx.x);
  float a = 0.f;
  if (col < n) {
#pragma unroll 4
    for (int64_t p = threadIdx.y; p < num_partials; p += kSumRows) a += partial[p * n + col];
  }
  tile[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float t = 0.f;
#pragma unroll
    for (int r = 0; r < kSumRows; ++r) t += tile[r][threadIdx.x];
    dweight[col] = from_f32<WT>(t);
  }
}

// ---- host side -----------------------------------------------------------------------------
template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>) for the kernel dtype d.
template <typename F>
cudaError_t dispatch_dtype(DType d, F&& fn) {
  switch (d) {
    case DType::kFloat32:
      return fn(Tag<float>{});
    case DType::kFloat16:
      return fn(Tag<__half>{});
    case DType::kBFloat16:
      return fn(Tag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(Tag<XT>, Tag<WT>) for any pair of kernel dtypes of x and weight.
template <typename F>
cudaError_t dispatch_xw(DType x_dtype, DType w_dtype, F&& f) {
  return dispatch_dtype(x_dtype, [&](auto xtag) {
    return dispatch_dtype(w_dtype, [&](auto wtag) { return f(xtag, wtag); });
  });
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Team shape for rows of n elements moved in vectors of `vec` elements, `unroll` vectors a
// lane per chunk: up to 32 * unroll vectors a row goes to a warp (one chunk); beyond, a block
// of about items / unroll threads (one chunk), a multiple of 32 in [64, kMaxThreads]. Depends
// only on n and the dtype, never on pointer alignment, so the backward's number of dweight
// partial rows is known before its pointers are.
struct RowConfig {
  bool warp_teams;
  int threads;
  int teams() const { return warp_teams ? kWarpTeams : 1; }
};

RowConfig pick_config(int64_t n, int vec, int unroll) {
  const int64_t items = ceil_div(n, vec);
  if (items <= 32 * unroll) return {true, 32 * kWarpTeams};
  const int64_t threads =
      std::clamp<int64_t>(ceil_div(ceil_div(items, unroll), 32) * 32, 64, kMaxThreads);
  return {false, static_cast<int>(threads)};
}

int grid_for_rows(int64_t rows, int teams) {
  return static_cast<int>(std::min<int64_t>(ceil_div(rows, teams), INT_MAX));
}

// Stage-1 blocks of the backward: enough for ~1024 resident threads per SM (plenty of bytes
// in flight for these streaming loops), never more than there are row groups.
cudaError_t bwd_blocks(int64_t rows, int64_t n, int vec, int64_t* blocks) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const RowConfig cfg = pick_config(n, vec, kBwdUnroll);
  const int64_t per_sm = std::max(1, 1024 / cfg.threads);
  *blocks = std::min<int64_t>(ceil_div(rows, cfg.teams()), static_cast<int64_t>(sms) * per_sm);
  return cudaSuccess;
}

int vec_elems(DType x_dtype) { return x_dtype == DType::kFloat32 ? 4 : 8; }

bool valid_shape(int64_t rows, int64_t n) { return rows >= 0 && n >= 1 && n <= INT_MAX; }

template <typename XT, typename WT, bool kResidual>
cudaError_t launch_fwd(const void* x, int64_t x_stride, const void* res, int64_t res_stride,
                       const void* w, void* y, void* s, int64_t rows, int n, float eps,
                       cudaStream_t stream) {
  using OT = OutT<XT, WT>;
  constexpr int V = kVecElems<XT>;
  using detail::vec_aligned;
  const RowConfig cfg = pick_config(n, V, kFwdUnroll);
  bool vec = vec_aligned<XT, V>(x, x_stride, rows) && vec_aligned<WT, V>(w, 0, 1) &&
             vec_aligned<OT, V>(y, n, rows);
  if (kResidual)
    vec = vec && vec_aligned<XT, V>(res, res_stride, rows) && vec_aligned<XT, V>(s, n, rows);
  const int grid = grid_for_rows(rows, cfg.teams());

  auto go = [&](auto kernel) {
    kernel<<<grid, cfg.threads, 0, stream>>>(
        static_cast<const XT*>(x), x_stride, static_cast<const XT*>(res), res_stride,
        static_cast<const WT*>(w), static_cast<OT*>(y), static_cast<XT*>(s), rows, n, eps);
  };
  if (cfg.warp_teams) {
    if (vec) go(rms_norm_fwd_kernel<XT, WT, kWarpTeams, true, kResidual>);
    else go(rms_norm_fwd_kernel<XT, WT, kWarpTeams, false, kResidual>);
  } else {
    if (vec) go(rms_norm_fwd_kernel<XT, WT, 1, true, kResidual>);
    else go(rms_norm_fwd_kernel<XT, WT, 1, false, kResidual>);
  }
  return cudaGetLastError();
}

// Raw arguments of the backward's stage 1 (see rms_norm_bwd_kernel).
struct BwdArgs {
  const void* dy;
  int64_t dy_stride;
  const void* x;
  int64_t x_stride;
  const void* w;
  void* dx;
  float* partial;
  int64_t rows;
  int n;
  float eps;
};

// Launches stage 1 as rms_norm_bwd_kernel<XT, WT, kTeams, kVec, kSmemAcc> with `smem` bytes of
// dynamic shared memory.
template <typename XT, typename WT, int kTeams, bool kVec, bool kSmemAcc>
cudaError_t launch_bwd_stage1(const BwdArgs& a, int grid, int threads, size_t smem,
                              cudaStream_t stream) {
  using OT = OutT<XT, WT>;
  auto kernel = rms_norm_bwd_kernel<XT, WT, kTeams, kVec, kSmemAcc>;
  // The default limit is 48 KiB of static + dynamic shared memory (the kernel has 256 bytes
  // of static scratch); above it, opt in (the caller checked the device maximum).
  if (smem + 1024 > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, threads, smem, stream>>>(
      static_cast<const OT*>(a.dy), a.dy_stride, static_cast<const XT*>(a.x), a.x_stride,
      static_cast<const WT*>(a.w), static_cast<XT*>(a.dx), a.partial, a.rows, a.n, a.eps);
  return cudaGetLastError();
}

template <typename XT, typename WT>
cudaError_t launch_bwd(const BwdArgs& a, void* dweight, int64_t workspace_floats,
                       cudaStream_t stream) {
  using OT = OutT<XT, WT>;
  constexpr int V = kVecElems<XT>;
  using detail::vec_aligned;
  const int64_t rows = a.rows;
  const int n = a.n;
  int64_t blocks = 0;
  cudaError_t err = bwd_blocks(rows, n, V, &blocks);
  if (err != cudaSuccess) return err;
  if (workspace_floats < blocks * n || (blocks > 0 && a.partial == nullptr))
    return cudaErrorInvalidValue;

  if (blocks > 0) {
    const RowConfig cfg = pick_config(n, V, kBwdUnroll);
    const bool vec = vec_aligned<XT, V>(a.x, a.x_stride, rows) &&
                     vec_aligned<OT, V>(a.dy, a.dy_stride, rows) &&
                     vec_aligned<WT, V>(a.w, 0, 1) && vec_aligned<XT, V>(a.dx, n, rows);
    const int grid = static_cast<int>(blocks);
    // dweight accumulators: cfg.teams() * n floats of shared memory when the device allows it
    // (next to the 256 bytes of static reduction scratch), else the partial rows in global
    // memory (block teams only; warp teams have n <= 32 * kBwdUnroll * V <= 512, always fit).
    int device = 0, smem_optin = 0;
    err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    const size_t smem = static_cast<size_t>(cfg.teams()) * static_cast<size_t>(n) * sizeof(float);
    const bool smem_acc = smem + 1024 <= static_cast<size_t>(smem_optin);
    const int threads = cfg.threads;
    if (cfg.warp_teams) {
      if (!smem_acc) return cudaErrorInvalidConfiguration;  // unreachable: smem <= 8 KiB here
      constexpr int kT = kWarpTeams;
      err = vec ? launch_bwd_stage1<XT, WT, kT, true, true>(a, grid, threads, smem, stream)
                : launch_bwd_stage1<XT, WT, kT, false, true>(a, grid, threads, smem, stream);
    } else if (smem_acc) {
      err = vec ? launch_bwd_stage1<XT, WT, 1, true, true>(a, grid, threads, smem, stream)
                : launch_bwd_stage1<XT, WT, 1, false, true>(a, grid, threads, smem, stream);
    } else {
      err = vec ? launch_bwd_stage1<XT, WT, 1, true, false>(a, grid, threads, 0, stream)
                : launch_bwd_stage1<XT, WT, 1, false, false>(a, grid, threads, 0, stream);
    }
    if (err != cudaSuccess) return err;
  }

  // Stage 2 (also for rows == 0, where it writes zeros).
  const dim3 block(kSumCols, kSumRows);
  const int grid2 = static_cast<int>(ceil_div(n, kSumCols));
  rms_norm_dweight_kernel<WT><<<grid2, block, 0, stream>>>(a.partial, blocks, n,
                                                           static_cast<WT*>(dweight));
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm_fwd(const void* x, int64_t x_row_stride, const void* weight, void* y,
                         int64_t rows, int64_t n, float eps, DType x_dtype, DType w_dtype,
                         cudaStream_t stream) {
  if (!valid_shape(rows, n)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || weight == nullptr || y == nullptr) return cudaErrorInvalidValue;
  return dispatch_xw(x_dtype, w_dtype, [&](auto xtag, auto wtag) {
    using XT = typename decltype(xtag)::type;
    using WT = typename decltype(wtag)::type;
    return launch_fwd<XT, WT, false>(x, x_row_stride, nullptr, 0, weight, y, nullptr, rows,
                                     static_cast<int>(n), eps, stream);
  });
}

cudaError_t add_rms_norm_fwd(const void* x, int64_t x_row_stride, const void* residual,
                             int64_t residual_row_stride, const void* weight, void* y,
                             void* sum, int64_t rows, int64_t n, float eps, DType x_dtype,
                             DType w_dtype, cudaStream_t stream) {
  if (!valid_shape(rows, n)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || residual == nullptr || weight == nullptr || y == nullptr || sum == nullptr)
    return cudaErrorInvalidValue;
  return dispatch_xw(x_dtype, w_dtype, [&](auto xtag, auto wtag) {
    using XT = typename decltype(xtag)::type;
    using WT = typename decltype(wtag)::type;
    return launch_fwd<XT, WT, true>(x, x_row_stride, residual, residual_row_stride, weight, y,
                                    sum, rows, static_cast<int>(n), eps, stream);
  });
}

cudaError_t rms_norm_bwd_workspace_size(int64_t rows, int64_t n, DType x_dtype,
                                        int64_t* num_floats) {
  if (num_floats == nullptr || !valid_shape(rows, n)) return cudaErrorInvalidValue;
  int64_t blocks = 0;
  const cudaError_t err = bwd_blocks(rows, n, vec_elems(x_dtype), &blocks);
  if (err != cudaSuccess) return err;
  *num_floats = blocks * n;
  return cudaSuccess;
}

cudaError_t rms_norm_bwd(const void* dy, int64_t dy_row_stride, const void* x,
                         int64_t x_row_stride, const void* weight, void* dx, void* dweight,
                         float* workspace, int64_t workspace_floats, int64_t rows, int64_t n,
                         float eps, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  if (!valid_shape(rows, n) || dweight == nullptr) return cudaErrorInvalidValue;
  if (rows > 0 && (dy == nullptr || x == nullptr || weight == nullptr || dx == nullptr))
    return cudaErrorInvalidValue;
  return dispatch_xw(x_dtype, w_dtype, [&](auto xtag, auto wtag) {
    using XT = typename decltype(xtag)::type;
    using WT = typename decltype(wtag)::type;
    const BwdArgs args{dy, dy_row_stride, x, x_row_stride, weight, dx, workspace, rows,
                       static_cast<int>(n), eps};
    return launch_bwd<XT, WT>(args, dweight, workspace_floats, stream);
  });
}

}  // namespace cuda
}  // namespace ckpt_ext
