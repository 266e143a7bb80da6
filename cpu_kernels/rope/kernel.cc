// Rotary position embedding for XLA:CPU (an XLA FFI custom call), float32, Hugging Face's rotate-half convention:
// angle i of a position p is float(p) * inv_freq[i]; out[d] = x[d] cos - x[d + D/2] sin and
// out[d + D/2] = x[d + D/2] cos + x[d] sin (each product rounded, then the sum: no fused multiply-add).
//
// Why a kernel: XLA:CPU fuses a product into a following add (one rounding) where both land in one fusion, and which
// fusion RoPE lands in follows the shapes: a decode step's keys, fused into the one-slot cache write, came out a bit
// away from the same keys computed by a verify pass. Here a key is the same operations whatever the call.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Angle i of position p: float(p) * inv_freq[i]; its cosine and sine from the C library.
void angles(int32_t position, const float* inv_freq, int64_t half, float* c, float* s) {
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    c[i] = std::cos(angle);
    s[i] = std::sin(angle);
  }
}

// One head's D values rotated by the angles (each product rounded, then the sum).
void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float lo = x[i], hi = x[i + half];
    out[i] = lo * c[i] - hi * s[i];
    out[i + half] = hi * c[i] + lo * s[i];
  }
}

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
  float* o = out->typed_data();
  std::vector<float> c(half), s(half);
  for (int64_t n = 0; n < N; ++n) {
    angles(positions.typed_data()[n], inv_freq.typed_data(), half, c.data(), s.data());
    for (int64_t h = 0; h < H; ++h) rotate(xp + (n * H + h) * D, c.data(), s.data(), half, o + (n * H + h) * D);
  }
  return ffi::Error::Success();
}

// A fused projection's output qkv [N, (Hq + 2 Hkv) D] (its columns those of wq | wk | wv), positions [N] ->
// q [N, Hq, D] and k [N, Hkv, D] rotated, v [N, Hkv, D] copied: rope of the split, with each position's angles
// computed once for its q and k heads (XLA copied each part out of the fused rows, slowly, before two rope calls).
ffi::Error RopeQkv(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                   ffi::ResultBuffer<ffi::F32> q, ffi::ResultBuffer<ffi::F32> k, ffi::ResultBuffer<ffi::F32> v) {
  const auto qd = q->dimensions(), kd = k->dimensions();
  if (qd.size() < 2 || kd.size() < 2) return ffi::Error::InvalidArgument("rope_qkv: q and k must be [..., H, D]");
  const int64_t D = qd[qd.size() - 1], Hq = qd[qd.size() - 2], Hkv = kd[kd.size() - 2], half = D / 2;
  const int64_t N = positions.element_count(), C = (Hq + 2 * Hkv) * D;
  if (D % 2 != 0 || kd[kd.size() - 1] != D || inv_freq.element_count() != half || N * C != qkv.element_count() ||
      N * Hq * D != q->element_count() || N * Hkv * D != k->element_count() || v->element_count() != k->element_count())
    return ffi::Error::InvalidArgument("rope_qkv: qkv [..., (Hq + 2 Hkv) D], q [..., Hq, D], k and v [..., Hkv, D] "
                                       "with D even, positions of the leading shape, inv_freq [D / 2]");
  const float* xp = qkv.typed_data();
  float *qo = q->typed_data(), *ko = k->typed_data(), *vo = v->typed_data();
  std::vector<float> c(half), s(half);
  for (int64_t n = 0; n < N; ++n) {
    const float* row = xp + n * C;
    angles(positions.typed_data()[n], inv_freq.typed_data(), half, c.data(), s.data());
    for (int64_t h = 0; h < Hq; ++h) rotate(row + h * D, c.data(), s.data(), half, qo + (n * Hq + h) * D);
    for (int64_t h = 0; h < Hkv; ++h)
      rotate(row + (Hq + h) * D, c.data(), s.data(), half, ko + (n * Hkv + h) * D);
    std::memcpy(vo + n * Hkv * D, row + (Hq + Hkv) * D, Hkv * D * sizeof(float));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRopeQkv, RopeQkv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
