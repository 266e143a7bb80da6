// KV cache write for XLA:CPU (an XLA FFI custom call), float32: each batch row's T new keys and values into one
// layer's buffers at slots start .. start + T - 1 (start clamped to [0, S - T], as the reference's scatter clamps),
// in place: the buffers are aliased to the outputs.
//
// Why a kernel: XLA:CPU runs a scatter of T > 1 slots index by index, a strided store per element into keys stored
// slots-last, plus copies of the new block into the scatter's layout; one layer's write of a 9-position SmolLM2 verify
// pass cost as much as its RMS norms and RoPE together. Here each (row, kv head, dimension) is one run of T floats
// (keys slots-last) or each (row, position, kv head) one run of D floats (values, and keys stored slots-first).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error CacheWrite(ffi::Buffer<ffi::F32> k_buf, ffi::Buffer<ffi::F32> v_buf, ffi::Buffer<ffi::F32> k_new,
                      ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> k_out,
                      ffi::ResultBuffer<ffi::F32> v_out, bool keys_transposed) {
  const auto kd = k_buf.dimensions(), vd = v_buf.dimensions(), nd = k_new.dimensions();
  if (kd.size() != 4 || vd.size() != 4 || nd.size() != 4)
    return ffi::Error::InvalidArgument("cache_write: buffers and new entries must be 4-D");
  const int64_t B = nd[0], T = nd[1], H = nd[2], D = nd[3], S = vd[2];
  const bool k_ok = keys_transposed ? (kd[0] == B && kd[1] == H && kd[2] == D && kd[3] == S)
                                    : (kd[0] == B && kd[1] == H && kd[2] == S && kd[3] == D);
  if (!k_ok || vd[0] != B || vd[1] != H || vd[3] != D || v_new.element_count() != k_new.element_count() ||
      starts.element_count() != B)
    return ffi::Error::InvalidArgument("cache_write: shapes do not form keys [B, Hkv, D, S] (slots-last) or "
                                       "[B, Hkv, S, D], values [B, Hkv, S, D], new entries [B, T, Hkv, D], starts [B]");
  if (T > S) return ffi::Error::InvalidArgument("cache_write: more new entries than the buffers' slots");
  float* ko = k_out->typed_data();
  float* vo = v_out->typed_data();
  // The outputs alias the buffers; should XLA ever hand over separate ones, start them as copies.
  if (ko != k_buf.typed_data()) std::memcpy(ko, k_buf.typed_data(), k_buf.element_count() * sizeof(float));
  if (vo != v_buf.typed_data()) std::memcpy(vo, v_buf.typed_data(), v_buf.element_count() * sizeof(float));
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  const int32_t* st = starts.typed_data();
  // Every line the write touches is requested for writing first: the buffers sit in memory between a layer's
  // writes (evicted by the weights' stream), and stores one by one would wait on one line after another.
  const auto request = [](const float* first, int64_t n) {       // the lines of n floats from first
    for (const float* p = first; p < first + n; p += 16) __builtin_prefetch(p, 1, 3);
    __builtin_prefetch(first + n - 1, 1, 3);                      // a run that starts mid-line ends in one more
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = std::clamp<int64_t>(st[b], 0, S - T);
    for (int64_t h = 0; h < H; ++h) {
      request(vo + ((b * H + h) * S + s0) * D, T * D);
      if (!keys_transposed) request(ko + ((b * H + h) * S + s0) * D, T * D);
      else
        for (int64_t d = 0; d < D; ++d) request(ko + ((b * H + h) * D + d) * S + s0, T);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = std::clamp<int64_t>(st[b], 0, S - T);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t from = ((b * T + t) * H + h) * D;
        std::memcpy(vo + ((b * H + h) * S + s0 + t) * D, vn + from, D * sizeof(float));
        if (!keys_transposed) std::memcpy(ko + ((b * H + h) * S + s0 + t) * D, kn + from, D * sizeof(float));
      }
    if (keys_transposed)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          float* run = ko + ((b * H + h) * D + d) * S + s0;
          for (int64_t t = 0; t < T; ++t) run[t] = kn[((b * T + t) * H + h) * D + d];
        }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("keys_transposed"));
