// CPU (ATen) implementation of attention_fwd / attention_bwd: blocked attention with an online
// softmax, the reference the Triton kernels are tested against.
//
// Shapes: q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D), Hq % Hkv == 0, query head h reads kv head
// h / (Hq / Hkv); q_offset >= 0 with q_offset + Sq <= Sk: query row i sits at the global
// position q_offset + i (a chunk of the queries against all keys; Sq == Sk, q_offset 0 is plain
// self-attention); every rule below reads global positions. key_padding_mask (B, Sk) bool,
// True = the key may be attended; segment_ids (B, Sk) int32/int64, a query sees only keys with
// its id (query row i has id segment_ids[:, q_offset + i]); window > 0, HF's sliding window:
// key j is visible from query position p iff p - window < j (and j < p + window when not
// causal); out (B, Hq, Sq, D) in q's dtype; lse (B, Hq, Sq) float32 contiguous, the natural-log
// logsumexp of the scaled allowed scores, -inf for a row with nothing to attend (its out row
// and its gradients are 0).
//
// Soft-capping (Gemma 2): with softcap > 0 each scaled score s = scale q.k becomes
// softcap * tanh(s / softcap) before the rules above and the softmax (lse is over the capped
// scores); the backward recomputes the capped tile and multiplies dS by the cap's derivative
// 1 - tanh^2(s / softcap) before forming dq and dk. softcap 0: no cap.
//
// Accumulators: attention_bwd's dk_acc / dv_acc (B, Hkv, Sk, D), float32 (or float64 for
// float64 inputs), any strides without overlap, given together: the chunk's dk / dv are added
// into them in the compute dtype (never rounded to q's dtype) and dk, dv come back as empty (0,)
// tensors of k's dtype. Without them dk, dv are returned as below.
//
// Layout: out, dq, dk and dv are (B, H, S, D) views of (B, S, H, D) memory, the layout in which
// the decoder layer holds its projections, as the Triton kernels return them: merging the heads
// back, t.transpose(1, 2).reshape(B, S, H * D), is then a view, not a copy.
//
// Skipping: causal and the window form a band i - before <= j <= i + after; each query tile
// visits only the keys in the band of its rows and, with segment ids, in the span from the
// first to the last position holding one of its rows' ids (and each key tile, in backward,
// only the queries that can see it). Ids are still compared element-wise, so arbitrary ids are
// exact; contiguous runs are what makes the spans tight.
//
// Memory: no S x S tensor is ever built. Work is split into query tiles of kBlockM rows and
// key tiles of kBlockN keys; the score tile of one step is (kBlockM * G, kBlockN), with G the
// number of query heads sharing a kv head: the G heads of a group are stacked row-wise,
// (query position, head) order, so one matmul serves the whole group.
//
// Precision: float16 / bfloat16 are computed in float32, float32 in float32, float64 in float64;
// results are rounded once to the output dtype. lse is float32 by the schema, which is too
// coarse for float64 gradients, so for float64 inputs attention_bwd recomputes lse in float64
// from q and k (one extra pass of q k^T, no V); for the other dtypes it uses the lse it is given.
//
// Parallelism: at::parallel_for over (batch, kv head, query tile) in forward and over
// (batch, kv head) in backward, for problems of at least kParallelMinWork; each work item
// writes a disjoint part of the outputs. ATen ops inside a work item run single-threaded.
// Per-operator headers only (<ATen/ops/*.h>, which torch installs): with these two macros,
// <ATen/Functions.h> (every operator, the bulk of a compile) is a compile error here.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checks.h"

namespace ckpt_ext {
namespace {

using checks::check_defined;
using checks::check_device_as;
using checks::check_dim;
using checks::check_dtype;
using checks::check_dtype_as;
using checks::check_floating;
using checks::check_shape;

constexpr int64_t kBlockM = 128;  // query positions per tile (times G rows: the head group)
constexpr int64_t kBlockN = 128;  // keys per tile
constexpr double kInf = std::numeric_limits<double>::infinity();
// Below this many multiply-adds of q k^T (B * Hq * S * S * D) the ops run on the calling thread:
// a parallel region costs more than it saves on small problems, and far more on a busy machine.
constexpr int64_t kParallelMinWork = int64_t{1} << 24;

struct AttnDims {
  int64_t B, Hq, Hkv, Sq, Sk, D, G;  // G = Hq / Hkv query heads per kv head
  int64_t q_off;                     // global position of query row 0

  // Grain for at::parallel_for over `items` work items: all of them (no parallel region) when
  // the problem is small.
  int64_t grain(int64_t items) const {
    const int64_t work = B * Hq * Sq * Sk * D;
    return work < kParallelMinWork ? std::max<int64_t>(items, 1) : 1;
  }
};

// Validates q, k, v, the masks and the scale of both ops; returns the sizes.
AttnDims check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& key_padding_mask,
                   const std::optional<at::Tensor>& segment_ids, std::optional<int64_t> window,
                   double scale, int64_t q_offset, double softcap) {
  check_defined(op, "q", q);
  check_defined(op, "k", k);
  check_defined(op, "v", v);
  check_dim(op, "q", q, 4, "(B, Hq, Sq, D)");
  check_dim(op, "k", k, 4, "(B, Hkv, Sk, D)");
  check_dim(op, "v", v, 4, "(B, Hkv, Sk, D)");
  check_floating(op, "q", q);
  check_dtype_as(op, "k", k, "q", q);
  check_dtype_as(op, "v", v, "q", q);
  check_device_as(op, "k", k, "q", q);
  check_device_as(op, "v", v, "q", q);
  AttnDims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), 0, q_offset};
  CKPT_CHECK_VALUE(d.B > 0, op, "q has an empty batch (B=0); attention needs B >= 1");
  CKPT_CHECK_VALUE(d.D > 0, op, "q must have head dim D >= 1, got D=0");
  CKPT_CHECK_VALUE(d.Hq > 0, op, "q must have at least one head, got Hq=0");
  CKPT_CHECK_VALUE(k.size(0) == d.B, op, "k must have the batch size of q (B=", d.B, "), got ",
                   k.size(0), " in shape ", checks::shape_str(k.sizes()));
  CKPT_CHECK_VALUE(d.Sk >= d.Sq, op, "k must have at least the sequence length of q (Sq=",
                   d.Sq, "), got ", d.Sk, " in shape ", checks::shape_str(k.sizes()));
  CKPT_CHECK_VALUE(q_offset >= 0 && q_offset + d.Sq <= d.Sk, op,
                   "q_offset must satisfy 0 <= q_offset and q_offset + Sq <= Sk (q holds the "
                   "queries at positions q_offset..q_offset+Sq-1 of the Sk keys), got q_offset=",
                   q_offset, " with Sq=", d.Sq, ", Sk=", d.Sk);
  CKPT_CHECK_VALUE(k.size(3) == d.D, op, "k must have the head dim of q (D=", d.D, "), got ",
                   k.size(3), " in shape ", checks::shape_str(k.sizes()));
  CKPT_CHECK_VALUE(d.Hkv > 0 && d.Hq % d.Hkv == 0, op, "k must have Hkv dividing Hq=", d.Hq,
                   ", got Hkv=", d.Hkv);
  check_shape(op, "v", v, k.sizes(), "(the shape of k)");
  d.G = d.Hq / d.Hkv;
  if (key_padding_mask.has_value()) {
    const at::Tensor& m = *key_padding_mask;
    check_defined(op, "key_padding_mask", m);
    check_dtype(op, "key_padding_mask", m, at::kBool, " (True = may be attended)");
    check_shape(op, "key_padding_mask", m, {d.B, d.Sk}, "(B, Sk)");
    check_device_as(op, "key_padding_mask", m, "q", q);
  }
  if (segment_ids.has_value()) {
    const at::Tensor& ids = *segment_ids;
    check_defined(op, "segment_ids", ids);
    checks::check_index_dtype(op, "segment_ids", ids);
    check_shape(op, "segment_ids", ids, {d.B, d.Sk}, "(B, Sk)");
    check_device_as(op, "segment_ids", ids, "q", q);
  }
  CKPT_CHECK_VALUE(!window.has_value() || *window > 0, op,
                   "window must be > 0 (key j is visible from query i iff i - window < j <= i), "
                   "got ", window.value_or(0));
  checks::check_positive_finite(op, "scale", scale);
  CKPT_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, op,
                   "softcap must be a finite number >= 0 (0: no cap), got ", softcap);
  return d;
}

// Which (query, key) pairs may be attended, and which ranges of keys / queries a tile of
// queries / keys can meet. Every position here is global: query row r of q is at q_off + r.
// Key j is visible from query i iff
//   i - before <= j <= i + after              (the band: causal, window; kNoLimit = none)
//   and the key is not padded                 (key_padding_mask)
//   and ids[b, i] == ids[b, j]                (segment_ids)
struct AttnMask {
  static constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max() / 4;
  int64_t S = 0;                // Sk: keys 0..S-1
  int64_t q_lo = 0, q_hi = 0;   // the queries' positions [q_off, q_off + Sq)
  int64_t before = kNoLimit, after = kNoLimit;
  at::Tensor blocked_keys;      // (B, S) bool, True = key padded out; undefined without a mask
  at::Tensor ids;               // (B, S) int64 segment ids; undefined without segments
  std::vector<int64_t> first;   // (B * S): first position in its row of the id at (b, i)
  std::vector<int64_t> last;    // (B * S): last position in its row of the id at (b, i)

  bool banded(int64_t i0, int64_t m, int64_t j0, int64_t n) const {
    // some key of [j0, j0 + n) lies outside the band of some query of [i0, i0 + m)
    return j0 + n - 1 > i0 + after || j0 < i0 + m - 1 - before;
  }

  // The positions [lo, hi) within [bound_lo, bound_hi) that positions [p0, p0 + len) can be
  // paired with: keys of a query tile (reach_lo = before, reach_hi = after) or queries of a key
  // tile (the reaches swapped; the segment relation is symmetric).
  std::pair<int64_t, int64_t> partners(int64_t b, int64_t p0, int64_t len, int64_t reach_lo,
                                       int64_t reach_hi, int64_t bound_lo,
                                       int64_t bound_hi) const {
    int64_t lo = std::max<int64_t>(bound_lo, p0 - reach_lo);
    int64_t hi = std::min<int64_t>(bound_hi, p0 + len + reach_hi);
    if (ids.defined()) {
      int64_t seg_lo = S, seg_hi = 0;
      for (int64_t p = b * S + p0; p < b * S + p0 + len; ++p) {
        seg_lo = std::min(seg_lo, first[p]);
        seg_hi = std::max(seg_hi, last[p] + 1);
      }
      lo = std::max(lo, seg_lo);
      hi = std::min(hi, seg_hi);
    }
    return {lo, std::max(lo, hi)};
  }
  std::pair<int64_t, int64_t> keys_for(int64_t b, int64_t i0, int64_t m) const {
    return partners(b, i0, m, before, after, 0, S);
  }
  std::pair<int64_t, int64_t> queries_for(int64_t b, int64_t j0, int64_t n) const {
    return partners(b, j0, n, after, before, q_lo, q_hi);
  }

  // Bool tile, True = score is masked out; shaped to broadcast over the score tile viewed as
  // (m, G, n): (m, 1, n) when the band or the segments cut through the tile, else (1, 1, n).
  // Undefined when no rule masks anything in the tile.
  at::Tensor tile(int64_t b, int64_t i0, int64_t m, int64_t j0, int64_t n) const {
    at::Tensor blocked;
    auto merge = [&blocked](const at::Tensor& t) {
      blocked = blocked.defined() ? blocked.logical_or(t) : t;
    };
    if (banded(i0, m, j0, n)) {
      auto opts = at::TensorOptions().dtype(at::kLong);
      at::Tensor dist = at::arange(j0, j0 + n, opts).view({1, 1, n}) -
                        at::arange(i0, i0 + m, opts).view({m, 1, 1});  // j - i, (m, 1, n)
      merge(dist.gt(after).logical_or_(dist.lt(-before)));
    }
    if (blocked_keys.defined()) {
      merge(blocked_keys.select(0, b).narrow(0, j0, n).view({1, 1, n}));
    }
    if (ids.defined()) {
      at::Tensor row = ids.select(0, b);
      merge(row.narrow(0, i0, m).view({m, 1, 1}).ne(row.narrow(0, j0, n).view({1, 1, n})));
    }
    return blocked;
  }
};

// An uninitialised (B, H, S, D) tensor laid out (B, S, H, D) in memory (see "Layout" above).
at::Tensor empty_bshd(int64_t B, int64_t H, int64_t S, int64_t D, const at::TensorOptions& o) {
  return at::empty({B, S, H, D}, o).transpose(1, 2);
}

// t (B, H, S, D) laid out (B, S, H, D): t itself when it already is, else a copy.
at::Tensor as_bshd(const at::Tensor& t) {
  return t.transpose(1, 2).contiguous().transpose(1, 2);
}

// The G query heads of kv head hk at rows [i0, i0 + m) of batch b: a view (m, G, D) of
// t (B, Hq, Sq, D) (q, out, dout, dq), rows in (position, head) order once flattened.
at::Tensor group_rows(const at::Tensor& t, int64_t b, int64_t hk, int64_t G, int64_t i0,
                      int64_t m) {
  return t.select(0, b).narrow(0, hk * G, G).narrow(1, i0, m).transpose(0, 1);
}

// The scores of a tile, s = scale q k^T (m * G, n), capped in place when softcap > 0
// (softcap * tanh(s / softcap)). Returns the cap's derivative 1 - tanh^2(s / softcap) when
// `derivative` (the backward's factor on dS), else an undefined tensor.
at::Tensor tile_scores(at::Tensor& s, double scale, double softcap, bool derivative) {
  s.mul_(scale);
  if (softcap <= 0) return at::Tensor();
  s.div_(softcap).tanh_();                                      // tanh(s / softcap)
  at::Tensor dcap = derivative ? s.square().neg_().add_(1.0) : at::Tensor();
  s.mul_(softcap);
  return dcap;
}

// Online softmax of one query tile against the keys of one kv head that it can see.
//   qt (m * G, D) in the compute dtype, rows in (position, head) order, global positions
//   [i0, i0 + m); kh, vh (Sk, D) of the kv head, any dtype (tiles are converted); vh
//   undefined = statistics only (no output accumulation); softcap as in tile_scores.
// Returns (acc (m * G, D) or undefined, row_max (m * G,), row_sum (m * G,)), where
// out = acc / row_sum and lse = row_max + log(row_sum); a row with nothing allowed keeps
// row_max = -inf, row_sum = 0, acc = 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> online_softmax(
    const at::Tensor& qt, const at::Tensor& kh, const at::Tensor& vh, const AttnMask& mask,
    int64_t b, int64_t i0, int64_t m, int64_t G, double scale, double softcap) {
  const at::ScalarType cdt = qt.scalar_type();
  const int64_t rows = qt.size(0);
  at::Tensor row_max = at::full({rows}, -kInf, qt.options());
  at::Tensor row_sum = at::zeros({rows}, qt.options());
  at::Tensor acc = vh.defined() ? at::zeros({rows, qt.size(1)}, qt.options()) : at::Tensor();
  const auto [j_begin, j_end] = mask.keys_for(b, i0, m);  // the other keys are all masked
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlockN) {
    const int64_t n = std::min(kBlockN, j_end - j0);
    at::Tensor kt = kh.narrow(0, j0, n).to(cdt);                  // (n, D)
    at::Tensor s = at::mm(qt, kt.t());                            // (m * G, n)
    tile_scores(s, scale, softcap, /*derivative=*/false);
    at::Tensor blocked = mask.tile(b, i0, m, j0, n);
    if (blocked.defined()) s.view({m, G, n}).masked_fill_(blocked, -kInf);
    at::Tensor new_max = at::maximum(row_max, s.amax(1));         // (m * G,)
    // Subtract 0 instead of -inf on rows with nothing allowed so far: their p stays 0.
    at::Tensor shift = new_max.masked_fill(new_max == -kInf, 0.0);
    at::Tensor p = s.sub_(shift.unsqueeze(1)).exp_();             // (m * G, n)
    at::Tensor alpha = (row_max - shift).exp_();                  // rescales older blocks
    row_sum.mul_(alpha).add_(p.sum(1));
    if (acc.defined()) {
      at::Tensor vt = vh.narrow(0, j0, n).to(cdt);                // (n, D)
      acc.mul_(alpha.unsqueeze(1)).addmm_(p, vt);
    }
    row_max = new_max;
  }
  return {acc, row_max, row_sum};
}

// lse (m * G,) from the online-softmax statistics; -inf where nothing was allowed.
at::Tensor lse_from_stats(const at::Tensor& row_max, const at::Tensor& row_sum) {
  return row_max + row_sum.log();  // row_sum == 0 exactly when row_max == -inf
}

AttnMask make_mask(const AttnDims& d, const std::optional<at::Tensor>& key_padding_mask,
                   const std::optional<at::Tensor>& segment_ids, std::optional<int64_t> window,
                   bool causal) {
  AttnMask mask;
  const int64_t S = d.Sk;
  mask.S = S;
  mask.q_lo = d.q_off;
  mask.q_hi = d.q_off + d.Sq;
  if (window.has_value() && *window < S) mask.before = *window - 1;  // >= S: no window
  mask.after = causal ? 0 : mask.before;
  if (key_padding_mask.has_value()) mask.blocked_keys = key_padding_mask->logical_not();
  if (segment_ids.has_value()) {
    mask.ids = segment_ids->to(at::kLong).contiguous();
    mask.first.resize(d.B * S);
    mask.last.resize(d.B * S);
    const int64_t* id = mask.ids.data_ptr<int64_t>();
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> span;  // id -> (first, last)
    for (int64_t b = 0; b < d.B; ++b) {
      span.clear();
      for (int64_t i = 0; i < S; ++i) {
        span.try_emplace(id[b * S + i], i, i).first->second.second = i;
      }
      for (int64_t i = 0; i < S; ++i) {
        const auto& [lo, hi] = span[id[b * S + i]];
        mask.first[b * S + i] = lo;
        mask.last[b * S + i] = hi;
      }
    }
  }
  return mask;
}

// Without a padding mask, segments or a window, ATen's CPU flash attention computes the same
// forward out/lse (natural-log logsumexp, fp32 for fp32/bf16/fp16 inputs, GQA without repeating
// K/V) about 3x faster than the tiles below; it serves the forward there. fp64 stays on the
// tiles (its lse would be fp64). Its backward is not used: on rows that attend few keys its dk
// error reached 3.2x plain PyTorch's (tests/test_ops.py), past this project's 3x bound; the
// tiled backward below stays within it and reads the same lse.
//
// A causal chunk of queries at the end of its keys (q_offset + Sq == Sk, as the decoder layer
// walks its chunks) takes it too in float32, as two calls merged by their lse: the keys before
// the chunk, all visible (not causal), and the chunk's own keys, a causal square (its causal
// mask is j <= i for row i, right for a square only). Other query chunks, and half-precision
// ones, stay on the tiles: its half-precision lse measured 4e-5 from the float64 one at S 150
// (fp16, not causal), the tiles' 6e-7. It cannot cap the scores: with softcap the tiles serve.
enum class AtenFlash { kNo, kWhole, kCausalChunk };

AtenFlash use_aten_flash(const at::Tensor& q, const AttnMask& mask, const AttnDims& d,
                         bool causal, double softcap) {
  const auto dt = q.scalar_type();
  if (softcap > 0 || mask.blocked_keys.defined() || mask.ids.defined() ||
      mask.before != AttnMask::kNoLimit)
    return AtenFlash::kNo;
  if (d.q_off == 0 && d.Sq == d.Sk &&
      (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf))
    return AtenFlash::kWhole;
  if (causal && d.q_off + d.Sq == d.Sk && dt == at::kFloat) return AtenFlash::kCausalChunk;
  return AtenFlash::kNo;
}

// ATen's CPU flash forward: out (a (B, H, S, D) view of (B, S, H, D) memory) and lse (fp32).
std::tuple<at::Tensor, at::Tensor> aten_flash(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, bool causal, double scale) {
  // That kernel reads each (B, H, S) row of D values with a unit stride, whatever the
  // tensor's strides say: inputs with a strided last dim are copied first.
  auto unit_d = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(
      unit_d(q), unit_d(k), unit_d(v), 0.0, causal, std::nullopt, scale);
  // It allocates its output (B, S, H, D) and returns the (B, H, S, D) view: no copy here.
  return {as_bshd(o), l.to(at::kFloat).contiguous()};
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const std::optional<at::Tensor>& key_padding_mask,
                                                     const std::optional<at::Tensor>& segment_ids,
                                                     std::optional<int64_t> window, bool causal,
                                                     double scale, int64_t q_offset,
                                                     double softcap) {
  const char* op = "attention_fwd";
  const AttnDims d =
      check_qkv(op, q, k, v, key_padding_mask, segment_ids, window, scale, q_offset, softcap);
  if (d.Sq == 0) {  // empty outputs, as torch's attention gives (ATen's flash kernel divides by S)
    return {empty_bshd(d.B, d.Hq, 0, d.D, q.options()),
            at::empty({d.B, d.Hq, 0}, q.options().dtype(at::kFloat))};
  }
  const AttnMask mask = make_mask(d, key_padding_mask, segment_ids, window, causal);
  const AtenFlash flash = use_aten_flash(q, mask, d, causal, softcap);
  if (flash == AtenFlash::kWhole) return aten_flash(q, k, v, causal, scale);
  if (flash == AtenFlash::kCausalChunk) {
    const int64_t s0 = d.q_off;
    auto [own, own_lse] = aten_flash(q, k.narrow(2, s0, d.Sq), v.narrow(2, s0, d.Sq), true, scale);
    if (s0 == 0) return {own, own_lse};
    auto [past, past_lse] = aten_flash(q, k.narrow(2, 0, s0), v.narrow(2, 0, s0), false, scale);
    // softmax over both key ranges: each part weighted by its share exp(lse_part - lse)
    at::Tensor lse = at::logaddexp(past_lse, own_lse);                           // (B, Hq, Sq)
    at::Tensor out = empty_bshd(d.B, d.Hq, d.Sq, d.D, q.options());
    at::mul_out(out, past, (past_lse - lse).exp_().unsqueeze(-1));
    out.addcmul_(own, (own_lse - lse).exp_().unsqueeze(-1));
    return {out, lse};
  }
  const at::ScalarType cdt = checks::compute_dtype(q.scalar_type());
  at::Tensor out = empty_bshd(d.B, d.Hq, d.Sq, d.D, q.options());                  // (B, Hq, Sq, D)
  at::Tensor lse = at::empty({d.B, d.Hq, d.Sq}, q.options().dtype(at::kFloat));    // (B, Hq, Sq)
  const int64_t num_q_tiles = (d.Sq + kBlockM - 1) / kBlockM;

  const int64_t items = d.B * d.Hkv * num_q_tiles;
  at::parallel_for(0, items, d.grain(items), [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;  // worker threads do not inherit the caller's
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (d.Hkv * num_q_tiles);
      const int64_t hk = (item / num_q_tiles) % d.Hkv;
      const int64_t i0 = (item % num_q_tiles) * kBlockM;
      const int64_t m = std::min(kBlockM, d.Sq - i0);
      at::Tensor qt = group_rows(q, b, hk, d.G, i0, m).to(cdt).reshape({m * d.G, d.D});
      at::Tensor kh = k.select(0, b).select(0, hk);  // (Sk, D)
      at::Tensor vh = v.select(0, b).select(0, hk);  // (Sk, D)
      auto [acc, row_max, row_sum] =
          online_softmax(qt, kh, vh, mask, b, d.q_off + i0, m, d.G, scale, softcap);
      at::Tensor inv = row_sum.reciprocal().masked_fill_(row_sum == 0, 0.0);  // (m * G,)
      acc.mul_(inv.unsqueeze(1));
      group_rows(out, b, hk, d.G, i0, m).copy_(acc.view({m, d.G, d.D}));
      lse.select(0, b).narrow(0, hk * d.G, d.G).narrow(1, i0, m).transpose(0, 1)
          .copy_(lse_from_stats(row_max, row_sum).view({m, d.G}));
    }
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& segment_ids, std::optional<int64_t> window, bool causal,
    double scale, int64_t q_offset, const std::optional<at::Tensor>& dk_acc_out,
    const std::optional<at::Tensor>& dv_acc_out, double softcap) {
  const char* op = "attention_bwd";
  const AttnDims d =
      check_qkv(op, q, k, v, key_padding_mask, segment_ids, window, scale, q_offset, softcap);
  checks::check_like(op, "dout", dout, "q", q, q.sizes(), "(the shape of q)");
  checks::check_like(op, "out", out, "q", q, q.sizes(), "(the shape of q)");
  check_defined(op, "lse", lse);
  check_shape(op, "lse", lse, {d.B, d.Hq, d.Sq}, "(B, Hq, Sq)");
  check_dtype(op, "lse", lse, at::kFloat);
  check_device_as(op, "lse", lse, "q", q);
  const bool accumulate = dk_acc_out.has_value();
  CKPT_CHECK_VALUE(dk_acc_out.has_value() == dv_acc_out.has_value(), op,
                   "dk_acc and dv_acc must be given together or both left out, got dk_acc ",
                   dk_acc_out.has_value() ? "given" : "absent", " and dv_acc ",
                   dv_acc_out.has_value() ? "given" : "absent");
  if (accumulate) {
    checks::check_accumulator(op, "dk_acc", *dk_acc_out, "q", q, {d.B, d.Hkv, d.Sk, d.D},
                              "(B, Hkv, Sk, D)");
    checks::check_accumulator(op, "dv_acc", *dv_acc_out, "q", q, {d.B, d.Hkv, d.Sk, d.D},
                              "(B, Hkv, Sk, D)");
  }
  const at::ScalarType cdt = checks::compute_dtype(q.scalar_type());
  at::Tensor dq = empty_bshd(d.B, d.Hq, d.Sq, d.D, q.options());   // (B, Hq, Sq, D)
  // With accumulators, dk / dv are the (0,) placeholders and the sums go into the accumulators.
  at::Tensor dk = accumulate ? at::empty({0}, k.options())
                             : empty_bshd(d.B, d.Hkv, d.Sk, d.D, k.options());  // (B, Hkv, Sk, D)
  at::Tensor dv = accumulate ? at::empty({0}, v.options())
                             : empty_bshd(d.B, d.Hkv, d.Sk, d.D, v.options());  // (B, Hkv, Sk, D)
  if (d.Sq == 0) {  // no queries: no contribution to dk / dv
    if (!accumulate) dk.zero_(), dv.zero_();
    return {dq, dk, dv};
  }
  const AttnMask mask = make_mask(d, key_padding_mask, segment_ids, window, causal);
  const int64_t G = d.G, S = d.Sq, Sk = d.Sk, D = d.D, q_off = d.q_off;

  at::parallel_for(0, d.B * d.Hkv, d.grain(d.B * d.Hkv), [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / d.Hkv, hk = item % d.Hkv;
      // The head group in (position, head) row order, compute dtype, contiguous.
      // S = Sq query rows; their positions are q_off + row.
      at::Tensor qg = group_rows(q, b, hk, G, 0, S).to(cdt).contiguous();        // (S, G, D)
      at::Tensor dog = group_rows(dout, b, hk, G, 0, S).to(cdt).contiguous();    // (S, G, D)
      at::Tensor og = group_rows(out, b, hk, G, 0, S).to(cdt);                   // (S, G, D)
      at::Tensor delta = (dog * og).sum(-1).view({S * G});                       // (S * G,)
      at::Tensor kh = k.select(0, b).select(0, hk).to(cdt).contiguous();         // (Sk, D)
      at::Tensor vh = v.select(0, b).select(0, hk).to(cdt).contiguous();         // (Sk, D)
      at::Tensor lse_g;                                                          // (S * G,)
      if (cdt == at::kDouble) {
        lse_g = at::empty({S * G}, qg.options());
        for (int64_t i0 = 0; i0 < S; i0 += kBlockM) {
          const int64_t m = std::min(kBlockM, S - i0);
          at::Tensor qt = qg.narrow(0, i0, m).view({m * G, D});
          auto stats =
              online_softmax(qt, kh, at::Tensor(), mask, b, q_off + i0, m, G, scale, softcap);
          lse_g.narrow(0, i0 * G, m * G)
              .copy_(lse_from_stats(std::get<1>(stats), std::get<2>(stats)));
        }
      } else {
        lse_g = lse.select(0, b).narrow(0, hk * G, G).transpose(0, 1).to(cdt).reshape({S * G});
      }
      // exp(s - (+inf)) = 0 gives P = 0 on rows with nothing to attend (lse = -inf).
      at::Tensor lse_safe = lse_g.masked_fill(lse_g == -kInf, kInf).unsqueeze(1);  // (S * G, 1)
      at::Tensor dq_acc = at::zeros({S * G, D}, qg.options());                   // (S * G, D)
      at::Tensor dk_acc = at::zeros({Sk, D}, qg.options());                      // (Sk, D)
      at::Tensor dv_acc = at::zeros({Sk, D}, qg.options());                      // (Sk, D)
      at::Tensor q_rows = qg.view({S * G, D}), do_rows = dog.view({S * G, D});

      for (int64_t j0 = 0; j0 < Sk; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, Sk - j0);
        at::Tensor kt = kh.narrow(0, j0, n), vt = vh.narrow(0, j0, n);      // (n, D)
        at::Tensor dkt = dk_acc.narrow(0, j0, n), dvt = dv_acc.narrow(0, j0, n);
        // Only the queries that can see a key of this tile (band and segments), as rows of q.
        const auto [p_begin, p_end] = mask.queries_for(b, j0, n);
        const int64_t i_begin = p_begin - q_off, i_end = p_end - q_off;
        for (int64_t i0 = i_begin; i0 < i_end; i0 += kBlockM) {
          const int64_t m = std::min(kBlockM, i_end - i0);
          const int64_t r0 = i0 * G, rows = m * G;
          at::Tensor qt = q_rows.narrow(0, r0, rows);                          // (m * G, D)
          at::Tensor dot = do_rows.narrow(0, r0, rows);                        // (m * G, D)
          at::Tensor s = at::mm(qt, kt.t());                                   // (m * G, n)
          const at::Tensor dcap = tile_scores(s, scale, softcap, /*derivative=*/true);
          at::Tensor blocked = mask.tile(b, q_off + i0, m, j0, n);
          if (blocked.defined()) s.view({m, G, n}).masked_fill_(blocked, -kInf);
          at::Tensor p = s.sub_(lse_safe.narrow(0, r0, rows)).exp_();          // P (m * G, n)
          dvt.addmm_(p.t(), dot);                                              // dV += P^T dO
          at::Tensor ds = at::mm(dot, vt.t());                                 // dP = dO V^T
          ds.sub_(delta.narrow(0, r0, rows).unsqueeze(1)).mul_(p);             // dS = P (dP - D)
          if (dcap.defined()) ds.mul_(dcap);                                   // through the cap
          dq_acc.narrow(0, r0, rows).addmm_(ds, kt, 1.0, scale);               // dQ += scale dS K
          dkt.addmm_(ds.t(), qt, 1.0, scale);                                  // dK += scale dS^T Q
        }
      }
      group_rows(dq, b, hk, G, 0, S).copy_(dq_acc.view({S, G, D}));
      if (accumulate) {  // the chunk's share, added in the compute dtype
        dk_acc_out->select(0, b).select(0, hk).add_(dk_acc);
        dv_acc_out->select(0, b).select(0, hk).add_(dv_acc);
      } else {
        dk.select(0, b).select(0, hk).copy_(dk_acc);
        dv.select(0, b).select(0, hk).copy_(dv_acc);
      }
    }
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_cpu);
  m.impl("attention_bwd", &attention_bwd_cpu);
}

}  // namespace ckpt_ext
