// Small-M matrix multiply for XLA:CPU (an XLA FFI custom call): y[M, N] = x[M, K] @ w, w either [K, N] ("nn") or
// [N, K] ("nt", a tied LM head read as embed.T). Built for the M of a decode step or a verify pass (1-192 rows),
// where XLA:CPU's GEMM backend reads the weights several times over: here every weight element is read from memory
// once per call, by one thread, and used for all M rows from registers or cache.
//
// Every output element is the same sequence of float32 operations whatever M and whatever the thread split (nt: a
// chain of fused multiply-adds over k in 16 lanes, then a fixed pairwise sum; nn: two chains over k, rows [0, K/2)
// and [K/2, K) of w, then their sum): a row is bit-identical whichever rows share its call.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 512-bit vectors and 24 of the 32 registers as accumulators with AVX-512; 256-bit and 12 of 16 elsewhere (GCC's
// vector extensions lower to the machine's own width: NEON, AVX2).
#if defined(__AVX512F__)
constexpr int kLanes = 16;                     // floats per vector
constexpr int kMaxAccumulators = 24;
#else
constexpr int kLanes = 8;
constexpr int kMaxAccumulators = 12;
#endif
#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 12)
#define SPECJAX_SHUFFLE_SUMS 1                 // 16 sums at a time by __builtin_shufflevector
#else
#define SPECJAX_SHUFFLE_SUMS 0
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));   // unaligned access

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// A block holds MB rows x NV vectors of accumulators, at most kMaxAccumulators.
// "nn" (w [K, N]), more rows than row-major takes (below): a strip is 4 vectors (64 columns with AVX-512) of up to
// 6 rows, so that M <= 6 is one block over a half of K and each weight element is loaded once. A larger M is cut
// into row blocks of 6 that take turns over chunks of kChunk rows of w: the chunk is read from memory by the first
// block and from L1 by the others, the accumulators go through y between chunks (float32 stores: nothing is
// rounded differently).
// w rows are strided by N, so the hardware prefetchers, which stay inside a 4 KiB page, cannot follow them: each
// step prefetches the lines kPrefetchRows rows ahead itself. With row blocks taking turns, every pass over a chunk
// prefetches the NEXT chunk instead (of this strip, or the next strip's first) into L2, not L1 where the current
// chunk is being reused: the passes after the first compute from cache, and memory would sit idle through them if
// only the first asked for lines (measured: 1536 x 576 at M = 9-16, 1.2-1.4x M = 5's time -> 1.03-1.2x).
constexpr int kStripVectors = 4;
constexpr int kRowBlock = kMaxAccumulators / kStripVectors;
constexpr int64_t kChunk = 64;
constexpr int64_t kPrefetchRows = 16;

// Rows [0, MB) of y, columns [n0, n0 + NV * 16), over k in [k0, k1): from zero when fresh, else from y. The step
// at w row k prefetches the lines at w + k * N + n0 + ahead, into L2 only when to_l2.
template <int MB, int NV>
void nn_block(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t n0, int64_t k0, int64_t k1,
              bool fresh, int64_t ahead, bool to_l2) {
  vec acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = fresh ? vec{} : load(y + m * N + n0 + j * kLanes);
  const float* wp = w + k0 * N + n0;
  for (int64_t k = k0; k < k1; ++k, wp += N) {
    for (int j = 0; j < NV; ++j) {
      if (to_l2) __builtin_prefetch(wp + ahead + j * kLanes, 0, 1);
      else __builtin_prefetch(wp + ahead + j * kLanes);
    }
    vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load(wp + j * kLanes);
    for (int m = 0; m < MB; ++m) {
      const float xs = x[m * K + k];
      for (int j = 0; j < NV; ++j) acc[m][j] += xs * wv[j];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) store(y + m * N + n0 + j * kLanes, acc[m][j]);
}

using NnFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, bool,
                     int64_t, bool);

template <int NV, int... MB>
constexpr std::array<NnFn, sizeof...(MB)> nn_table(std::integer_sequence<int, MB...>) {
  return {&nn_block<MB + 1, NV>...};
}
template <int... NV>
constexpr std::array<std::array<NnFn, kRowBlock>, sizeof...(NV)> nn_tables(std::integer_sequence<int, NV...>) {
  return {nn_table<NV + 1>(std::make_integer_sequence<int, kRowBlock>{})...};
}
const auto kNn = nn_tables(std::make_integer_sequence<int, kStripVectors>{});   // [vectors - 1][rows - 1]

// All M rows of y over the 16-column vectors [v0, v1), summed over w's rows [ka, kb) from zero.
void nn_strips(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int64_t v0, int64_t v1,
               int64_t ka, int64_t kb) {
  if (ka == kb) {                      // an empty half (K = 1): its sum is zero
    for (int64_t m = 0; m < M; ++m)
      for (int64_t v = v0; v < v1; ++v) store(y + m * N + v * kLanes, vec{});
    return;
  }
  const bool chunked = M > kRowBlock;
  const int64_t chunk = chunked ? kChunk : kb - ka;
  for (int64_t v = v0; v < v1; v += kStripVectors) {
    const int nv = static_cast<int>(std::min<int64_t>(kStripVectors, v1 - v));
    for (int64_t k0 = ka; k0 < kb; k0 += chunk) {
      int64_t ahead = kPrefetchRows * N;
      if (chunked)                     // the next chunk of this strip, else the next strip's first (else nothing)
        ahead = k0 + chunk < kb ? chunk * N : (v + kStripVectors < v1 ? kStripVectors * kLanes - (k0 - ka) * N : 0);
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int mb = static_cast<int>(std::min<int64_t>(kRowBlock, M - m0));
        kNn[nv - 1][mb - 1](x + m0 * K, K, w, N, y + m0 * N, v * kLanes, k0, std::min(kb, k0 + chunk), k0 == ka,
                            ahead, chunked);
      }
    }
  }
}

// The same sums row-major, for few rows: w's rows [ka, kb) are read in order, whole (each part streams one
// contiguous block of w, which the hardware prefetchers follow), 4 at a time into every column vector of
// [v0, v1), the partial sums of y staying in cache (M * columns floats). Every element gets exactly nn_strips'
// chain of fused multiply-adds (from zero at ka, k ascending), so the two are interchangeable bit for bit.
// Row-major pays per k-group for the rows' x and per column vector for the partial sums' loads and stores, which
// a wide row (many column vectors per k-group) amortizes. The thresholds below are where it stopped beating the
// strips on this project's 2-core AVX-512 CPU for SmolLM2-135M's shapes (cpu_kernels.bench.bench_small_m_matmul):
// up to kRowMajorRows rows, kRowMajorWideRows when N >= kRowMajorWideN.
constexpr int64_t kRowMajorRows = 2;
constexpr int64_t kRowMajorWideRows = 9;
constexpr int64_t kRowMajorWideN = 1024;
constexpr int64_t kRowMajorFloats = 24576;          // at most this many partial sums per part (96 KiB)
constexpr int64_t kRowMajorAhead = 512;             // floats ahead on each of the 4 rows read

template <int MB>
void nn_rows(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t v0, int64_t v1, int64_t ka,
             int64_t kb) {
  const int64_t c0 = v0 * kLanes, c1 = v1 * kLanes;
  for (int m = 0; m < MB; ++m)
    for (int64_t c = c0; c < c1; c += kLanes) store(y + m * N + c, vec{});
  int64_t k = ka;
  for (; k + 4 <= kb; k += 4) {
    const float* w0 = w + k * N;
    float xs[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < 4; ++r) xs[m][r] = x[m * K + k + r];
    for (int64_t c = c0; c < c1; c += kLanes) {
      vec wv[4];
      for (int r = 0; r < 4; ++r) {
        __builtin_prefetch(w0 + r * N + c + kRowMajorAhead);
        wv[r] = load(w0 + r * N + c);
      }
      for (int m = 0; m < MB; ++m) {
        vec a = load(y + m * N + c);
        for (int r = 0; r < 4; ++r) a += xs[m][r] * wv[r];
        store(y + m * N + c, a);
      }
    }
  }
  for (; k < kb; ++k) {
    const float* wk = w + k * N;
    for (int64_t c = c0; c < c1; c += kLanes) {
      const vec wv = load(wk + c);
      for (int m = 0; m < MB; ++m) {
        vec a = load(y + m * N + c);
        a += x[m * K + k] * wv;
        store(y + m * N + c, a);
      }
    }
  }
}

using NnRowsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);
template <int... MB>
constexpr std::array<NnRowsFn, sizeof...(MB)> nn_rows_table(std::integer_sequence<int, MB...>) {
  return {&nn_rows<MB + 1>...};
}
const auto kNnRows = nn_rows_table(std::make_integer_sequence<int, kRowMajorWideRows>{});   // [rows - 1]

inline float hsum(vec v) {                     // a fixed pairwise order
  float t[kLanes];
  std::memcpy(t, &v, sizeof(t));
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int i = 0; i < s; ++i) t[i] += t[i + s];
  return t[0];
}

// "nt" (w [N, K], e.g. a tied LM head): w row n is output column n, K contiguous. A block is up to 6 rows x 4
// output columns (with AVX-512). A larger M takes the columns in groups of kNtGroup (w's rows for them: 72 KiB at
// K = 576, kept in L2) and runs every row block over a group before the next: w streams from memory once.
// Sequential as they are, w's rows are prefetched kNtPrefetchRows rows ahead: with many rows of x a loop step holds
// more instructions and the out-of-order window alone keeps too few cache misses in flight to stream at bandwidth.
constexpr int kNtColumns = 4;
constexpr int kNtRows = kMaxAccumulators / kNtColumns;
constexpr int64_t kNtGroup = 32;
constexpr int64_t kNtPrefetchRows = 8;

// Dot products waiting for their horizontal sum: 16 at a time are summed together by a shuffle tree whose every
// lane adds in exactly hsum's order (lanes i and i + 8, then i + 4, i + 2, i + 1), the rest one by one by hsum, so a
// result does not depend on which others it was grouped with.
struct PendingSums {
  vec acc[kLanes];
  float* out[kLanes];
  int n = 0;
};

#if SPECJAX_SHUFFLE_SUMS
inline vec sum_pairs(vec a, vec b, int level) {
  switch (level) {
    case 8:
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    case 4:
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    case 2:
      return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    default:
      return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
             __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  }
}

#endif

inline void flush(PendingSums& p) {
#if SPECJAX_SHUFFLE_SUMS
  if (p.n == kLanes) {
    vec v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = p.acc[i];
    int n = kLanes;
    for (int level = kLanes / 2; level >= 1; level /= 2, n /= 2)
      for (int i = 0; i < n / 2; ++i) v[i] = sum_pairs(v[2 * i], v[2 * i + 1], level);
    float r[kLanes];
    std::memcpy(r, &v[0], sizeof(r));
    for (int i = 0; i < kLanes; ++i) *p.out[i] = r[i];
    p.n = 0;
    return;
  }
#endif
  for (int i = 0; i < p.n; ++i) *p.out[i] = hsum(p.acc[i]);
  p.n = 0;
}

template <int MB, int NC>
void nt_block(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t ahead, bool to_l2,
              PendingSums& pending) {
  vec acc[MB][NC];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = vec{};
  for (int64_t k = 0; k < K; k += kLanes) {
    vec wv[NC];
    for (int c = 0; c < NC; ++c) {
      if (to_l2) __builtin_prefetch(w + (n0 + c + ahead) * K + k, 0, 1);
      else __builtin_prefetch(w + (n0 + c + ahead) * K + k);
      wv[c] = load(w + (n0 + c) * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const vec xv = load(x + m * K + k);
      for (int c = 0; c < NC; ++c) acc[m][c] += xv * wv[c];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < NC; ++c) {
      pending.acc[pending.n] = acc[m][c];
      pending.out[pending.n] = y + m * N + n0 + c;
      if (++pending.n == kLanes) flush(pending);
    }
}

// Output columns [n0, n1) of one row block, prefetching w's rows `ahead` rows on (into L2 only when to_l2).
template <int MB, int NC>
void nt_range(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1, int64_t ahead,
              bool to_l2) {
  PendingSums pending;
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) nt_block<MB, NC>(x, K, w, y, N, n, ahead, to_l2, pending);
  for (; n < n1; ++n) nt_block<MB, 1>(x, K, w, y, N, n, ahead, to_l2, pending);
  flush(pending);
}

using NtFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, int64_t, bool);

template <int... MB>
constexpr std::array<NtFn, sizeof...(MB)> nt_table(std::integer_sequence<int, MB...>) {
  return {&nt_range<MB + 1, kNtColumns>...};
}
const auto kNt = nt_table(std::make_integer_sequence<int, kNtRows>{});   // [rows - 1]

// All M rows of y over output columns [n0, n1).
void nt_part(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  const bool grouped = M > kNtRows;
  const int64_t group = grouped ? kNtGroup : n1 - n0;
  for (int64_t g = n0; g < n1; g += group) {
    // grouped: every pass prefetches the next group into L2 (w's rows past n1 only when another part owns them)
    const int64_t ahead = grouped ? (g + group < n1 ? group : 0) : kNtPrefetchRows;
    for (int64_t m0 = 0; m0 < M; m0 += kNtRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kNtRows, M - m0));
      kNt[mb - 1](x + m0 * K, K, w, y + m0 * N, N, g, std::min(n1, g + group), ahead, grouped);
    }
  }
}

// The columns are cut into `parts` contiguous ranges; the calling thread and parts - 1 pool tasks claim them. The
// caller does any range no task has claimed yet, so it never waits on a task that has not started (a pool busy
// with other work cannot deadlock it).
struct Split {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
};

ffi::Error SmallMMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y, bool transposed, int64_t parts) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("small_m_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1];
  const int64_t N = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("small_m_matmul: K mismatch");
  if (K % kLanes != 0 && transposed) return ffi::Error::InvalidArgument("small_m_matmul: nt needs K % 16 == 0");
  if (!transposed && N % kLanes != 0) return ffi::Error::InvalidArgument("small_m_matmul: nn needs N % 16 == 0");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // nt: the output columns cut into `parts` ranges. nn: y = S0 + S1, S0 and S1 w's rows [0, K/2) and [K/2, K)
  // summed from zero (a fixed split, whatever the cores: results do not depend on the machine's thread count), each
  // half's columns cut into ranges; the first half goes to y, the second to a scratch buffer added at the end.
  const int64_t halves = transposed ? 1 : 2;
  const int64_t units = transposed ? N : N / kLanes;
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(transposed ? parts : parts / 2, units));
  thread_local std::vector<float> scratch;
  if (!transposed && scratch.size() < static_cast<size_t>(M * N)) scratch.resize(M * N);
  float* sp = scratch.data();
  const bool row_major = !transposed && M <= (N >= kRowMajorWideN ? kRowMajorWideRows : kRowMajorRows) &&
                         M * (N / ranges) <= kRowMajorFloats;
  auto run = [=](int p) {
    const int64_t h = p / ranges, r = p % ranges;
    const int64_t u0 = units * r / ranges, u1 = units * (r + 1) / ranges;
    if (transposed) return nt_part(xp, M, K, wp, N, yp, u0, u1);
    const int64_t ka = h == 0 ? 0 : K / 2, kb = h == 0 ? K / 2 : K;
    float* out = h == 0 ? yp : sp;
    if (row_major) kNnRows[M - 1](xp, K, wp, N, out, u0, u1, ka, kb);
    else nn_strips(xp, M, K, wp, N, out, u0, u1, ka, kb);
  };
  auto split = std::make_shared<Split>();
  const int total = static_cast<int>(halves * ranges);
  auto claim_all = [=]() {
    for (int p; (p = split->next.fetch_add(1)) < total;) {
      run(p);
      split->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min<int64_t>(total, parts); ++t) pool.Schedule([claim_all] { claim_all(); });
  claim_all();
  while (split->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  if (!transposed)
    for (int64_t i = 0; i < M * N; i += kLanes) store(yp + i, load(yp + i) + load(sp + i));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmul, SmallMMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed")
                                  .Attr<int64_t>("parts"));
