// Small-M matrix multiply for XLA:CPU (an XLA FFI custom call): y[M, N] = x[M, K] @ w, w either [K, N] ("nn") or
// [N, K] ("nt", a tied LM head read as embed.T). Built for the M of a decode step or a verify pass (1-192 rows),
// where XLA:CPU's GEMM backend reads the weights several times over: here every weight element is read from memory
// once per call, by one thread, and used for all M rows from registers or cache.
//
// Every output element is the same sequence of float32 operations whatever M and whatever the thread split (nt: a
// chain of fused multiply-adds over k in 16 lanes, then a fixed pairwise sum; nn: two chains over k, rows [0, K/2)
// and [K/2, K) of w, then their sum): a row is bit-identical whichever rows share its call.
// nn's w may also come rearranged in 16-column panels, each half of its rows one contiguous stream (the same values
// and sums: SmallMMatmulPanels). w may also be llama.cpp's quantized blocks (nn: Q4_1, nt: Q8_0), dequantized in
// registers or cache into exactly the float32 values and summed in the same order: bit-identical to the float32
// product over those values. Or the same blocks times 8-bit activations with integer dot products (llama.cpp's
// arithmetic, a different product; below).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 24 of the 32 vector registers as accumulators with AVX-512, 12 of 16 elsewhere.
#if defined(__AVX512F__)
constexpr int kMaxAccumulators = 24;
#else
constexpr int kMaxAccumulators = 12;
#endif
#if (defined(__AVX512F__) || defined(__AVX2__)) && (defined(__clang__) || __GNUC__ >= 12)
#define SPECJAX_SHUFFLE_SUMS 1                 // kLanes sums at a time by __builtin_shufflevector
#else
#define SPECJAX_SHUFFLE_SUMS 0
#endif
using namespace specjax_cpu;

// A block holds MB rows x NV vectors of accumulators, at most kMaxAccumulators.
// "nn" (w [K, N]), more rows than row-major takes (below): a strip is 4 vectors (64 columns with AVX-512) of up to
// 6 rows. The strip runs over chunks of kChunk rows of w, M cut into row blocks of 6 that take turns over each
// chunk: the chunk is read from memory by the first block and from L1 by the others, the accumulators go through y
// between chunks (float32 stores: nothing is rounded differently).
// w rows are strided by N, so the hardware prefetchers, which stay inside a 4 KiB page, cannot follow them: every
// pass over a chunk prefetches the NEXT chunk (of this strip, or the next strip's first) into L2, not L1 where the
// current chunk is being used, so that memory keeps streaming while a chunk is computed (measured: 1536 x 576 at
// M = 9-16, 1.2-1.4x M = 5's time -> 1.03-1.2x). One row block (M <= 6) gains the same way: prefetching 16 rows
// ahead into L1 instead left 1536 x 576 at M = 3-6 at 1.2-1.45x M = 1's time, chunks at 0.95-1.0x (and 576 x 576
// at 1.05-1.2x against 1.1-1.4x; cpu_kernels.bench.bench_small_m_matmul, both builds alternating).
// Without AVX-512 (16 vector registers of 8 floats: 12 accumulators) a strip of 4 vectors holds 3 rows, and more
// rows took two or more row blocks per chunk, the second reading it from L1: on a 2-core AVX2 CPU (Zen 3) the MLP's
// 1536 x 576 ran 1.5-1.6x M = 1's time at M = 5 with 3 + 2 row blocks, 0.8-1.1x with one strip of 2 vectors x 5
// rows (one 64-byte line of each w row per strip); 1 vector x 12 rows measured the same as 2 x 6 at M = 9.
constexpr int kStripVectors = 4;
constexpr int kRowBlock = kMaxAccumulators / kStripVectors;
constexpr int kTallStripVectors = kMaxAccumulators >= 24 ? kStripVectors : 2;   // more than kRowBlock rows
constexpr int kTallRowBlock = kMaxAccumulators / kTallStripVectors;
constexpr int64_t kChunk = 64;

// Where w [K, N]'s element (k, c) lies: w row-major (panel_stride 16, row_stride N), or in panels of 16 columns
// (PanelMatrix below: each panel's rows consecutive, row_stride 16, panel_stride its rows x 16). A column vector
// never crosses a panel (16 is a multiple of the lanes).
struct NnLayout {
  const float* base;
  int64_t row_stride, panel_stride;
  const float* at(int64_t k, int64_t c) const { return base + c / 16 * panel_stride + k * row_stride + c % 16; }
};

// Rows [0, MB) of y, columns [n0, n0 + NV * kLanes), over k in [k0, k1): from zero when fresh, else from y. The
// step at w row k prefetches the lines `ahead` floats on from those it reads, into L2.
template <int MB, int NV>
void nn_block(const float* x, int64_t K, const NnLayout& w, float* y, int64_t N, int64_t n0, int64_t k0, int64_t k1,
              bool fresh, int64_t ahead) {
  vec acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = fresh ? vec{} : load(y + m * N + n0 + j * kLanes);
  const float* wp = w.at(k0, n0);
  int64_t offset[NV];                  // vector j's columns, from vector 0's
  for (int j = 0; j < NV; ++j) offset[j] = w.at(k0, n0 + j * kLanes) - wp;
  for (int64_t k = k0; k < k1; ++k, wp += w.row_stride) {
    for (int j = 0; j < NV; ++j) {
      __builtin_prefetch(wp + offset[j] + ahead, 0, 1);
    }
    vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load(wp + offset[j]);
    for (int m = 0; m < MB; ++m) {
      const float xs = x[m * K + k];
      for (int j = 0; j < NV; ++j) acc[m][j] = fmadd(splat<vec>(xs), wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) store(y + m * N + n0 + j * kLanes, acc[m][j]);
}

using NnFn = void (*)(const float*, int64_t, const NnLayout&, float*, int64_t, int64_t, int64_t, int64_t, bool,
                     int64_t);

template <int NV, int MB>
constexpr NnFn nn_entry() {
  if constexpr (NV * MB <= kMaxAccumulators) return &nn_block<MB, NV>;
  else return nullptr;
}
template <int NV, int... MB>
constexpr std::array<NnFn, sizeof...(MB)> nn_table(std::integer_sequence<int, MB...>) {
  return {nn_entry<NV, MB + 1>()...};
}
template <int... NV>
constexpr std::array<std::array<NnFn, kTallRowBlock>, sizeof...(NV)> nn_tables(
    std::integer_sequence<int, NV...>) {
  return {nn_table<NV + 1>(std::make_integer_sequence<int, kTallRowBlock>{})...};
}
const auto kNn = nn_tables(std::make_integer_sequence<int, kStripVectors>{});   // [vectors - 1][rows - 1]

// All M rows of y over the column vectors [v0, v1), summed over w's rows [ka, kb) from zero when fresh, else
// continuing y's partial sums.
void nn_strips(const float* x, int64_t M, int64_t K, const NnLayout& w, int64_t N, float* y, int64_t v0, int64_t v1,
               int64_t ka, int64_t kb, bool fresh) {
  if (ka == kb) {                      // an empty half (K = 1): its sum is zero
    if (!fresh) return;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t v = v0; v < v1; ++v) store(y + m * N + v * kLanes, vec{});
    return;
  }
  const int strip = M <= kRowBlock ? kStripVectors : kTallStripVectors;
  const int64_t row_block = kMaxAccumulators / strip;
  for (int64_t v = v0; v < v1; v += strip) {
    const int nv = static_cast<int>(std::min<int64_t>(strip, v1 - v));
    for (int64_t k0 = ka; k0 < kb; k0 += kChunk) {
      // the next chunk of this strip, else the next strip's first (else nothing)
      const float* next = k0 + kChunk < kb ? w.at(k0 + kChunk, v * kLanes)
                          : v + strip < v1 ? w.at(ka, (v + strip) * kLanes) : nullptr;
      const int64_t ahead = next ? next - w.at(k0, v * kLanes) : 0;
      for (int64_t m0 = 0; m0 < M; m0 += row_block) {
        const int mb = static_cast<int>(std::min<int64_t>(row_block, M - m0));
        kNn[nv - 1][mb - 1](x + m0 * K, K, w, y + m0 * N, N, v * kLanes, k0, std::min(kb, k0 + kChunk),
                            fresh && k0 == ka, ahead);
      }
    }
  }
}

// The same sums row-major, for few rows: w's rows [ka, kb) are read in order, whole (each part streams one
// contiguous block of w, which the hardware prefetchers follow), 4 at a time into every column vector of
// [v0, v1), the partial sums of y staying in cache (M * columns floats). Every element gets exactly nn_strips'
// chain of fused multiply-adds (from zero at ka, k ascending), so the two are interchangeable bit for bit.
// Row-major pays per k-group for the rows' x and per column vector for the partial sums' loads and stores (M rows
// of them, in L2 once M * N floats outgrow L1), while the chunked strips keep their sums in registers. Since the
// strips prefetch their next chunk into L2 they beat row-major from 3 rows on at every width on this project's
// 2-core AVX-512 CPU, SmolLM2-135M's widest products included (cpu_kernels.bench.bench_small_m_matmul, the two
// builds alternating; the results page's forward-cost tables); up to kRowMajorRows rows go row-major.
// Without AVX-512 the strips read one line of each w row per strip (above), so where a row of w spans a 4 KiB page
// or more every line a strip reads is on a new page; there row-major took up to kRowMajorRowsWide rows: on the
// 2-core AVX2 CPU 576 x 3072 at M = 3-5 1.8x M = 1's time -> 1.2-1.3x, 576 x 1536 at M = 3-5 1.4-1.9x -> 1.0-1.2x,
// while 576 x 576 and 1536 x 576 were faster in strips (M = 5: 0.09 against 0.10 ms, 0.15 against 0.20).
constexpr int64_t kRowMajorRows = 2;
constexpr int64_t kRowMajorRowsWide = kMaxAccumulators >= 24 ? kRowMajorRows : 6;
constexpr int64_t kWideRowFloats = 1024;            // a w row of 4 KiB
constexpr int64_t kRowMajorFloats = 24576;          // at most this many partial sums per part (96 KiB)
constexpr int64_t kRowMajorAhead = 512;             // floats ahead on each of the 4 rows read

template <int MB>
void nn_rows(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t v0, int64_t v1, int64_t ka,
             int64_t kb, bool fresh) {
  const int64_t c0 = v0 * kLanes, c1 = v1 * kLanes;
  if (fresh)
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
        for (int r = 0; r < 4; ++r) a = fmadd(splat<vec>(xs[m][r]), wv[r], a);
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
        a = fmadd(splat<vec>(x[m * K + k]), wv, a);
        store(y + m * N + c, a);
      }
    }
  }
}

using NnRowsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t,
                         bool);
template <int... MB>
constexpr std::array<NnRowsFn, sizeof...(MB)> nn_rows_table(std::integer_sequence<int, MB...>) {
  return {&nn_rows<MB + 1>...};
}
const auto kNnRows = nn_rows_table(std::make_integer_sequence<int, kRowMajorRowsWide>{});   // [rows - 1]

// "nt" (w [N, K], e.g. a tied LM head): w row n is output column n, K contiguous. A block is up to 6 rows x 4
// output columns (with AVX-512). A larger M takes the columns in groups of kNtGroup (w's rows for them: 72 KiB at
// K = 576, kept in L2) and runs every row block over a group before the next: w streams from memory once.
// Sequential as they are, w's rows are prefetched kNtPrefetchRows rows ahead: with many rows of x a loop step holds
// more instructions and the out-of-order window alone keeps too few cache misses in flight to stream at bandwidth.
constexpr int kNtColumns = 4;
constexpr int kNtRows = kMaxAccumulators / kNtColumns;
// One or two rows of x (a decode step's LM head) take blocks of twice the columns: 8 of w's rows streamed at once
// where 4 left the GEMV ~25% under XLA's matrix-vector path on a 2-core AVX-512 VM (14.8 GB/s on one thread). A
// result is its own FMA chain over k and its fixed horizontal sum whatever the block, so the bits do not change.
// Without AVX-512 only one row fits 8 columns of accumulators (M = 1 ~4.2 -> 3.4-4.0 ms on a 2-core AVX2 CPU, XLA's
// matrix-vector path 3.3-3.9 ms in the same runs).
constexpr int kNtWideColumns = 8;
constexpr int kNtWideRows = kMaxAccumulators >= 24 ? 2 : 1;
constexpr int64_t kNtGroup = 32;
constexpr int64_t kNtPrefetchRows = 8;
// 7-12 rows (a verify pass of 6-11 drafts) take one block of all the rows x 2 columns: w streams from memory once,
// its rows prefetched as the 1-6 row blocks' are. The groups (two row blocks per group, the second reading w from
// L2) were a quarter slower on a tied LM head at 7-12 rows (cpu_kernels.bench.bench_small_m_matmul, the two builds
// alternating; the results page's forward-cost tables). More rows than that take the groups, and so do Q8_0 blocks:
// their pass is bound by the dequantization, not the stream, and measured the same either way. Without AVX-512 a
// tall block is all the rows x as many columns as 12 accumulators allow (4-6 rows x 2, 7-12 rows x 1): on a 2-core
// AVX2 CPU the head at M = 5 went 1.46x -> 1.04-1.1x M = 1's time, M = 9 2.3x -> 1.3x (3-row blocks over groups).
constexpr int kNtTallRows = 12;
constexpr int nt_tall_columns(int rows) { return kMaxAccumulators >= 24 ? 2 : std::max(1, kMaxAccumulators / rows); }

// Dot products waiting for their horizontal sum: kLanes at a time are summed together by a shuffle tree whose every
// lane adds in exactly hsum's order (lanes i and i + 8 with AVX-512, then i + 4, i + 2, i + 1), the rest one by one
// by hsum, so a result does not depend on which others it was grouped with.
struct PendingSums {
  vec acc[kLanes];
  float* out[kLanes];
  int n = 0;
};

#if SPECJAX_SHUFFLE_SUMS && !defined(__AVX512F__)
inline vec sum_pairs(vec a, vec b, int level) {     // 8 lanes
  switch (level) {
    case 4:
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    case 2:
      return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
             __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    default:
      return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
             __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  }
}
#elif SPECJAX_SHUFFLE_SUMS
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

// w [N, K]'s rows as nt reads them: float32, or Q8_0 blocks (below). load(n, k): the 16 (kLanes) values of row n
// from column k; prefetch(n, k): the line holding them.
struct F32Rows {
  const float* w;
  int64_t K;
  vec load(int64_t n, int64_t k) const { return ::load(w + n * K + k); }
  void prefetch(int64_t n, int64_t k, bool to_l2) const {
    if (to_l2) __builtin_prefetch(w + n * K + k, 0, 1);
    else __builtin_prefetch(w + n * K + k);
  }
};

// llama.cpp's Q8_0 (a tied embedding's usual type): w[n, k] = scale[n, k / 32] * q[n, k], q int8. scale * q is
// exact in float32, so a loaded vector is bit for bit the float32 dequantization's, and the sums are the float32
// path's; memory delivers 1.125 bytes per weight instead of 4.
struct Q8Rows {
  const int8_t* q;
  const float* scale;
  int64_t K;
  vec load(int64_t n, int64_t k) const {
    const int8_t* p = q + n * K + k;
#if defined(__AVX512F__)
    const vec v = (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    vec v;
    for (int i = 0; i < kLanes; ++i) v[i] = p[i];
#endif
    return v * scale[n * (K / 32) + k / 32];
  }
  void prefetch(int64_t n, int64_t k, bool to_l2) const {
    if (k % 64) return;                        // one line holds 64 of a row's values
    if (to_l2) __builtin_prefetch(q + n * K + k, 0, 1);
    else __builtin_prefetch(q + n * K + k);
  }
};

template <int MB, int NC, class Rows>
void nt_block(const float* x, int64_t K, const Rows& w, float* y, int64_t N, int64_t n0, int64_t ahead, bool to_l2,
              PendingSums& pending) {
  vec acc[MB][NC];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = vec{};
  for (int64_t k = 0; k < K; k += kLanes) {
    vec wv[NC];
    for (int c = 0; c < NC; ++c) {
      if constexpr (std::is_same_v<Rows, F32Rows> && kNtWideRows > 0 && NC == kNtWideColumns) {
        // The 1-2 row blocks prefetch the block `ahead` rows on in its memory order (one line per load, rows
        // contiguous: one stream) rather than each of its rows at the loads' offset (NC streams), which kept a
        // decode step's LM head about a fifth under the stream rate; the wider blocks gained nothing by it. (These
        // blocks never run grouped, so never prefetch into L2.)
        __builtin_prefetch(w.w + (n0 + ahead) * K + (k / kLanes * NC + c) * kLanes);
      } else {
        w.prefetch(n0 + c + ahead, k, to_l2);
      }
      wv[c] = w.load(n0 + c, k);
    }
    for (int m = 0; m < MB; ++m) {
      const vec xv = load(x + m * K + k);
      for (int c = 0; c < NC; ++c) acc[m][c] = fmadd(xv, wv[c], acc[m][c]);
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
template <int MB, int NC, class Rows>
void nt_range(const float* x, int64_t K, const Rows& w, float* y, int64_t N, int64_t n0, int64_t n1, int64_t ahead,
              bool to_l2) {
  PendingSums pending;
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) nt_block<MB, NC>(x, K, w, y, N, n, ahead, to_l2, pending);
  for (; n < n1; ++n) nt_block<MB, 1>(x, K, w, y, N, n, ahead, to_l2, pending);
  flush(pending);
}

template <class Rows>
using NtFn = void (*)(const float*, int64_t, const Rows&, float*, int64_t, int64_t, int64_t, int64_t, bool);

template <class Rows, int... MB>
constexpr std::array<NtFn<Rows>, sizeof...(MB)> nt_table(std::integer_sequence<int, MB...>) {
  return {&nt_range<MB + 1, kNtColumns, Rows>...};
}
template <class Rows>
const auto kNt = nt_table<Rows>(std::make_integer_sequence<int, kNtRows>{});   // [rows - 1]

template <class Rows, int... MB>
constexpr std::array<NtFn<Rows>, sizeof...(MB)> nt_wide_table(std::integer_sequence<int, MB...>) {
  return {&nt_range<MB + 1, kNtWideColumns, Rows>...};
}
template <class Rows>
const auto kNtWide = nt_wide_table<Rows>(std::make_integer_sequence<int, kNtWideRows>{});   // [rows - 1]

template <class Rows, int... MB>
constexpr std::array<NtFn<Rows>, sizeof...(MB)> nt_tall_table(std::integer_sequence<int, MB...>) {
  return {&nt_range<kNtRows + MB + 1, nt_tall_columns(kNtRows + MB + 1), Rows>...};
}
template <class Rows>
const auto kNtTall =
    nt_tall_table<Rows>(std::make_integer_sequence<int, std::max(0, kNtTallRows - kNtRows)>{});  // [rows - kNtRows - 1]

// All M rows of y over output columns [n0, n1).
template <class Rows>
void nt_part(const float* x, int64_t M, int64_t K, const Rows& w, int64_t N, float* y, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<Rows, F32Rows>) {
    if (M > kNtRows && M <= kNtTallRows) {
      kNtTall<Rows>[M - kNtRows - 1](x, K, w, y, N, n0, n1, kNtPrefetchRows, false);
      return;
    }
  }
  const bool grouped = M > kNtRows;
  const int64_t group = grouped ? kNtGroup : n1 - n0;
  for (int64_t g = n0; g < n1; g += group) {
    // grouped: every pass prefetches the next group into L2 (w's rows past n1 only when another part owns them)
    const int64_t ahead = grouped ? (g + group < n1 ? group : 0) : kNtPrefetchRows;
    for (int64_t m0 = 0; m0 < M; m0 += kNtRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kNtRows, M - m0));
      const NtFn<Rows> block = M <= kNtWideRows ? kNtWide<Rows>[mb - 1] : kNt<Rows>[mb - 1];
      block(x + m0 * K, K, w, y + m0 * N, N, g, std::min(n1, g + group), ahead, grouped);
    }
  }
}

// nn: y = S0 + S1, S0 and S1 w's rows [0, K/2) and [K/2, K) summed from zero (a fixed split, whatever the cores:
// results do not depend on the machine's thread count), each half's columns cut into `ranges` ranges of `granule`
// columns; the first half goes to y, the second to a per-caller scratch buffer added at the end.
// part(out, ka, kb, c0, c1, row_major) computes one half's sums over columns [c0, c1).
template <class Part>
void nn_halves(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t N, float* y, int64_t parts, int64_t granule,
               Part part) {
  const int64_t units = N / granule;
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(parts / 2, units));
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(M * N)) scratch.resize(M * N);
  float* sp = scratch.data();
  const bool row_major = M <= (N >= kWideRowFloats ? kRowMajorRowsWide : kRowMajorRows) &&
                         M * (N / ranges) <= kRowMajorFloats;
  run_parts(pool, parts, static_cast<int>(2 * ranges), [=](int p) {
    const int64_t h = p / ranges, r = p % ranges;
    const int64_t c0 = units * r / ranges * granule, c1 = units * (r + 1) / ranges * granule;
    part(h == 0 ? y : sp, h == 0 ? 0 : K / 2, h == 0 ? K / 2 : K, c0, c1, row_major);
  });
  for (int64_t i = 0; i < M * N; i += kLanes) store(y + i, load(y + i) + load(sp + i));
}

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
  if (transposed) {                    // nt: the output columns cut into `parts` ranges
    const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(parts, N));
    const F32Rows rows{wp, K};
    run_parts(pool, parts, static_cast<int>(ranges),
              [=](int r) { nt_part(xp, M, K, rows, N, yp, N * r / ranges, N * (r + 1) / ranges); });
    return ffi::Error::Success();
  }
  nn_halves(pool, M, K, N, yp, parts, kLanes,
            [=](float* out, int64_t ka, int64_t kb, int64_t c0, int64_t c1, bool row_major) {
              if (row_major) kNnRows[M - 1](xp, K, wp, N, out, c0 / kLanes, c1 / kLanes, ka, kb, true);
              else nn_strips(xp, M, K, NnLayout{wp, N, 16}, N, out, c0 / kLanes, c1 / kLanes, ka, kb, true);
            });
  return ffi::Error::Success();
}

// w [K, N] in panels (PanelMatrix): panels [2, N / 16, K / 2, 16], half h holding w's rows [h K / 2, (h + 1) K / 2)
// by 16-column panels, each panel's rows consecutive. The same values summed in the same order as SmallMMatmul's
// (the strips' chains over the two halves, then their sum): bit-identical to it over the row-major w. Row-major
// w [K, N] puts a strip's consecutive rows N floats apart, a new 4 KiB page every row or few, which the hardware
// prefetchers do not follow; in panels a core's half is one contiguous stream whatever the strip or row count.
ffi::Error SmallMMatmulPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                              ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions(), pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 4 || pd[0] != 2 || pd[3] != 16)
    return ffi::Error::InvalidArgument("small_m_matmul_panels: x must be [M, K], panels [2, N / 16, K / 2, 16]");
  const int64_t M = xd[0], K = xd[1], N = pd[1] * 16, half = pd[2];
  if (K != 2 * half) return ffi::Error::InvalidArgument("small_m_matmul_panels: K mismatch");
  const float* xp = x.typed_data();
  const float* wp = panels.typed_data();
  nn_halves(pool, M, K, N, y->typed_data(), parts, 16,
            [=](float* out, int64_t ka, int64_t kb, int64_t c0, int64_t c1, bool) {
              const NnLayout w{wp + (ka == 0 ? 0 : N * half) - ka * 16, 16, half * 16};
              nn_strips(xp, M, K, w, N, out, c0 / kLanes, c1 / kLanes, ka, kb, true);
            });
  return ffi::Error::Success();
}

// w [K, N] as llama.cpp's Q4_1 blocks, 32 consecutive k of one column each: w[k, n] = scale[k / 32, n] * q[k, n]
// + minimum[k / 32, n], q in 0..15 (scale and minimum: the blocks' float16 values, widened). nibbles [K, N / 2]:
// byte (k, 16 g + j) holds q[k, 32 g + j] in its low four bits and q[k, 32 g + 16 + j] in its high four.
// scale * q is exact in float32 (an 11-bit significand times 4 bits), so a dequantized value is the very one a
// float32 dequantization stores (gguf's d * q + m), and summed by the float32 path's chains y is bit-identical to
// small_m_matmul on them, while memory delivers 0.75 bytes per weight instead of 4. Up to kQ41RowMajorRows rows
// (with AVX-512) dequantize in registers (nn_rows_q41); more rows dequantize a few rows of w at a time into a
// per-thread buffer in cache and run the float32 strips over it.
constexpr int64_t kQ41Block = 32;
constexpr int64_t kDequantRowsRowMajor = 8;       // (without AVX-512) the buffer: 8 rows x N floats
constexpr int64_t kDequantRowsStrips = 32;        // the strips reload their sums per chunk: a longer one
// Up to kQ41RowMajorRows rows go row-major with the dequantization in registers, over column tiles whose partial
// sums (M x tile floats) stay in L1 (the float32 path's strips lost to it at every width for these rows).
constexpr int64_t kQ41RowMajorRows = 9;
constexpr int64_t kQ41TileFloats = 8192;

typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));

inline f32x16 load16(const float* p) { return *reinterpret_cast<const f32x16_u*>(p); }
inline void store16(float* p, f32x16 v) { *reinterpret_cast<f32x16_u*>(p) = v; }

// 16 bytes widened to 16 int32 (one instruction with AVX-512; GCC's generic conversion goes byte by byte).
inline i32x16 widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  i32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = p[i];
  return v;
#endif
}

// w's rows [k0, k1), columns [c0, c1) (multiples of 32) -> buf (row k at buf + (k - k0) * N).
void dequantize_q41(const uint8_t* nibbles, const float* scale, const float* minimum, int64_t N, float* buf,
                    int64_t k0, int64_t k1, int64_t c0, int64_t c1) {
  for (int64_t k = k0; k < k1; ++k) {
    const uint8_t* q = nibbles + k * (N / 2);
    const float* d = scale + (k / kQ41Block) * N;
    const float* m = minimum + (k / kQ41Block) * N;
    float* out = buf + (k - k0) * N;
    __builtin_prefetch(q + 4 * (N / 2) + c0 / 2);
    for (int64_t c = c0; c < c1; c += 32) {
      const i32x16 v = widen(q + c / 2);
      const f32x16 lo = __builtin_convertvector(v & 15, f32x16), hi = __builtin_convertvector(v >> 4, f32x16);
      store16(out + c, load16(d + c) * lo + load16(m + c));
      store16(out + c + 16, load16(d + c + 16) * hi + load16(m + c + 16));
    }
  }
}

#if defined(__AVX512F__)
// Row-major over Q4_1 blocks with the dequantization in registers (no buffer): nn_rows' loop, the four w rows of a
// k-group dequantized 32 columns at a time (one 16-byte load per row: the low nibbles are columns c..c+15, the high
// ones c+16..c+31), then exactly nn_rows' chain per column vector. Needs 16-float vectors (AVX-512) and k-groups
// inside one block: ka, kb multiples of 4.
// y: the sums of columns [c0, c1), row m at y + m * ys - c0 (a tile of its own, see the caller).
template <int MB>
void nn_rows_q41(const float* x, int64_t K, const uint8_t* nibbles, const float* scale, const float* minimum,
                 int64_t N, float* y, int64_t ys, int64_t c0, int64_t c1, int64_t ka, int64_t kb) {
  y -= c0;
  for (int m = 0; m < MB; ++m)
    for (int64_t c = c0; c < c1; c += kLanes) store(y + m * ys + c, vec{});
  const int64_t row_bytes = N / 2;
  for (int64_t k = ka; k < kb; k += 4) {
    const uint8_t* q0 = nibbles + k * row_bytes;
    const float* d = scale + (k / kQ41Block) * N;
    const float* mn = minimum + (k / kQ41Block) * N;
    float xs[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < 4; ++r) xs[m][r] = x[m * K + k + r];
    for (int64_t c = c0; c < c1; c += 32) {
      const vec d0 = load(d + c), d1 = load(d + c + 16), m0 = load(mn + c), m1 = load(mn + c + 16);
      vec lo[4], hi[4];
      for (int r = 0; r < 4; ++r) {
        __builtin_prefetch(q0 + (r + 8) * row_bytes + c / 2);
        const i32x16 v = widen(q0 + r * row_bytes + c / 2);
        lo[r] = d0 * __builtin_convertvector(v & 15, vec) + m0;
        hi[r] = d1 * __builtin_convertvector(v >> 4, vec) + m1;
      }
      for (int m = 0; m < MB; ++m) {
        vec a = load(y + m * ys + c), b = load(y + m * ys + c + 16);
        for (int r = 0; r < 4; ++r) a = fmadd(splat<vec>(xs[m][r]), lo[r], a);
        for (int r = 0; r < 4; ++r) b = fmadd(splat<vec>(xs[m][r]), hi[r], b);
        store(y + m * ys + c, a);
        store(y + m * ys + c + 16, b);
      }
    }
  }
}

using NnRowsQ41Fn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, float*,
                            int64_t, int64_t, int64_t, int64_t, int64_t);
template <int... MB>
constexpr std::array<NnRowsQ41Fn, sizeof...(MB)> nn_rows_q41_table(std::integer_sequence<int, MB...>) {
  return {&nn_rows_q41<MB + 1>...};
}
const auto kNnRowsQ41 = nn_rows_q41_table(std::make_integer_sequence<int, kQ41RowMajorRows>{});   // [rows - 1]
#endif

ffi::Error SmallMMatmulQ41(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> nibbles,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> minimum,
                           ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions(), qd = nibbles.dimensions(), sd = scale.dimensions(), md = minimum.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || md.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul_q4_1: every operand must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = qd[1] * 2;
  if (qd[0] != K || K % kQ41Block != 0 || N % 32 != 0 || sd[0] != K / kQ41Block || sd[1] != N || md[0] != sd[0] ||
      md[1] != N)
    return ffi::Error::InvalidArgument("small_m_matmul_q4_1: shapes do not form Q4_1 blocks of x's K");
  const float* xp = x.typed_data();
  const uint8_t* qp = nibbles.typed_data();
  const float* dp = scale.typed_data();
  const float* mp = minimum.typed_data();
  nn_halves(pool, M, K, N, y->typed_data(), parts, 32,
            [=](float* out, int64_t ka, int64_t kb, int64_t c0, int64_t c1, bool row_major) {
#if defined(__AVX512F__)
              if (M <= kQ41RowMajorRows && ka % 4 == 0 && kb % 4 == 0) {
                // The tile's rows 16 floats apart beyond its width: rows of y itself are N floats apart, often
                // a multiple of 4 KiB, where loads and stores of different rows alias in L1.
                const int64_t tile = std::max<int64_t>(32, kQ41TileFloats / M / 32 * 32), ys = tile + kLanes;
                thread_local std::vector<float> sums;
                if (sums.size() < static_cast<size_t>(M * ys)) sums.resize(M * ys);
                for (int64_t t = c0; t < c1; t += tile) {
                  const int64_t t1 = std::min(c1, t + tile);
                  kNnRowsQ41[M - 1](xp, K, qp, dp, mp, N, sums.data(), ys, t, t1, ka, kb);
                  for (int64_t m = 0; m < M; ++m)
                    std::memcpy(out + m * N + t, sums.data() + m * ys, (t1 - t) * sizeof(float));
                }
                return;
              }
#endif
              const int64_t rows = row_major ? kDequantRowsRowMajor : kDequantRowsStrips;
              thread_local std::vector<float> buffer;
              if (buffer.size() < static_cast<size_t>(rows * N)) buffer.resize(rows * N);
              float* buf = buffer.data();
              for (int64_t k0 = ka; k0 < kb; k0 += rows) {
                const int64_t k1 = std::min(kb, k0 + rows);
                dequantize_q41(qp, dp, mp, N, buf, k0, k1, c0, c1);
                if (row_major) kNnRows[M - 1](xp + k0, K, buf, N, out, c0 / kLanes, c1 / kLanes, 0, k1 - k0, k0 == ka);
                else nn_strips(xp + k0, M, K, NnLayout{buf, N, 16}, N, out, c0 / kLanes, c1 / kLanes, 0, k1 - k0,
                               k0 == ka);
              }
            });
  return ffi::Error::Success();
}

// Q4_1 weights times 8-bit activations: llama.cpp's own arithmetic for Q4_1 (its vec_dot_q4_1_q8_1), not the float32
// product above. Each row of x is quantized per block of 32 k (d = max |x| / 127, q = x / d rounded half to even,
// s = d * sum q), and y[m, n] = sum over blocks b, ascending, of (scale[b, n] * d[m, b]) * I[m, b, n] + minimum[b, n]
// * s[m, b], with I the block's exact integer dot product of w's quants with x's. The integer part needs no
// dequantization and a quarter of the float32 path's instructions per weight and row (VNNI: one per 64 products;
// the block's float terms add half as many again), so at 5-9 rows it takes about half the float32 sums' time. Every
// row is computed alone (integer sums are exact, the float chain is fixed): bit-identical whatever M and split.
// w packed by 16-column panels: packed [N / 16, K / 8, 64]; byte 4 n + j of octet o of panel p holds
// q[8 o + j, 16 p + n] in its low four bits and q[8 o + 4 + j, 16 p + n] in its high four: a 64-byte load is the
// panel's 8 k, and its low and high nibbles are each 16 lanes of 4 consecutive k, what one dot product takes.
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16_u __attribute__((vector_size(64), aligned(1)));
constexpr int kInt8RowBlock = 9;                  // rows whose sums stay in registers together

// acc + the 16 lanes' dot products of 4 unsigned bytes of w with the 4 signed bytes of x4 (VNNI's vpdpbusd).
inline i32x16 dot4(i32x16 acc, u32x16 w, int32_t x4) {
#if defined(__AVX512VNNI__)
  return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#else
  for (int j = 0; j < 4; ++j)
    acc += (i32x16)((w >> (8 * j)) & 0xFF) * static_cast<int32_t>(static_cast<int8_t>(x4 >> (8 * j)));
  return acc;
#endif
}

// w's 16-column panels as the int8 blocks read them: per block b of 32 k and octet o of it, two vectors of 16
// lanes x 4 unsigned bytes (k = 8 o .. 8 o + 3 and 8 o + 4 .. 8 o + 7 of the block), and the block's float terms.
// Q4_1 (nn): the nibbles above; y += (scale * d) * I + minimum * s.
struct Q41Panels {
  const uint8_t* packed;
  const float* scale;
  const float* minimum;
  int64_t K, N;
  struct Terms { f32x16 d, m; };
  void octet(int64_t p, int64_t b, int o, u32x16& a, u32x16& c) const {
    const u32x16 w = *reinterpret_cast<const u32x16_u*>(packed + (p * (K / 8) + b * 4 + o) * 64);
    a = w & 0x0F0F0F0F;
    c = (w >> 4) & 0x0F0F0F0F;
  }
  Terms terms(int64_t p, int64_t b) const { return {load16(scale + b * N + p * 16), load16(minimum + b * N + p * 16)}; }
  static f32x16 add(f32x16 acc, const Terms& t, i32x16 dots, float d, int32_t sum) {
    acc = fmadd(t.d * d, __builtin_convertvector(dots, f32x16), acc);
    return fmadd(t.m, splat<f32x16>(d * static_cast<float>(sum)), acc);      // s = d * sum q
  }
};

// Q8_0 (nt, a tied LM head w [N, K]: panel p is w's rows 16 p .. 16 p + 15): packed [N / 16, K / 4, 64], byte 4 n + j
// of quad r = w[16 p + n, 4 r + j] + 128 (unsigned, as the dot product takes it; the 128 * sum q it adds is taken
// off exactly); y += (scale * d) * (I - 128 * sum q).
struct Q80Panels {
  const uint8_t* packed;
  const float* scale;                              // [K / 32, N]
  int64_t K, N;
  struct Terms { f32x16 d; };
  void octet(int64_t p, int64_t b, int o, u32x16& a, u32x16& c) const {
    const uint8_t* q = packed + (p * (K / 4) + b * 8 + 2 * o) * 64;
    a = *reinterpret_cast<const u32x16_u*>(q);
    c = *reinterpret_cast<const u32x16_u*>(q + 64);
  }
  Terms terms(int64_t p, int64_t b) const { return {load16(scale + b * N + p * 16)}; }
  static f32x16 add(f32x16 acc, const Terms& t, i32x16 dots, float d, int32_t sum) {
    return fmadd(t.d * d, __builtin_convertvector(dots - 128 * sum, f32x16), acc);
  }
};

// x's rows as 8-bit blocks (quantize_rows_q8): q [M, K], d and the integer sums [M, K / 32].
struct Q8Rows8 {
  const int8_t* q;
  const float* d;
  const int32_t* sum;
};

// Rows [0, MB) of y over panel p.
template <int MB, class W>
void int8_block(const Q8Rows8& x, int64_t K, const W& w, int64_t N, float* y, int64_t p) {
  const int64_t blocks = K / kQ41Block;
  f32x16 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = f32x16{};
  for (int64_t b = 0; b < blocks; ++b) {
    i32x16 sums[MB];
    for (int m = 0; m < MB; ++m) sums[m] = i32x16{};
    for (int o = 0; o < 4; ++o) {
      u32x16 lo, hi;
      w.octet(p, b, o, lo, hi);
      for (int m = 0; m < MB; ++m) {
        int32_t x0, x1;
        std::memcpy(&x0, x.q + m * K + b * kQ41Block + o * 8, 4);
        std::memcpy(&x1, x.q + m * K + b * kQ41Block + o * 8 + 4, 4);
        sums[m] = dot4(dot4(sums[m], lo, x0), hi, x1);
      }
    }
    const typename W::Terms t = w.terms(p, b);
    for (int m = 0; m < MB; ++m)
      acc[m] = W::add(acc[m], t, sums[m], x.d[m * blocks + b], x.sum[m * blocks + b]);
  }
  for (int m = 0; m < MB; ++m) store16(y + m * N + p * 16, acc[m]);
}

template <class W>
using Int8Fn = void (*)(const Q8Rows8&, int64_t, const W&, int64_t, float*, int64_t);
template <class W, int... MB>
constexpr std::array<Int8Fn<W>, sizeof...(MB)> int8_table(std::integer_sequence<int, MB...>) {
  return {&int8_block<MB + 1, W>...};
}
template <class W>
const auto kInt8 = int8_table<W>(std::make_integer_sequence<int, kInt8RowBlock>{});   // [rows - 1]

// x's rows as 8-bit blocks: q [M, K], d and sum q [M, K / 32] (see above). Ties round to even (nearbyint in the
// default rounding mode), as jnp.round does.
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t i = 0; i < M * (K / kQ41Block); ++i) {
    const float* xb = x + i * kQ41Block;
    float amax = 0.f;
    for (int j = 0; j < kQ41Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kQ41Block; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inverse));
      q[i * kQ41Block + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[i] = scale;
    sums[i] = sum;
  }
}

// y [M, N] = x [M, K] times w's panels: x's rows quantized once by the caller, the panels cut into `parts` ranges;
// each range runs every row block over a stretch of panels small enough to stay in L1 for the next row block.
template <class W>
void int8_product(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const W& w, int64_t N, float* y,
                  int64_t parts, int64_t panel_bytes) {
  const int64_t blocks = K / kQ41Block;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int32_t> xsum;
  if (xq.size() < static_cast<size_t>(M * K)) xq.resize(M * K);
  if (xd.size() < static_cast<size_t>(M * blocks)) xd.resize(M * blocks);
  if (xsum.size() < static_cast<size_t>(M * blocks)) xsum.resize(M * blocks);
  quantize_rows_q8(x, M, K, xq.data(), xd.data(), xsum.data());
  const Q8Rows8 rows{xq.data(), xd.data(), xsum.data()};
  const int64_t panels = N / 16, ranges = std::max<int64_t>(1, std::min<int64_t>(parts, panels));
  const int64_t stretch = std::max<int64_t>(1, 16384 / panel_bytes);
  run_parts(pool, parts, static_cast<int>(ranges), [=, &w](int r) {
    const int64_t p0 = panels * r / ranges, p1 = panels * (r + 1) / ranges;
    for (int64_t s0 = p0; s0 < p1; s0 += stretch)
      for (int64_t m0 = 0; m0 < M; m0 += kInt8RowBlock) {
        const int mb = static_cast<int>(std::min<int64_t>(kInt8RowBlock, M - m0));
        const Q8Rows8 block{rows.q + m0 * K, rows.d + m0 * blocks, rows.sum + m0 * blocks};
        for (int64_t p = s0; p < std::min(p1, s0 + stretch); ++p) kInt8<W>[mb - 1](block, K, w, N, y + m0 * N, p);
      }
  });
}

ffi::Error SmallMMatmulQ41Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                               ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> minimum,
                               ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions(), md = minimum.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || sd.size() != 2 || md.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul_q4_1_int8: x, scale, minimum 2-D and packed 3-D");
  const int64_t M = xd[0], K = xd[1], N = pd[0] * 16;
  if (pd[1] != K / 8 || pd[2] != 64 || K % kQ41Block != 0 || sd[0] != K / kQ41Block || sd[1] != N ||
      md[0] != sd[0] || md[1] != N)
    return ffi::Error::InvalidArgument("small_m_matmul_q4_1_int8: shapes do not form packed Q4_1 blocks of x's K");
  const Q41Panels w{packed.typed_data(), scale.typed_data(), minimum.typed_data(), K, N};
  int8_product(pool, x.typed_data(), M, K, w, N, y->typed_data(), parts, K * 8);
  return ffi::Error::Success();
}

ffi::Error SmallMMatmulQ80Int8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                               ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || sd.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul_q8_0_int8: x and scale 2-D, packed 3-D");
  const int64_t M = xd[0], K = xd[1], N = pd[0] * 16;
  if (pd[1] != K / 4 || pd[2] != 64 || K % kQ41Block != 0 || sd[0] != K / kQ41Block || sd[1] != N)
    return ffi::Error::InvalidArgument("small_m_matmul_q8_0_int8: shapes do not form packed Q8_0 blocks of x's K");
  const Q80Panels w{packed.typed_data(), scale.typed_data(), K, N};
  int8_product(pool, x.typed_data(), M, K, w, N, y->typed_data(), parts, K * 16);
  return ffi::Error::Success();
}

// nt over Q8_0 rows: y [M, N] = x [M, K] @ w.T, w [N, K] = scale [N, K / 32] * q [N, K] (int8).
ffi::Error SmallMMatmulQ80(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int64_t parts) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("small_m_matmul_q8_0: every operand must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = qd[0];
  if (qd[1] != K || K % 32 != 0 || sd[0] != N || sd[1] != K / 32)
    return ffi::Error::InvalidArgument("small_m_matmul_q8_0: shapes do not form Q8_0 blocks of x's K");
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const Q8Rows rows{q.typed_data(), scale.typed_data(), K};
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(parts, N));
  run_parts(pool, parts, static_cast<int>(ranges),
            [=](int r) { nt_part(xp, M, K, rows, N, yp, N * r / ranges, N * (r + 1) / ranges); });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmulPanels, SmallMMatmulPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmulQ41, SmallMMatmulQ41,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmulQ80, SmallMMatmulQ80,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmulQ41Int8, SmallMMatmulQ41Int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMMatmulQ80Int8, SmallMMatmulQ80Int8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("parts"));
