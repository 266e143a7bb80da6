// SwiGLU for XLA:CPU (an XLA FFI custom call), float32: a fused gate | up projection's output x [..., 2 I] ->
// silu(gate) * up [..., I], silu(g) = g * (1 / (1 + exp(-g))) with the kernels' one exp (vexp), so an element is
// the same operations whatever the call. Why a kernel: XLA:CPU's fused silu * up (the split of its operand
// included) took several times this kernel's time, measured alone at a decode step's and a verify pass's rows.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

// 1 / d to about a float32 ulp: AVX-512's 14-bit estimate and one Newton step (a vector division takes several
// times as long and was most of the kernel's time), else the division.
inline vec reciprocal(vec d) {
#if defined(__AVX512F__)
  const vec r = (vec)_mm512_rcp14_ps((__m512)d);
  return r * (splat<vec>(2.0f) - d * r);
#else
  return splat<vec>(1.0f) / d;
#endif
}

// exp(-gate) capped at exp(80), so that 1 / (1 + exp(-gate)) stays a normal float (silu of a gate below -80 is
// under 1e-33 either way)
inline vec swiglu(vec gate, vec up) {
  const vec minus = -gate, cap = splat<vec>(80.0f);
  return gate * reciprocal(splat<vec>(1.0f) + vexp(minus > cap ? cap : minus)) * up;
}

// Rows [r0, r1) of x [rows, 2 I] into out [rows, I]. A row's last I % kLanes elements go through one vector of
// zeros in place of the rest, the same operations per lane as a full vector's.
void swiglu_rows(const float* x, float* out, int64_t I, int64_t r0, int64_t r1) {
  const int64_t full = I / kLanes * kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    const float* gate = x + r * 2 * I;
    const float* up = gate + I;
    float* o = out + r * I;
    for (int64_t i = 0; i < full; i += kLanes) store(o + i, swiglu(load(gate + i), load(up + i)));
    if (full < I) {
      float g[kLanes] = {}, u[kLanes] = {}, y[kLanes];
      std::copy(gate + full, gate + I, g);
      std::copy(up + full, up + I, u);
      store(y, swiglu(load(g), load(u)));
      std::copy(y, y + (I - full), o + full);
    }
  }
}

// Rows per part: about 64 KiB of output each, so a decode step's few rows stay on the calling thread.
constexpr int64_t kPartElements = 16384;

ffi::Error Swiglu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out, int64_t parts) {
  const auto od = out->dimensions();
  if (od.size() < 1 || od[od.size() - 1] < 1 || x.element_count() != 2 * out->element_count())
    return ffi::Error::InvalidArgument("swiglu: x [..., 2 I] and out [..., I]");
  const int64_t I = od[od.size() - 1], rows = out->element_count() / I;
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  const int64_t split = std::clamp<int64_t>(rows * I / kPartElements, 1, std::max<int64_t>(1, std::min(parts, rows)));
  run_parts(pool, split, static_cast<int>(split),
            [=](int p) { swiglu_rows(xp, op, I, rows * p / split, rows * (p + 1) / split); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSwiglu, Swiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));
