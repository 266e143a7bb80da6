// Verify attention for XLA:CPU (an XLA FFI custom call), float32, over a CPU KVCache (keys stored slots-last):
// the T new query positions of each row attend to the committed prefix and to the new columns their mask allows
// (a chain: causal; a tree: the node's ancestors), as pallas_kernels.verify_attention.reference defines it.
//
// Why a kernel: a query row here is the same sequence of float32 operations whatever T, the batch, the tree mask and
// the rows that share the call. XLA's dots and reductions sum in an order that follows the shapes, so a T = k + 1
// verify pass and k + 1 one-position steps disagreed in the last bits, and greedy speculation was exact only by a
// float32 margin. A row reads its columns in one sequence: the committed prefix ascending, then its visible new
// columns ascending. After a step commits an accepted path its entries sit contiguous in that same order, so the next
// pass, or a plain decode step, reads the same keys in the same sequence.
//   score of a column: fused multiply-adds over d = 0 .. D-1 from zero (one lane per column; any lane alike)
//   m = the largest score (exact in any order); p = exp(score - m) by one vector polynomial
//   l = sum of p: lane (i mod lanes) of the sequence's i-th column, then a fixed pairwise sum of the lanes
//   o = fused multiply-adds p * v over the sequence (one lane per d), divided by l
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

// 0, 1, .., kLanes - 1
const vec kLaneIndex = [] {
  vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(i);
  return v;
}();

// A work unit is up to kRows query rows of one (batch row, kv head): their scores share each load of keys (kRows x 2
// accumulators) and their outputs each load of values. A row's operations do not depend on which unit or thread
// computes it. With AVX-512 a unit of 12 rows (24 accumulators) scores a share of a 9-position pass (SmolLM2: ~10 rows)
// in one pass over the keys where units of 8 took two (-7% attention in a SmolLM2 forward at T = 9), and a kv head
// of a 4-position pass at batch 8 (12 rows) in one where 8 took two. The work is cut into shares of about
// kShareRows rows (below).
constexpr int kRows = kLanes == 16 ? 12 : 6;
constexpr int kShareRows = kLanes == 16 ? 8 : 6;
// The values are weighed for up to kWeighRows rows at a time, kChunkVectors output vectors (d) per pass: kWeighRows x 4
// accumulators of 32 registers with AVX-512, kWeighRows x 2 of 16 elsewhere; a unit of more rows is weighed in two
// even parts, the second reading the values from this core's cache.
constexpr int kWeighRows = 6;
constexpr int kChunkVectors = kLanes == 16 ? 4 : 2;

struct Problem {
  const float* q;                // [B, T, Hq, D]
  const float* k;                // [B, Hkv, D, S]
  const float* v;                // [B, Hkv, S, D]
  const int32_t* lengths;        // [B]
  const uint8_t* mask;           // [1 | B, T, T]
  const int32_t* q_positions;    // [B, T]
  float* out;                    // [B, T, Hq, D]
  float scale;
  int64_t window, B, T, Hq, Hkv, D, S, mask_rows;
};

// sc[r * S + c] = sum over d of q[r][d] k[d][c], columns [c0, c1): a chain of fused multiply-adds over d from zero,
// the same for a column in a two-vector step, a one-vector step or the last, masked one (or the scalar tail).
template <int RB>
void score_rows(const float* q, int64_t D, const float* k, int64_t S, int64_t c0, int64_t c1, float* sc) {
  int64_t c = c0;
  for (; c + 2 * kLanes <= c1; c += 2 * kLanes) {
    vec a[RB] = {}, b[RB] = {};
    for (int64_t d = 0; d < D; ++d) {
      // the lines two column pairs on, into L2: the keys' rows are S floats apart, 64 streams the hardware does not
      // follow (one pair on, into L1, was ~7% slower in a SmolLM2 forward)
      __builtin_prefetch(k + d * S + c + 4 * kLanes, 0, 1);
      __builtin_prefetch(k + d * S + c + 5 * kLanes, 0, 1);
      const vec k0 = load(k + d * S + c), k1 = load(k + d * S + c + kLanes);
      for (int r = 0; r < RB; ++r) {
        const vec qd = splat<vec>(q[r * D + d]);
        a[r] = fmadd(qd, k0, a[r]);
        b[r] = fmadd(qd, k1, b[r]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      store(sc + r * S + c, a[r]);
      store(sc + r * S + c + kLanes, b[r]);
    }
  }
  for (; c + kLanes <= c1; c += kLanes) {
    vec a[RB] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vec k0 = load(k + d * S + c);
      for (int r = 0; r < RB; ++r) a[r] = fmadd(splat<vec>(q[r * D + d]), k0, a[r]);
    }
    for (int r = 0; r < RB; ++r) store(sc + r * S + c, a[r]);
  }
#if defined(__AVX512F__)
  if (c < c1) {                        // the last columns, lanes past c1 masked off (loads never read past them)
    const __mmask16 lanes = static_cast<__mmask16>((1u << (c1 - c)) - 1);
    vec a[RB] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vec k0 = (vec)_mm512_maskz_loadu_ps(lanes, k + d * S + c);
      for (int r = 0; r < RB; ++r) a[r] = fmadd(splat<vec>(q[r * D + d]), k0, a[r]);
    }
    for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(sc + r * S + c, lanes, (__m512)a[r]);
    return;
  }
#elif defined(__AVX2__)
  if (c < c1) {                        // as above, the lanes' mask a vector of all-ones words
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(c1 - c)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    vec a[RB] = {};
    for (int64_t d = 0; d < D; ++d) {
      const vec k0 = (vec)_mm256_maskload_ps(k + d * S + c, lanes);
      for (int r = 0; r < RB; ++r) a[r] = fmadd(splat<vec>(q[r * D + d]), k0, a[r]);
    }
    for (int r = 0; r < RB; ++r) _mm256_maskstore_ps(sc + r * S + c, lanes, (__m256)a[r]);
    return;
  }
#endif
  for (; c < c1; ++c)
    for (int r = 0; r < RB; ++r) {
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s = __builtin_fmaf(q[r * D + d], k[d * S + c], s);
      sc[r * S + c] = s;
    }
}

// o[r][d0 .. d0 + NV lanes) += sum over columns c in [c0, c1) of p[r][c] v[c][d], one fused multiply-add per column
// in column order, carried through o between calls (float32 stores: nothing rounds differently).
template <int RB, int NV>
void weigh_values(const float* const* p, const float* v, int64_t D, int64_t c0, int64_t c1, float* const* o,
                  int64_t d0) {
  vec acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o[r] + d0 + j * kLanes);
  for (int64_t c = c0; c < c1; ++c) {
    vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load(v + c * D + d0 + j * kLanes);
    for (int r = 0; r < RB; ++r) {
      const vec pr = splat<vec>(p[r][c]);
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(pr, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) store(o[r] + d0 + j * kLanes, acc[r][j]);
}

using ScoreFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
using WeighFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, float* const*, int64_t);

template <int... RB>
constexpr std::array<ScoreFn, sizeof...(RB)> score_table(std::integer_sequence<int, RB...>) {
  return {&score_rows<RB + 1>...};
}
template <int RB, int... NV>
constexpr std::array<WeighFn, sizeof...(NV)> weigh_row(std::integer_sequence<int, NV...>) {
  return {&weigh_values<RB, NV + 1>...};
}
template <int... RB>
constexpr std::array<std::array<WeighFn, kChunkVectors>, sizeof...(RB)> weigh_table(
    std::integer_sequence<int, RB...>) {
  return {weigh_row<RB + 1>(std::make_integer_sequence<int, kChunkVectors>{})...};
}
const auto kScore = score_table(std::make_integer_sequence<int, kRows>{});                 // [rows - 1]
const auto kWeigh = weigh_table(std::make_integer_sequence<int, kWeighRows>{});            // [rows - 1][vectors - 1]

// Rows [r0, r1) of (batch row b, kv head h); row r is query position r / G of head h * G + r % G.
void attend(const Problem& s, int64_t b, int64_t h, int64_t r0, int64_t r1) {
  const int64_t G = s.Hq / s.Hkv, D = s.D, S = s.S, T = s.T, R = r1 - r0;
  const int64_t n = std::clamp<int64_t>(s.lengths[b], T, S), prefix_end = n - T;
  const float* kb = s.k + (b * s.Hkv + h) * D * S;
  const float* vb = s.v + (b * s.Hkv + h) * S * D;
  const uint8_t* mb = s.mask + (s.mask_rows == 1 ? 0 : b) * T * T;
  thread_local std::vector<float> qs, scores, seq;
  qs.resize(R * D);
  scores.resize(R * S + kLanes);                // a row's last vector may read past it (masked)
  const int64_t stride = S + 2 * kLanes;        // a row's probabilities by column, then padding
  seq.resize(R * stride);
  int64_t lower[kRows], first[kRows], lo = prefix_end;
  float* o[kRows];
  const float* p[kRows];
  for (int64_t i = 0; i < R; ++i) {
    const int64_t r = r0 + i, t = r / G;
    const float* qr = s.q + ((b * T + t) * s.Hq + h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) qs[i * D + d] = qr[d] * s.scale;
    lower[i] = s.window > 0 ? s.q_positions[b * T + t] - s.window + 1 : 0;     // the window's first column
    first[i] = std::clamp<int64_t>(lower[i], 0, prefix_end);                    // ... of the prefix
    lo = std::min(lo, first[i]);
    o[i] = s.out + ((b * T + t) * s.Hq + h * G + r % G) * D;
    std::fill(o[i], o[i] + D, 0.0f);
  }
  for (int64_t i = 0; i < R; i += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, R - i);
    kScore[rows - 1](qs.data() + i * D, D, kb, S, lo, n, scores.data() + i * S);
  }
  // Per row: its columns' sequence (prefix from first[i], then the visible new columns), m, p and l. The sequence's
  // probabilities sit at seq[i * stride + first[i] + position], so that a prefix column c's is at index c and the
  // columns below first[i] read zero.
  thread_local std::vector<int64_t> new_cols_buf;
  new_cols_buf.resize(R * T);
  float l[kRows];
  int64_t* new_cols[kRows];
  int64_t num_new[kRows];
  for (int64_t i = 0; i < R; ++i) {
    const int64_t t = (r0 + i) / G;
    float* sr = scores.data() + i * S;
    float* row = seq.data() + i * stride;
    new_cols[i] = new_cols_buf.data() + i * T;
    num_new[i] = 0;
    for (int64_t j = 0; j < T; ++j)
      if (mb[t * T + j] && prefix_end + j >= lower[i]) new_cols[i][num_new[i]++] = prefix_end + j;
    const int64_t len = prefix_end - first[i] + num_new[i];
    // The visible new columns' scores moved up behind the prefix's (ascending, so in place): the sequence's scores
    // are sr[first[i], first[i] + len), read where the score pass left them (a copy into seq, read back at once,
    // stalled the max on its stores).
    for (int64_t j = 0; j < num_new[i]; ++j) sr[prefix_end + j] = sr[new_cols[i][j]];
    const float* sq = sr + first[i];
    float* seq_p = row + first[i];
    std::fill(row + lo, seq_p, 0.0f);
    float m = len > 0 ? sq[0] : 0.0f;
    {                                  // a vector max (the scalar loop: compiled as written, column by column)
      vec mv = splat<vec>(m);
      int64_t j = 0;
      for (; j + kLanes <= len; j += kLanes) {
        const vec x = load(sq + j);
        mv = x > mv ? x : mv;
      }
      for (int z = 0; z < kLanes; ++z) m = std::max(m, mv[z]);
      for (; j < len; ++j) m = std::max(m, sq[j]);
    }
    vec lanes = {};
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
      const vec e = vexp(load(sq + j) - splat<vec>(m));
      store(seq_p + j, e);
      lanes += e;
    }
    if (j < len) {                     // lanes past the sequence zeroed by a compare (lane by lane, the vector went
                                       // through memory on every step: a fifth of the softmax's time)
      const vec e = vexp(load(sq + j) - splat<vec>(m));
      const vec kept = kLaneIndex < splat<vec>(static_cast<float>(len - j)) ? e : vec{};
      store(seq_p + j, kept);
      lanes += kept;
    }
    l[i] = hsum(lanes);
    p[i] = row;
  }
  // Prefix columns for all rows at once, then each row's new columns, in column order per output element (the
  // dimensions past the last full vector by scalar fused multiply-adds in the same order).
  const int64_t DV = D / kLanes, tail = DV * kLanes;
  const int64_t parts = (R + kWeighRows - 1) / kWeighRows;
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t i = R * part / parts, rows = R * (part + 1) / parts - i;
    for (int64_t j = 0; j < DV; j += kChunkVectors) {
      const int64_t nv = std::min<int64_t>(kChunkVectors, DV - j);
      kWeigh[rows - 1][nv - 1](p + i, vb, D, lo, prefix_end, o + i, j * kLanes);
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t c = lo; c < prefix_end; ++c)
      for (int64_t d = tail; d < D; ++d) o[i][d] = __builtin_fmaf(p[i][c], vb[c * D + d], o[i][d]);
    const float* pn = seq.data() + i * stride + prefix_end;                  // the new columns' probabilities
    for (int64_t c = 0; c < num_new[i]; ++c) {
      const vec pr = splat<vec>(pn[c]);
      const float* vr = vb + new_cols[i][c] * D;
      for (int64_t j = 0; j < DV; ++j)
        store(o[i] + j * kLanes, fmadd(pr, load(vr + j * kLanes), load(o[i] + j * kLanes)));
      for (int64_t d = tail; d < D; ++d) o[i][d] = __builtin_fmaf(pn[c], vr[d], o[i][d]);
    }
    const float li = l[i] > 0.0f ? l[i] : 1.0f;
    for (int64_t d = 0; d < D; ++d) o[i][d] /= li;
  }
}

// Shares per thread: enough that a late-starting pool thread does not leave one share's worth of rows to the caller
// (two shares were ~10% slower than 8-row units at batch 1), few enough that a share holds whole kv heads at
// batch 8.
constexpr int64_t kSharesPerPart = 4;

ffi::Error VerifyAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::U8> mask,
                           ffi::Buffer<ffi::S32> q_positions, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int64_t window, int64_t parts) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("verify_attention: q, k, v 4-D and mask 3-D");
  const Problem s{q.typed_data(), k.typed_data(), v.typed_data(), lengths.typed_data(), mask.typed_data(),
                  q_positions.typed_data(), out->typed_data(), scale, window, qd[0], qd[1], qd[2], vd[1], qd[3],
                  vd[2], md[0]};
  if (kd[0] != s.B || vd[0] != s.B || kd[1] != s.Hkv || kd[2] != s.D || kd[3] != s.S || vd[3] != s.D ||
      s.Hq % s.Hkv != 0 || s.T > s.S || (md[0] != 1 && md[0] != s.B) ||
      md[1] != s.T || md[2] != s.T || lengths.element_count() != s.B || q_positions.element_count() != s.B * s.T)
    return ffi::Error::InvalidArgument("verify_attention: shapes do not form q [B, T, Hq, D], keys "
                                       "[B, Hkv, D, S], values [B, Hkv, S, D], "
                                       "lengths [B], mask [1 or B, T, T], q_positions [B, T]");
  // The (batch row, kv head) pairs' rows in one sequence, cut into equal shares, one per kShareRows rows up to
  // kSharesPerPart x parts; a share takes its rows pair by pair, in even units of up to kRows, so a pair's keys and
  // values come from memory once per share that holds it and from this core's cache for its further units (units
  // spread over the threads one by one read them from memory, or another core's cache, every time: SmolLM2 at
  // batch 8, T = 4 spent a third more in attention).
  const int64_t R = s.T * (s.Hq / s.Hkv), total = s.B * s.Hkv * R;
  if (total == 0) return ffi::Error::Success();           // no query rows (T = 0 or an empty batch)
  const int64_t shares =
      std::max<int64_t>(1, std::min<int64_t>(kSharesPerPart * parts, (total + kShareRows - 1) / kShareRows));
  run_parts(pool, parts, static_cast<int>(shares), [&s, R, total, shares](int share) {
    const int64_t f0 = total * share / shares, f1 = total * (share + 1) / shares;
    for (int64_t bh = f0 / R; bh * R < f1; ++bh) {
      const int64_t a = std::max(f0, bh * R) - bh * R, z = std::min(f1, (bh + 1) * R) - bh * R;
      const int64_t units = (z - a + kRows - 1) / kRows;
      for (int64_t u = 0; u < units; ++u)
        attend(s, bh / s.Hkv, bh % s.Hkv, a + (z - a) * u / units, a + (z - a) * (u + 1) / units);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxVerifyAttention, VerifyAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("parts"));
