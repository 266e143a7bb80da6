// RMS norm for XLA:CPU (an XLA FFI custom call), float32: y = (x * (1 / sqrt(mean(x^2) + eps))) * w per row.
//
// Why a kernel: XLA:CPU splits a row's sum of squares into partial sums whose layout follows the whole array's
// shape, so a row normalized in a batch of two came out a bit away from the same row alone. Here a row's sum is
// fused multiply-adds in vector lanes over the row (lane = index mod the width; the tail by scalar fused
// multiply-adds into its lanes), then a fixed pairwise sum of the lanes: the same operations whatever the call.
#include <cmath>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> y,
                   float eps) {
  const int64_t H = weight.element_count();
  if (H == 0 || x.element_count() % H != 0)
    return ffi::Error::InvalidArgument("rms_norm: x must be [..., H] for a weight of H elements");
  const int64_t rows = x.element_count() / H, full = H / kLanes * kLanes;
  const float* xp = x.typed_data();
  const float* w = weight.typed_data();
  float* yp = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * H;
    vec acc = {};
    for (int64_t i = 0; i < full; i += kLanes) {
      const vec v = load(xr + i);
      acc = fmadd(v, v, acc);
    }
    for (int64_t i = full; i < H; ++i) acc[i - full] = __builtin_fmaf(xr[i], xr[i], acc[i - full]);
    const float scale = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(H) + eps);
    float* yr = yp + r * H;
    for (int64_t i = 0; i < H; ++i) yr[i] = (xr[i] * scale) * w[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
