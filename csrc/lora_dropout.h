// LoRA dropout with a replayable mask: the mask of an element is a hash of (seed, stream,
// row, column), so backward (and any recompute) regenerates exactly the forward's mask from
// the seed alone, on any device and in any tiling.
//
//   key(seed, stream) = mix32(lo ^ mix32(hi) ^ mix32(stream + 0x9E3779B9))  (uint32 arithmetic)
//   hash(row, col)    = mix32(mix32(row ^ key) ^ col)
//   keep              = hash >= floor(p * 2^32)                            (probability 1 - p)
//   out               = keep ? x * (1 / (1 - p)) : 0     (product in float32, float64 for float64)
//
// lo and hi are the low and high 32 bits of the 64-bit seed (two's complement), so every bit of
// the seed counts; mix32(0) = 0, so a seed in [0, 2^32) has key mix32(seed ^ mix32(stream + ..)).
// Rows and columns are those of the tensor viewed as (numel / size(-1), size(-1)), a 0-d tensor
// as (1, 1). kernels/dropout.py computes the same function in Triton (the fused
// SwiGLU kernels generate the down projection's mask inside their tiles); a change here must
// be made there too (tests/test_lora_dropout.py compares the two bit for bit).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ckpt_ext {
namespace dropout {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

inline uint32_t key(int64_t seed, int64_t stream) {
  const uint64_t bits = static_cast<uint64_t>(seed);
  return mix32(static_cast<uint32_t>(bits) ^ mix32(static_cast<uint32_t>(bits >> 32)) ^
               mix32(static_cast<uint32_t>(stream) + 0x9E3779B9u));
}

inline uint32_t hash(uint32_t key, uint32_t row, uint32_t col) {
  return mix32(mix32(row ^ key) ^ col);
}

// floor(p * 2^32) for p in [0, 1).
inline uint32_t threshold(double p) {
  return static_cast<uint32_t>(p * 4294967296.0);
}

// The seed held by `seed`: a CPU integer tensor with one element (reading it never syncs a
// device). `op` and `name` go into the error.
int64_t read_seed(const char* op, const char* name, const at::Tensor& seed);

// Checks 0 <= p < 1, naming `name`.
void check_probability(const char* op, const char* name, double p);

// x (a CPU tensor) with its rows row0.. of the (rows, size(-1)) view masked and scaled: the
// op lora_dropout on rows offset by row0 (a chunk of a larger tensor).
at::Tensor apply_cpu(const at::Tensor& x, uint32_t key, double p, int64_t row0 = 0);

}  // namespace dropout
}  // namespace ckpt_ext
