// Decode (M <= SMALL_M) on packed weights in int8 with AVX-512 VNNI: included by qmatmul.cpp
// inside its namespace, after qint8.h (HETPLAN_VNNI, Rows, h2f_fast).
//
// x is quantised per block of 32 as for prefill (qint8.h): dx_b = max|x_b| / 127,
// qx = round(x / dx_b) in [-127, 127], and laid out once per call in the order the format's
// weight bytes are read, a group of 4 blocks (128 values) at a time, as two 64-byte vectors:
//   q4_0           A: the low nibbles of the group's 64 bytes (block j: values 0-15), B: the high (16-31)
//   int4, q4_k_m   A: the low nibbles (block j: the even values), B: the high (the odd values)
//   q8_0, int8     A: values 0-63 of the group (blocks 0, 1), B: values 64-127 (blocks 2, 3)
// Nibbles are unsigned bytes, multiplied by signed qx as dpbusd takes them; signed weight
// bytes (q8_0, int8) multiply u = qx + 128 and -128 x the lane's weight sum is taken back.
// Each 4-byte lane's int32 sum is exact; it is scaled by dw_b * dx_b of its block in fp32.
// q4_0 / int4's "- 8" starts the accumulator at -8 x the lane's sum of qx; q4_k_m's offset
// -dmin m_b is sum_b (-dmin m_b) dx_b S_b with S_b the sum of qx over block b.
// Numerics are prefill's: |y - x @ W^T| <= sum_b (max|x_b| / 254) sum_{t in b} |w_t|, plus
// fp32 accumulation. Work: threads take chunks of output rows as they come free (dynamic_for);
// each weight byte is read once per call and multiplied with all M rows of x while it is in
// registers.

#ifdef HETPLAN_VNNI

struct XD {                    // x quantised for one format's decode
  int64_t ng = 0, nc = 0;      // groups of 4 blocks, chunks of 16 blocks, per row
  std::vector<int8_t> ab;      // [M, ng, 128]: A then B of each group (u = qx + 128 for q8_0 / int8)
  std::vector<int32_t> c;      // [M, ng, 16]: the accumulator's start per lane (q4_0, int4)
  std::vector<float> dx;       // [M, 16 nc]: each block's dx (0 past the row)
  std::vector<float> sx;       // [M, 16 nc]: dx_b * S_b (q4_k_m)
};

// Blocks of 32 in a weight row of K values as stored (q4_k_m: whole super-blocks of 8).
inline int64_t stored_blocks(int fmt, int64_t K) { return fmt == Q4_K_M ? 8 * ((K + 255) / 256) : (K + 31) / 32; }

// Bytes of the weight values in a row (the array the groups are read from).
inline int64_t value_bytes(int fmt, int64_t K) {
  switch (fmt) {
    case Q8_0: return 32 * ((K + 31) / 32);
    case Q4_0: return 16 * ((K + 31) / 32);
    case INT8: return K;
    case INT4: return (K + 1) / 2;
    default: return 128 * ((K + 255) / 256);
  }
}

// Block j of group g (32 values of x at xr) quantised (qint8.h's quantise32) and stored as
// quantise_xd lays it out; dx and the sum of qx returned for the scales and offsets.
template <int FMT>
inline void quantise_block(const float* xr, int8_t* g, int j, float& dx, int& sum) {
  __m512i q0, q1;
  dx = quantise32(xr, q0, q1);
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  auto store = [](int8_t* at, __m512i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtepi32_epi8(v)); };
  if (FMT == Q8_0 || FMT == INT8) {          // u = qx + 128, values in order
    const __m512i u128 = _mm512_set1_epi32(128);
    store(g + 32 * j, _mm512_add_epi32(q0, u128));
    store(g + 32 * j + 16, _mm512_add_epi32(q1, u128));
  } else if (FMT == Q4_0) {                  // values 0-15 to A, 16-31 to B
    store(g + 16 * j, q0);
    store(g + 64 + 16 * j, q1);
  } else {                                   // even values to A, odd to B
    alignas(64) static const int32_t even[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    alignas(64) static const int32_t odd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    store(g + 16 * j, _mm512_permutex2var_epi32(q0, _mm512_load_si512(even), q1));
    store(g + 64 + 16 * j, _mm512_permutex2var_epi32(q0, _mm512_load_si512(odd), q1));
  }
}

template <int FMT>
XD quantise_xd(const float* x, int64_t M, int64_t K) {
  constexpr bool signed_w = FMT == Q8_0 || FMT == INT8;
  XD q;
  const int64_t nbw = stored_blocks(FMT, K), nb = (K + 31) / 32;
  q.ng = (nbw + 3) / 4;
  q.nc = (q.ng + 3) / 4;
  q.ab.assign(M * q.ng * 128, signed_w ? static_cast<int8_t>(-128) : 0);   // u = 128 is qx = 0
  q.c.assign(M * q.ng * 16, 0);
  q.dx.assign(M * 16 * q.nc, 0.f);
  q.sx.assign(M * 16 * q.nc, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* ab = q.ab.data() + m * q.ng * 128;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = 32 * b, k1 = std::min<int64_t>(K, k0 + 32);
      if (k1 - k0 == 32) {   // a whole block: the same values as the loop below, 32 lanes at a time
        int8_t* g = ab + (b / 4) * 128;
        const int j = static_cast<int>(b % 4);
        float dx;
        int sum;
        quantise_block<FMT>(xr + k0, g, j, dx, sum);
        q.dx[m * 16 * q.nc + b] = dx;
        q.sx[m * 16 * q.nc + b] = dx * static_cast<float>(sum);
        continue;
      }
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
      int sum = 0;
      int8_t* g = ab + (b / 4) * 128;
      const int j = static_cast<int>(b % 4);
      for (int64_t k = k0; k < k1; ++k) {
        const int v = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(xr[k] * inv))));
        const int t = static_cast<int>(k - k0);
        sum += v;
        if (signed_w) {
          g[32 * j + t] = static_cast<int8_t>(static_cast<uint8_t>(v + 128));   // A: 0-63, B: 64-127
        } else if (FMT == Q4_0) {
          g[(t < 16 ? 0 : 64) + 16 * j + (t & 15)] = static_cast<int8_t>(v);
        } else {
          g[(t & 1 ? 64 : 0) + 16 * j + t / 2] = static_cast<int8_t>(v);
        }
      }
      q.dx[m * 16 * q.nc + b] = dx;
      q.sx[m * 16 * q.nc + b] = dx * static_cast<float>(sum);
    }
    if (FMT == Q4_0 || FMT == INT4) {
      for (int64_t g = 0; g < q.ng; ++g)
        for (int l = 0; l < 16; ++l) {
          int s = 0;
          for (int i = 0; i < 4; ++i) s += ab[g * 128 + 4 * l + i] + ab[g * 128 + 64 + 4 * l + i];
          q.c[(m * q.ng + g) * 16 + l] = -8 * s;
        }
    }
  }
  return q;
}

inline __mmask64 first_bytes(int64_t n) { return n >= 64 ? ~0ULL : n <= 0 ? 0ULL : (1ULL << n) - 1; }

// Rows [n0, n1) of y for M rows of x.
template <int FMT, int M>
void vnni_rows(const Rows& r, const XD& q, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr bool signed_w = FMT == Q8_0 || FMT == INT8;
  constexpr int64_t gbytes = signed_w ? 128 : 64;   // weight bytes of a group of 4 blocks
  const int64_t K = r.K, nbw = stored_blocks(FMT, K), vbytes = value_bytes(FMT, K);
  const int vp = FMT == Q4_K_M ? 3 : 1;             // the row_parts array holding the values
  __m512i idx[4], idx_b[4];                         // lane -> block of the chunk's 16
  for (int gi = 0; gi < 4; ++gi) {
    alignas(64) int32_t a[16], b[16];
    for (int l = 0; l < 16; ++l) {
      a[l] = signed_w ? 4 * gi + l / 8 : 4 * gi + l / 4;
      b[l] = 4 * gi + 2 + l / 8;
    }
    idx[gi] = _mm512_load_si512(a);
    idx_b[gi] = _mm512_load_si512(b);
  }
  const __m512i low4 = _mm512_set1_epi8(15), u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = r.p[vp] + n * r.stride[vp];
    constexpr bool two = M <= 2;      // two accumulators (M <= 2: registers to spare): alternate FMA chains overlap
    __m512 acc[M], acc2[M], off[M];
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = off[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < q.nc; ++c) {
      const int64_t here = std::min<int64_t>(16, nbw - 16 * c);
      const __mmask16 bm = static_cast<__mmask16>(here >= 16 ? 0xffff : (1u << here) - 1);
      __m512 dw, mw = _mm512_setzero_ps();
      if (FMT == INT8 || FMT == INT4) {
        dw = _mm512_set1_ps(*reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]));
      } else {
        const uint8_t* d = FMT == Q4_K_M ? r.p[1] + n * r.stride[1] : r.p[0] + n * r.stride[0];
        const void* at = d + 32 * c;   // plain loads where the chunk is whole (masked ones stall streaming)
        dw = _mm512_cvtph_ps(here >= 16 ? _mm256_loadu_si256(static_cast<const __m256i*>(at)) : _mm256_maskz_loadu_epi16(bm, at));
      }
      if (FMT == Q4_K_M) {
        const float* dmin = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
        const float hi = 16 * c + 8 < nbw ? dmin[2 * c + 1] : 0.f;
        const __m512 vmin = _mm512_insertf32x8(_mm512_set1_ps(dmin[2 * c]), _mm256_set1_ps(hi), 1);
        const uint8_t* mp = r.p[2] + n * r.stride[2] + 16 * c;
        const __m128i mb = here >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(mp)) : _mm_maskz_loadu_epi8(bm, mp);
        mw = _mm512_mul_ps(vmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb)));
      }
      __m512 dd[M];
      for (int m = 0; m < M; ++m) {
        dd[m] = _mm512_mul_ps(dw, _mm512_loadu_ps(q.dx.data() + m * 16 * q.nc + 16 * c));
        if (FMT == Q4_K_M) off[m] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(q.sx.data() + m * 16 * q.nc + 16 * c), off[m]);
      }
      const int groups = static_cast<int>((here + 3) / 4);
      for (int gi = 0; gi < groups; ++gi) {
        const int64_t g = 4 * c + gi, at = g * gbytes;
        // Weight bytes are read once per step: fetched ahead as non-temporal, they stay out of
        // L2/L3, where the small ops between GEMVs (norms, rope, the interpreter) keep their data.
        _mm_prefetch(reinterpret_cast<const char*>(w + at) + 1024, _MM_HINT_NTA);
        if (signed_w) _mm_prefetch(reinterpret_cast<const char*>(w + at) + 1088, _MM_HINT_NTA);
        if (signed_w) {
          const bool whole = at + 128 <= vbytes;   // plain loads where the group is whole
          const __m512i a = whole ? _mm512_loadu_si512(w + at) : _mm512_maskz_loadu_epi8(first_bytes(vbytes - at), w + at);
          const __m512i b = whole ? _mm512_loadu_si512(w + at + 64)
                                  : _mm512_maskz_loadu_epi8(first_bytes(vbytes - at - 64), w + at + 64);
          const __m512i na = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, a));
          const __m512i nb = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, b));
          for (int m = 0; m < M; ++m) {
            const int8_t* xg = q.ab.data() + (m * q.ng + g) * 128;
            const __m512i ia = _mm512_dpbusd_epi32(na, _mm512_loadu_si512(xg), a);
            const __m512i ib = _mm512_dpbusd_epi32(nb, _mm512_loadu_si512(xg + 64), b);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_permutexvar_ps(idx[gi], dd[m]), acc[m]);
            __m512& to = two ? acc2[m] : acc[m];
            to = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_permutexvar_ps(idx_b[gi], dd[m]), to);
          }
        } else {
          const __m512i v = at + 64 <= vbytes ? _mm512_loadu_si512(w + at) : _mm512_maskz_loadu_epi8(first_bytes(vbytes - at), w + at);
          const __m512i a = _mm512_and_si512(v, low4), b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int m = 0; m < M; ++m) {
            const int8_t* xg = q.ab.data() + (m * q.ng + g) * 128;
            const __m512i start = FMT == Q4_K_M ? _mm512_setzero_si512() : _mm512_loadu_si512(q.c.data() + (m * q.ng + g) * 16);
            const __m512i i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, a, _mm512_loadu_si512(xg)), b, _mm512_loadu_si512(xg + 64));
            __m512& to = two && (gi & 1) ? acc2[m] : acc[m];
            to = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(idx[gi], dd[m]), to);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m)
      y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m])) - (FMT == Q4_K_M ? _mm512_reduce_add_ps(off[m]) : 0.f);
  }
}

template <int FMT>
void vnni_fmt(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  const XD q = quantise_xd<FMT>(x, M, segs[0].r.K);
  dynamic_for(N, chunk_rows(segs[0].r), [&](int64_t a, int64_t e) {
    over_segments(segs, a, e, [&](const Seg& g, int64_t n0, int64_t n1) {
      const Rows& r = g.r;
      float* yg = y + g.off;
      with_rows(M, [&](auto m) { vnni_rows<FMT, decltype(m)::value>(r, q, yg, N, n0, n1); });
    });
  });
}

// y [M, N] = x [M, K] @ W^T for M <= SMALL_M over the segments' rows, x quantised once per
// block (see above); x contiguous fp32.
inline void vnni_decode(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  with_quantised(segs[0].r.fmt, [&](auto fmt) { vnni_fmt<decltype(fmt)::value>(segs, x, M, N, y); });
}
#endif
