// The greedy token for XLA:CPU (an XLA FFI custom call): logits [rows, V] float32 -> int32 [rows], the index of a
// row's largest logit, the first on ties, a NaN counting as the largest (jnp.argmax's rule). Why a kernel: XLA:CPU
// runs it as two passes (the max, then the first index holding it), the second several times slower than reading
// the logits, and a verify pass's rows x a vocabulary of logits is megabytes.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

constexpr int kChains = 4;      // independent running maxima, so a compare-and-select chain does not set the pace

// One row: each lane keeps its running maximum and the first index holding it (a strictly larger value replaces
// it, so ties keep the earlier index); then the lanes' best, the smallest index among the lanes holding the
// maximum; the last V % (kChains * kLanes) logits one by one. A NaN is never larger, so the vector pass ignores it
// and only notes that one was seen; a row with one scans for its first NaN.
int32_t greedy_row(const float* x, int64_t V) {
  const int64_t step = kChains * kLanes, full = V / step * step;
  float best = -INFINITY;
  int64_t at = 0;
  bool nan = false;
  if (full > 0) {
    ivec lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = i;
    vec m[kChains];
    ivec idx[kChains];
    ivec seen_nan = lane - lane;
    for (int c = 0; c < kChains; ++c) {
      m[c] = load(x + c * kLanes);
      idx[c] = lane + c * kLanes;
      seen_nan |= m[c] != m[c];
    }
    for (int64_t i = step; i < full; i += step) {
      for (int c = 0; c < kChains; ++c) {
        const vec v = load(x + i + c * kLanes);
        const ivec larger = v > m[c];
        m[c] = larger ? v : m[c];
        idx[c] = larger ? lane + static_cast<int32_t>(i + c * kLanes) : idx[c];
        seen_nan |= v != v;
      }
    }
    float mv[kChains][kLanes];
    int32_t iv[kChains][kLanes];
    for (int c = 0; c < kChains; ++c) {
      std::memcpy(mv[c], &m[c], sizeof(mv[c]));
      std::memcpy(iv[c], &idx[c], sizeof(iv[c]));
    }
    best = mv[0][0];
    at = iv[0][0];
    for (int c = 0; c < kChains; ++c)
      for (int l = 0; l < kLanes; ++l)
        if (mv[c][l] > best || (mv[c][l] == best && iv[c][l] < at)) best = mv[c][l], at = iv[c][l];
    for (int l = 0; l < kLanes; ++l) nan |= seen_nan[l] != 0;
  }
  for (int64_t i = full; i < V; ++i) {
    if (x[i] > best || (i == 0 && !std::isnan(x[i]))) best = x[i], at = i;
    nan |= std::isnan(x[i]);
  }
  if (nan)
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return static_cast<int32_t>(i);
  return static_cast<int32_t>(at);
}

// Rows per part: about 128 Ki logits each, so one row (a decode step's) stays on the calling thread.
constexpr int64_t kPartElements = 131072;

ffi::Error GreedyToken(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out,
                       int64_t parts) {
  const int64_t rows = out->element_count();
  if (rows < 1 || logits.element_count() % rows || logits.element_count() == 0)
    return ffi::Error::InvalidArgument("greedy_token: logits [..., V] and out [...]");
  const int64_t V = logits.element_count() / rows;
  if (V > INT32_MAX) return ffi::Error::InvalidArgument("greedy_token: a vocabulary over 2^31 logits");
  const float* lp = logits.typed_data();
  int32_t* op = out->typed_data();
  const int64_t split = std::clamp<int64_t>(rows * V / kPartElements, 1, std::max<int64_t>(1, std::min(parts, rows)));
  run_parts(pool, split, static_cast<int>(split), [=](int p) {
    for (int64_t r = rows * p / split; r < rows * (p + 1) / split; ++r) op[r] = greedy_row(lp + r * V, V);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGreedyToken, GreedyToken,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("parts"));
