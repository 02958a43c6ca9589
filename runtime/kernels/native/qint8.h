// Prefill (M > SMALL_M) on packed weights in int8, with AVX-512 VNNI: included by qmatmul.cpp
// inside its namespace, after Rows and h2f.
//
// x is quantised per block of 32 as q8_0 is: dx_b = max|x_b| / 127, qx = round(x / dx_b) in
// [-127, 127]. Each weight block is read as 32 integers wq with a scale dw_b (and, q4_k_m
// only, an offset c_b), so that w = dw_b * (wq - z) + c_b:
//   q8_0, int8   wq = q (signed)        z = 0   dw = d (int8: the row's d)    c = 0
//   q4_0, int4   wq = nibble (0..15)    z = 8   dw = d                        c = 0
//   q4_k_m       wq = nibble            z = 0   dw = d_j                      c = -dmin * m_j
// and y[m, n] = sum_b dx_b (dw_b * (I_b - z S_b) + c_b * S_b), I_b = sum_t qx_t wq_t and
// S_b = sum_t qx_t (exact, int32). VNNI's dpbusd multiplies unsigned by signed bytes: nibbles
// are the unsigned side and qx the signed one; signed weights multiply u = qx + 128, and
// -128 * sum(wq) is taken back.
// Numerics: the only change against x @ W^T is x's rounding, |x - dx * qx| <= dx / 2, so
// |y - x @ W^T| <= sum_b (max|x_b| / 254) * sum_{t in b} |w_t|, plus fp32 accumulation.
//
// Work: the output rows are split over threads in panels of NT rows. A panel is unpacked once
// (about 32 bytes per weight row and block, in L2) with GR = 16 rows side by side: the 32-bit
// lane j of a vector holds 4 consecutive values of row j, so one dpbusd multiplies 4 values of
// 16 rows by 4 values of x (broadcast) and a block's 32 values take 8 dpbusd into one int32
// accumulator per row of x and group of rows, exact, before one conversion and one FMA scale
// it (dx_b x dw_b). Each lane is one output: no horizontal sums. MR rows of x by NGR groups
// of rows at a time, in registers. q4_k_m's offsets c_b S_b are added after, by one fp32 GEMM
// over blocks (add_offsets).

#if defined(HETPLAN_AVX512) && defined(__AVX512VNNI__)
#define HETPLAN_VNNI 1

constexpr int64_t GR = 16;         // rows of W side by side in a vector, one per 32-bit lane
constexpr int NGR = 2;             // groups of GR rows a tile multiplies at once
constexpr int64_t NT = GR * NGR;   // rows of W per panel
constexpr int MR = 4;              // rows of x a tile multiplies at once (4 x 2 groups: measured
                                   // ahead of 6 x 2 for the 4-bit formats on an AVX-512 EPYC)

struct QX {                        // x quantised: per row m, per block b of 32
  int64_t nb;                      // blocks per row (K padded to 32)
  std::vector<uint8_t> v;          // [M, 32 nb]  qx as bytes, or qx + 128 for formats with signed weights
  std::vector<float> dx;           // [M, nb]
  std::vector<int32_t> sum;        // [M, nb]  S_b
};

// 32 values of x quantised as a block: dx = max|x| / 127 returned, q0 / q1 = values 0-15 / 16-31
// as round-to-nearest-even(x * (1 / dx)) in [-127, 127] (std::nearbyint's rounding under the
// default mode, which the cvtps conversion uses): the scalar loops' numbers, 16 lanes at a time.
inline float quantise32(const float* x, __m512i& q0, __m512i& q1) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float dx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.f;
  const __m512 inv = _mm512_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
  q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  return dx;
}

// ``offset``: 128 where the weights are signed (u = qx + 128 is dpbusd's unsigned side), else 0.
inline QX quantise_x(const float* x, int64_t M, int64_t K, int offset) {
  QX q;
  const int64_t nb = q.nb = (K + 31) / 32;
  q.v.assign(M * 32 * nb, static_cast<uint8_t>(offset));
  q.dx.assign(M * nb, 0.f);
  q.sum.assign(M * nb, 0);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = 32 * b, k1 = std::min<int64_t>(K, k0 + 32), at = m * 32 * nb + k0;
        float dx;
        int sum = 0;
        if (k1 - k0 == 32) {   // a whole block: quantise32, as the loop below
          __m512i q0, q1;
          dx = quantise32(xr + k0, q0, q1);
          const __m512i off = _mm512_set1_epi32(offset);
          auto store = [](void* to, __m512i v) { _mm_storeu_si128(static_cast<__m128i*>(to), _mm512_cvtepi32_epi8(v)); };
          store(&q.v[at], _mm512_add_epi32(q0, off));
          store(&q.v[at + 16], _mm512_add_epi32(q1, off));
          sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        } else {
          float amax = 0.f;
          for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
          dx = amax / 127.f;
          const float inv = dx > 0.f ? 1.f / dx : 0.f;
          for (int64_t k = k0; k < k1; ++k) {
            const int v = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(xr[k] * inv))));
            q.v[at + k - k0] = static_cast<uint8_t>(v + offset);
            sum += v;
          }
        }
        q.dx[m * nb + b] = dx;
        q.sum[m * nb + b] = sum;
      }
    }
  });
  return q;
}

// Block b of row n as 32 integers wq in value order (signed bytes for q8_0 / int8, nibbles
// 0..15 for the 4-bit formats) and its scale dw. Bytes past K hold whatever the row holds (or
// 0): x is 0 there, so they add nothing.
template <int FMT>
inline __m256i wblock(const Rows& r, int64_t n, int64_t b, float& dw) {
  const int64_t k0 = 32 * b;
  const __m128i low4 = _mm_set1_epi8(15);
  if (FMT == Q8_0 || FMT == INT8) {
    const uint8_t* q = r.p[1] + n * r.stride[1] + k0;
    dw = FMT == Q8_0 ? h2f_fast(r.p[0] + n * r.stride[0] + 2 * b) : *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
    const int64_t have = FMT == Q8_0 ? 32 : std::min<int64_t>(32, r.K - k0);
    return _mm256_maskz_loadu_epi8(have == 32 ? ~0u : (1u << have) - 1, q);
  }
  if (FMT == Q4_0) {   // values 0-15 in the low nibbles, 16-31 in the high
    dw = h2f_fast(r.p[0] + n * r.stride[0] + 2 * b);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.p[1] + n * r.stride[1] + 16 * b));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
  }
  // INT4, Q4_K_M: nibbles in order, low nibble first
  const uint8_t* src = FMT == INT4 ? r.p[1] + n * r.stride[1] : r.p[3] + n * r.stride[3];
  const int64_t have = FMT == INT4 ? std::min<int64_t>(16, (r.K + 1) / 2 - 16 * b) : 16;
  const __m128i v = _mm_maskz_loadu_epi8(have == 16 ? 0xffff : (1u << have) - 1, src + 16 * b);
  const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  dw = FMT == INT4 ? *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]) : h2f_fast(r.p[1] + n * r.stride[1] + 2 * b);
  return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

constexpr bool signed_weights(int fmt) { return fmt == Q8_0 || fmt == INT8; }
constexpr bool zero_point8(int fmt) { return fmt == Q4_0 || fmt == INT4; }

struct Panel {                     // rows [n0, n0 + NT) of W; rows past N are zeros with scale 0
  std::vector<__m512i> w;          // [NGR, nb, 8]: lane j of (g, b, k) = values 4k..4k+3 of block b of row n0 + g GR + j
  std::vector<__m512> dw;          // [NGR, nb]: lane j = that row's dw_b
  std::vector<__m512i> corr;       // [NGR, nb]: -128 x the sum of the block's values (signed weights)
};

template <int FMT>
void unpack_panel(const Rows& r, int64_t n0, int64_t rows, int64_t nb, Panel& pn) {
  pn.w.resize(NGR * nb * 8);
  pn.dw.resize(NGR * nb);
  pn.corr.resize(NGR * nb);
  int32_t* w = reinterpret_cast<int32_t*>(pn.w.data());
  float* dw = reinterpret_cast<float*>(pn.dw.data());
  int32_t* corr = reinterpret_cast<int32_t*>(pn.corr.data());
  for (int64_t i = 0; i < NT; ++i) {
    const int64_t g = i / GR, j = i % GR;
    for (int64_t b = 0; b < nb; ++b) {
      float d = 0.f;
      const __m256i v = i < rows ? wblock<FMT>(r, n0 + i, b, d) : _mm256_setzero_si256();
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
      int32_t* at = w + (g * nb + b) * 8 * GR + j;
      for (int k = 0; k < 8; ++k) at[k * GR] = lanes[k];
      dw[(g * nb + b) * GR + j] = d;
      if (signed_weights(FMT)) {
        const int8_t* bytes = reinterpret_cast<const int8_t*>(lanes);
        int s = 0;
        for (int t = 0; t < 32; ++t) s += bytes[t];
        corr[(g * nb + b) * GR + j] = -128 * s;
      }
    }
  }
}

// out[(m0 + a) NT + g GR + j] = y of row m0 + a of x and row g GR + j of the panel, a < R.
template <int FMT, int R>
inline void tile(const QX& q, const Panel& pn, int64_t m0, float* out) {
  const int64_t nb = q.nb;
  const int32_t* xs[R];
  for (int a = 0; a < R; ++a) xs[a] = reinterpret_cast<const int32_t*>(q.v.data() + (m0 + a) * 32 * nb);
  __m512 acc[R][NGR];
  for (int a = 0; a < R; ++a)
    for (int g = 0; g < NGR; ++g) acc[a][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i ia[R][NGR];
    for (int a = 0; a < R; ++a) {
      const __m512i start = zero_point8(FMT) ? _mm512_set1_epi32(-8 * q.sum[(m0 + a) * nb + b]) : _mm512_setzero_si512();
      for (int g = 0; g < NGR; ++g) ia[a][g] = signed_weights(FMT) ? pn.corr[g * nb + b] : start;
    }
    for (int k = 0; k < 8; ++k) {
      __m512i wv[NGR];
      for (int g = 0; g < NGR; ++g) wv[g] = pn.w[(g * nb + b) * 8 + k];
      for (int a = 0; a < R; ++a) {
        const __m512i xb = _mm512_set1_epi32(xs[a][8 * b + k]);
        for (int g = 0; g < NGR; ++g)
          ia[a][g] = signed_weights(FMT) ? _mm512_dpbusd_epi32(ia[a][g], xb, wv[g]) : _mm512_dpbusd_epi32(ia[a][g], wv[g], xb);
      }
    }
    for (int a = 0; a < R; ++a) {
      const __m512 dxa = _mm512_set1_ps(q.dx[(m0 + a) * nb + b]);
      for (int g = 0; g < NGR; ++g)
        acc[a][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[a][g]), _mm512_mul_ps(dxa, pn.dw[g * nb + b]), acc[a][g]);
    }
  }
  for (int a = 0; a < R; ++a)
    for (int g = 0; g < NGR; ++g) _mm512_storeu_ps(out + (m0 + a) * NT + g * GR, acc[a][g]);
}

template <int FMT>
void int8_fmt(const Rows& r, const QX& q, int64_t M, int64_t N, float* y, int64_t ldy) {
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    Panel pn;
    // The panel's outputs for every row of x, written out a row's NT values at a time: the
    // tiles' stores stay in cache whatever y's row stride (a fused weight's outputs are a
    // column range of a wider y, whose stride can alias in the caches).
    std::vector<float> out(M * NT);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, rows = std::min<int64_t>(NT, N - n0);
      unpack_panel<FMT>(r, n0, rows, q.nb, pn);
      int64_t m = 0;
      for (; m + MR <= M; m += MR) tile<FMT, MR>(q, pn, m, out.data());
      switch (M - m) {   // the rows of x left, fewer than MR
        case 3: tile<FMT, 3>(q, pn, m, out.data()); break;
        case 2: tile<FMT, 2>(q, pn, m, out.data()); break;
        case 1: tile<FMT, 1>(q, pn, m, out.data()); break;
        default: break;
      }
      for (int64_t a = 0; a < M; ++a) std::memcpy(y + a * ldy + n0, out.data() + a * NT, sizeof(float) * rows);
    }
  });
}

// q4_k_m's offset term, y[m, n] += sum_b (dx_b S_b)[m] * c_b[n], as one fp32 GEMM of
// [M, blocks] by [blocks, N] (1/32 of the int8 work) instead of an FMA per lane in the tile.
inline void add_offsets(const Rows& r, const QX& q, int64_t M, int64_t N, float* y, int64_t ldy) {
  const int64_t nb = q.nb;
  auto sx = torch::empty({M, nb});
  auto c = torch::empty({N, nb});
  float* ps = sx.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) ps[i] = q.dx[i] * static_cast<float>(q.sum[i]);
  float* pc = c.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* dmin = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
      for (int64_t b = 0; b < nb; ++b) pc[n * nb + b] = -dmin[b / 8] * static_cast<float>(r.p[2][n * r.stride[2] + b]);
    }
  });
  torch::from_blob(y, {M, N}, {ldy, 1}).add_(torch::mm(sx, c.t()));
}

// y [M, N] = x [M, K] @ [W_1; W_2; ...]^T over the segments (a fused qkv or gate_up), x
// quantised per block once for all of them (see above) and each segment's outputs written into
// its columns of y; x contiguous fp32.
inline void int8_matmul(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  const QX q = quantise_x(x, M, segs[0].r.K, signed_weights(segs[0].r.fmt) ? 128 : 0);
  for (const Seg& g : segs) {
    const Rows& r = g.r;
    float* yg = y + g.off;
    switch (r.fmt) {
      case Q8_0: int8_fmt<Q8_0>(r, q, M, g.n, yg, N); break;
      case Q4_0: int8_fmt<Q4_0>(r, q, M, g.n, yg, N); break;
      case INT8: int8_fmt<INT8>(r, q, M, g.n, yg, N); break;
      case INT4: int8_fmt<INT4>(r, q, M, g.n, yg, N); break;
      default:
        int8_fmt<Q4_K_M>(r, q, M, g.n, yg, N);
        add_offsets(r, q, M, g.n, yg, N);
    }
  }
}
#endif
