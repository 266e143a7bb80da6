// Rotary position embedding for XLA:CPU (an XLA FFI custom call), float32, Hugging Face's rotate-half convention:
// angle i of a position p is float(p) * inv_freq[i]; out[d] = x[d] cos - x[d + D/2] sin and
// out[d + D/2] = x[d + D/2] cos + x[d] sin (each product rounded, then the sum: no fused multiply-add).
//
// Why a kernel: XLA:CPU fuses a product into a following add (one rounding) where both land in one fusion, and which
// fusion RoPE lands in follows the shapes: a decode step's keys, fused into the one-slot cache write, came out a bit
// away from the same keys computed by a verify pass. Here a key is the same operations whatever the call.
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// x [N, H, D], positions [N] -> out [N, H, D]
ffi::Error Rope(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  if (xd.size() < 2) return ffi::Error::InvalidArgument("rope: x must be [..., H, D]");
  const int64_t D = xd[xd.size() - 1], H = xd[xd.size() - 2], half = D / 2;
  const int64_t N = positions.element_count();
  if (D % 2 != 0 || inv_freq.element_count() != half || N * H * D != x.element_count())
    return ffi::Error::InvalidArgument("rope: x [..., H, D] with D even, positions of x's leading shape, "
                                       "inv_freq [D / 2]");
  const float* xp = x.typed_data();
  const float* inv = inv_freq.typed_data();
  const int32_t* pos = positions.typed_data();
  float* o = out->typed_data();
  std::vector<float> c(half), s(half);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(pos[n]) * inv[i];
      c[i] = std::cos(angle);
      s[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = xp + (n * H + h) * D;
      float* orow = o + (n * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = xr[i], hi = xr[i + half];
        orow[i] = lo * c[i] - hi * s[i];
        orow[i + half] = hi * c[i] + lo * s[i];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRope, Rope,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
