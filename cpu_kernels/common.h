// Shared by the CPU kernels: GCC vector extensions at the machine's width (512-bit with AVX-512, 256-bit elsewhere:
// AVX2, or NEON's lowering), the two vector operations whose code generation must not be left to the compiler, and
// the split of a call's work over XLA's intra-op threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace specjax_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;                     // floats per vector
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));   // unaligned access

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// Every fused multiply-add of the kernels is this explicit one (a * b + c, rounded once), and the library is built
// with -ffp-contract=off: left to the compiler, whether a product was fused into its sum differed between
// instances of one template on AVX2 (and with it a row's bits between calls of different M).
template <class V>
inline V fmadd(V a, V b, V c) {
  constexpr int n = sizeof(V) / sizeof(float);
#if defined(__AVX512F__)
  if constexpr (n == 16) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (n == 8) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  V r;
  for (int i = 0; i < n; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

template <class V>
inline V splat(float s) {                      // s in every lane (a lane loop compiles to 16 masked broadcasts)
  constexpr int n = sizeof(V) / sizeof(float);
#if defined(__AVX512F__)
  if constexpr (n == 16) return (V)_mm512_set1_ps(s);
#endif
#if defined(__FMA__)
  if constexpr (n == 8) return (V)_mm256_set1_ps(s);
#endif
  V r;
  for (int i = 0; i < n; ++i) r[i] = s;
  return r;
}

typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp(x): Cephes' expf (round to n = x / ln 2, a two-part ln 2, a degree-6 polynomial, 2^n into the exponent bits),
// about 1 ulp, over [-87.33, 88]: below it returns exp(-87.33) (the smallest normals, never a denormal), above it
// exp(88). The kernels' one exp (the softmax's, SwiGLU's sigmoid), so its bits are one function's.
inline vec vexp(vec x) {
  const vec lowest = splat<vec>(-87.33f), highest = splat<vec>(88.0f);
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  const vec magic = splat<vec>(12582912.0f);                                  // 1.5 * 2^23: rounds to an integer
  const vec n = fmadd(x, splat<vec>(1.44269504088896341f), magic) - magic;
  vec r = fmadd(n, splat<vec>(-0.693359375f), x);
  r = fmadd(n, splat<vec>(2.12194440e-4f), r);
  vec p = splat<vec>(1.9875691500e-4f);
  p = fmadd(p, r, splat<vec>(1.3981999507e-3f));
  p = fmadd(p, r, splat<vec>(8.3334519073e-3f));
  p = fmadd(p, r, splat<vec>(4.1665795894e-2f));
  p = fmadd(p, r, splat<vec>(1.6666665459e-1f));
  p = fmadd(p, r, splat<vec>(5.0000001201e-1f));
  const vec y = fmadd(p, r * r, r) + splat<vec>(1.0f);
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  return y * reinterpret_cast<const vec&>(bits);
}

inline float hsum(vec v) {                     // a fixed pairwise order
  float t[kLanes];
  std::memcpy(t, &v, sizeof(t));
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int i = 0; i < s; ++i) t[i] += t[i + s];
  return t[0];
}

// The work is cut into `total` parts; the calling thread and up to workers - 1 pool tasks claim them. The caller
// does any part no task has claimed yet, so it never waits on a task that has not started (a pool busy with other
// work cannot deadlock it).
struct Split {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
};

template <class Run>
void run_parts(xla::ffi::ThreadPool& pool, int64_t workers, int total, Run run) {
  auto split = std::make_shared<Split>();
  auto claim_all = [=]() {
    for (int p; (p = split->next.fetch_add(1)) < total;) {
      run(p);
      split->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min<int64_t>(total, workers); ++t) pool.Schedule([claim_all] { claim_all(); });
  claim_all();
  while (split->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace specjax_cpu
