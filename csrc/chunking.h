// The byte cap of the CPU kernels' transient chunks.
//
// Kernels that walk tokens in chunks to bound a (rows, N) intermediate (the LM head's (rows, V)
// logits) size their chunks from one setting, the environment variable CKPT_EXT_CHUNK_BYTES:
// the most bytes one such intermediate may take (default 64 MiB; a plain integer, or with a
// KiB / MiB / GiB suffix). It is read at each call, so a test or a run can change it between
// steps. A chunk has at least one row, so a row wider than the cap still runs, one row at a
// time. The default keeps the CPU LM head's speed: each chunk re-reads the whole (V, H) weight
// three times, so fewer rows per chunk cost time (T 512, H 256, fp32, 2 cores: fwd+bwd at
// V 32000 took 1.03 / 0.76 / 0.70 s with 16 / 32 / 64 MiB, at V 128256 6.6 / 4.7 / 3.6 s).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace ckpt_ext {
namespace chunking {

constexpr int64_t kDefaultChunkBytes = int64_t{64} << 20;
constexpr const char* kChunkBytesVar = "CKPT_EXT_CHUNK_BYTES";

// The cap in bytes: CKPT_EXT_CHUNK_BYTES, or kDefaultChunkBytes when unset or empty.
inline int64_t chunk_bytes() {
  const char* raw = std::getenv(kChunkBytesVar);
  if (raw == nullptr || *raw == '\0') return kDefaultChunkBytes;
  const std::string text(raw);
  size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  int64_t scale = 1;
  if (unit == "KiB") scale = int64_t{1} << 10;
  else if (unit == "MiB") scale = int64_t{1} << 20;
  else if (unit == "GiB") scale = int64_t{1} << 30;
  else if (!unit.empty()) used = 0;
  TORCH_CHECK_VALUE(used > 0 && value > 0 && value <= (int64_t{1} << 40) / scale,
                    kChunkBytesVar, " must be a positive number of bytes (e.g. 16777216 or "
                    "16MiB, at most 1 TiB), got '", text, "'");
  return static_cast<int64_t>(value) * scale;
}

// Rows per chunk for rows of row_bytes bytes each: as many as fit the cap, at least 1.
inline int64_t chunk_rows(int64_t row_bytes) {
  return std::max<int64_t>(1, chunk_bytes() / std::max<int64_t>(1, row_bytes));
}

}  // namespace chunking
}  // namespace ckpt_ext
