// Decode and prefill on packed weights in int8 with AVX2 (maddubs), where AVX-512 VNNI is missing
// (qdecode.h and qint8.h take that case): included by qmatmul.cpp inside its namespace, after
// qdecode.h (Rows, Seg, over_segments, SMALL_M, with_rows, with_quantised, block_scale, hsum8).
//
// x is quantised per block of 32 as prefill and the VNNI decode quantise it (qint8.h):
// dx_b = max|x_b| / 127, qx = round(x / dx_b) in [-127, 127], stored once per call as 32 bytes
// per block in the order the block's weights unpack into a 32-byte vector:
//   q8_0, int8, q4_0   values 0-31 in order (q4_0: low nibbles are values 0-15, high 16-31)
//   int4, q4_k_m       the 16 even values, then the 16 odd ones (low nibble, high nibble)
// maddubs multiplies unsigned by signed bytes into pairs of int16: nibbles (0..15) are the
// unsigned side as they are; signed weights (q8_0, int8) give |w| and qx takes w's sign
// (sign_epi8), so no pair exceeds 2 x 128 x 127 < 2^15. madd with ones sums the pairs into 8
// int32 lanes, exact, converted and scaled by dw_b * dx_b in fp32. The offsets are taken per
// chunk of 8 blocks in fp32: q4_0 / int4's "- 8" as -8 sum_b dw_b dx_b S_b, q4_k_m's as
// -sum_b dmin m_b dx_b S_b (S_b the sum of qx over block b, exact).
// Numerics are prefill's: |y - x @ W^T| <= sum_b (max|x_b| / 254) sum_{t in b} |w_t|, plus
// fp32 accumulation. Work: threads take chunks of output rows as they come free (dynamic_for).
// Decode (M <= SMALL_M): each weight byte is read once per call (streamed ahead past L2/L3 as the
// fp32 path does) and multiplied with all M rows of x in registers. Prefill: a panel of PREFILL_PANEL weight rows is read from
// DRAM once and multiplied with PREFILL_ROWS rows of x at a time from L1/L2 (on a 2-core AVX2
// EPYC about twice the GFLOP/s of dequantised fp32 tiles under torch's GEMM at 64 rows).

#if !defined(HETPLAN_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HETPLAN_INT8_AVX2 1

struct XQ {                    // x quantised for one format
  int64_t nb = 0, nc = 0;      // blocks of 32, chunks of 8 blocks, per row
  std::vector<int8_t> q;       // [M, 32 nb]: each block's qx in its format's order
  std::vector<float> dx, sx;   // [M, 8 nc]: dx_b and dx_b * S_b (0 past the row)
};

// 32 values at xr (zero-padded by the caller) into 32 bytes at out in FMT's order; dx and S
// returned. Rounding is the default mode's round-to-nearest-even (cvtps), as std::nearbyint's.
template <int FMT>
inline void quantise_block32(const float* xr, int8_t* out, float& dx, int& sum) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xr + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  dx = _mm_cvtss_f32(m) / 127.f;
  const __m256 inv = _mm256_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i q[4];
  __m256i s = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv))));
    s = _mm256_add_epi32(s, q[i]);
  }
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  sum = _mm_cvtsi128_si32(s4);
  // packs work within 128-bit lanes: bytes come out as 0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31
  const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
  __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (FMT == INT4 || FMT == Q4_K_M) {   // even values then odd ones
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, evens_odds), 0xd8);   // quads 0, 2, 1, 3
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
}

template <int FMT>
XQ quantise_xq(const float* x, int64_t M, int64_t K) {
  XQ q;
  q.nb = (K + 31) / 32;
  q.nc = (q.nb + 7) / 8;
  q.q.assign(M * 32 * q.nb, 0);
  q.dx.assign(M * 8 * q.nc, 0.f);
  q.sx.assign(M * 8 * q.nc, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(32) float pad[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < q.nb; ++b) {
        const int64_t k0 = 32 * b, have = std::min<int64_t>(32, K - k0);
        const float* xr = x + m * K + k0;
        if (have < 32) {   // a row's partial last block, zero-padded
          std::memset(pad, 0, sizeof pad);
          std::memcpy(pad, xr, sizeof(float) * have);
          xr = pad;
        }
        float dx;
        int sum;
        quantise_block32<FMT>(xr, q.q.data() + (m * q.nb + b) * 32, dx, sum);
        q.dx[m * 8 * q.nc + b] = dx;
        q.sx[m * 8 * q.nc + b] = dx * static_cast<float>(sum);
      }
  });
  return q;
}

// The scales of blocks 8c .. 8c + 7 of row n (0 past the row's blocks, never read past it).
template <int FMT>
inline __m256 chunk_scales(const Rows& r, int64_t n, int64_t c, int64_t nb) {
  if (FMT == INT8 || FMT == INT4) return _mm256_set1_ps(block_scale<FMT>(r, n, 0));   // the row's
  // q4_k_m stores whole super-blocks of 8; q8_0 / q4_0 one scale per block of the row
  const uint8_t* d = (FMT == Q4_K_M ? r.p[1] + n * r.stride[1] : r.p[0] + n * r.stride[0]) + 16 * c;
  const int64_t here = FMT == Q4_K_M ? 8 : std::min<int64_t>(8, nb - 8 * c);
  if (here == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
  alignas(16) uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(h, d, 2 * here);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// Block b's 32 weight values as bytes in XQ's order: signed (q8_0, int8) or nibbles 0..15.
// Rows of int8 / int4 are not padded to whole blocks: their partial last block is copied.
template <int FMT>
inline __m256i weight_block(const uint8_t* w, int64_t b, int64_t K) {
  constexpr bool s8 = FMT == Q8_0 || FMT == INT8;
  constexpr int64_t bytes = s8 ? 32 : 16;
  alignas(32) uint8_t tail[32];
  const uint8_t* at = w + bytes * b;
  if ((FMT == INT8 || FMT == INT4) && 32 * b + 32 > K) {
    const int64_t have = FMT == INT8 ? K - 32 * b : (K - 32 * b + 1) / 2;
    std::memset(tail, 0, sizeof tail);
    std::memcpy(tail, at, have);
    at = tail;
  }
  if (s8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  // the 16 bytes in both halves (a load), the high half shifted by a nibble: low nibbles | high
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

// Rows [n0, n1) of y for rows [m0, m0 + M) of x (y: their first row). STREAM: the weights are
// read once (decode), so fetched ahead past L2/L3; prefill reads them again for the next rows of
// x and leaves them to the caches.
template <int FMT, int M, bool STREAM = true>
void avx2_rows(const Rows& r, const XQ& q, int64_t m0, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr bool s8 = FMT == Q8_0 || FMT == INT8;
  constexpr int64_t bytes = s8 ? 32 : 16;   // weight bytes per block
  constexpr int A = M <= 2 ? 2 : 1;         // accumulators per row of x: alternate FMA chains overlap
  const int64_t nb = q.nb, K = r.K;
  const int vp = FMT == Q4_K_M ? 3 : 1;     // the row_parts array holding the values
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = r.p[vp] + n * r.stride[vp];
    __m256 acc[M][A], off[M];
    for (int m = 0; m < M; ++m) {
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
      off[m] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < q.nc; ++c) {
      // Weight bytes are read once per step: fetched ahead as non-temporal, they stay out of
      // L2/L3, where the small ops between GEMVs keep their data.
      for (int64_t i = 0; STREAM && i < 8 * bytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + 8 * bytes * c + i) + 1024, _MM_HINT_NTA);
      const __m256 dw = chunk_scales<FMT>(r, n, c, nb);
      __m256 ow = dw;                       // what multiplies dx_b S_b in the offset
      if (FMT == Q4_K_M) {
        const float dmin = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0] + 4 * c);
        const __m128i mb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.p[2] + n * r.stride[2] + 8 * c));
        ow = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb)));
      }
      alignas(32) float dd[M][8];   // dw_b dx_b, broadcast from memory (a load, no shuffle)
      for (int m = 0; m < M; ++m) {
        const int64_t at = (m0 + m) * 8 * q.nc + 8 * c;
        _mm256_store_ps(dd[m], _mm256_mul_ps(dw, _mm256_loadu_ps(q.dx.data() + at)));
        if (!s8) off[m] = _mm256_fmadd_ps(ow, _mm256_loadu_ps(q.sx.data() + at), off[m]);
      }
      // block j of the chunk into accumulator a (a constant: the accumulators stay in registers)
      auto step = [&](int j, int a) {
        const int64_t b = 8 * c + j;
        const __m256i wv = weight_block<FMT>(w, b, K);
        const __m256i uw = s8 ? _mm256_sign_epi8(wv, wv) : wv;   // |w| (s8), the nibbles as they are
        for (int m = 0; m < M; ++m) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.q.data() + ((m0 + m) * nb + b) * 32));
          if (s8) xv = _mm256_sign_epi8(xv, wv);
          const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(uw, xv), ones);
          acc[m][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&dd[m][j]), acc[m][a]);
        }
      };
      const int here = static_cast<int>(std::min<int64_t>(8, nb - 8 * c));
      if (here == 8) {
        for (int j = 0; j < 8; j += 2) {
          step(j, 0);
          step(j + 1, A - 1);
        }
      } else {
        for (int j = 0; j < here; ++j) step(j, 0);
      }
    }
    constexpr float z = FMT == Q4_0 || FMT == INT4 ? 8.f : 1.f;   // the offset's factor (q4_k_m: 1)
    for (int m = 0; m < M; ++m) {
      __m256 t = acc[m][0];
      for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[m][a]);
      y[m * ldy + n] = hsum8(t) - (s8 ? 0.f : z * hsum8(off[m]));
    }
  }
}

template <int FMT, bool STREAM>
void avx2_group(const Rows& r, const XQ& q, int64_t m0, int64_t rows, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  with_rows(rows, [&](auto m) { avx2_rows<FMT, decltype(m)::value, STREAM>(r, q, m0, y, ldy, n0, n1); });
}

constexpr int64_t PREFILL_ROWS = 4;    // rows of x a prefill pass multiplies with a panel of weight rows
constexpr int64_t PREFILL_PANEL = 16;  // weight rows a pass takes: read from DRAM once, then from L1/L2

// x quantised once; M <= SMALL_M: each weight row streamed once past all rows of x; more: panels
// of PREFILL_PANEL weight rows, each multiplied with PREFILL_ROWS rows of x at a time.
template <int FMT>
void avx2_fmt(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  const XQ q = quantise_xq<FMT>(x, M, segs[0].r.K);
  dynamic_for(N, chunk_rows(segs[0].r), [&](int64_t a, int64_t e) {
    over_segments(segs, a, e, [&](const Seg& g, int64_t n0, int64_t n1) {
      float* yg = y + g.off;
      if (M <= SMALL_M) return avx2_group<FMT, true>(g.r, q, 0, M, yg, N, n0, n1);
      for (int64_t p = n0; p < n1; p += PREFILL_PANEL)
        for (int64_t m0 = 0; m0 < M; m0 += PREFILL_ROWS)
          avx2_group<FMT, false>(g.r, q, m0, std::min(PREFILL_ROWS, M - m0), yg + m0 * N, N, p,
                                 std::min(n1, p + PREFILL_PANEL));
    });
  });
}

// y [M, N] = x [M, K] @ W^T over the segments' rows, x quantised once per block (see above);
// x contiguous fp32.
inline void avx2_int8(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  with_quantised(segs[0].r.fmt, [&](auto fmt) { avx2_fmt<decltype(fmt)::value>(segs, x, M, N, y); });
}
#endif
