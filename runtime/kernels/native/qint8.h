// Prefill (M > SMALL_M) on packed weights in int8, with AVX-512 VNNI: included by qmatmul.cpp
// inside its namespace, after Rows and h2f.
//
// x is quantised per block of 32 as q8_0 is: dx_b = max|x_b| / 127, qx = round(x / dx_b) in
// [-127, 127]. Each weight block is read as 32 signed bytes wq with a scale dw_b (and, q4_k_m
// only, an offset c_b), so that w = dw_b * wq + c_b:
//   q8_0, int8   wq = q               dw = d (int8: the row's d)          c = 0
//   q4_0, int4   wq = nibble - 8      dw = d                              c = 0
//   q4_k_m       wq = nibble          dw = d_j                            c = -dmin * m_j
// and y[m, n] = sum_b dx_b (dw_b * I_b + c_b * S_b), I_b = sum_t qx_t wq_t (exact, int32),
// S_b = sum_t qx_t. VNNI's dpbusd multiplies unsigned by signed bytes, so x is held as
// u = qx + 128 and the accumulator starts at -128 * sum(wq) (per 4-byte lane), which leaves the
// exact I_b. A 64-byte vector holds two blocks (lanes 0-7 block 2p, 8-15 block 2p + 1); the
// lanes are scaled in fp32 (dx * dw per lane) and summed once per output at the end.
// Numerics: the only change against x @ W^T is x's rounding, |x - dx * qx| <= dx / 2, so
// |y - x @ W^T| <= sum_b (max|x_b| / 254) * sum_{t in b} |w_t|, plus fp32 accumulation.
//
// Work: the output rows are split over threads; a thread unpacks a panel of NT rows (signed
// bytes, lane corrections, lane scales: 3 x 64 B per 64 weights, about 200 KiB for K = 4096,
// in L2) and multiplies it with all of x, MR rows of x by NR rows of W at a time in registers
// (8 x 2: measured best of 4x4, 8x2, 12x1, 5x3, 6x2, 4x3 on an AVX-512 EPYC). q4_k_m's offsets
// c_b S_b are added after, by one fp32 GEMM over blocks (add_offsets).

#if defined(HETPLAN_AVX512) && defined(__AVX512VNNI__)
#define HETPLAN_VNNI 1

constexpr int64_t NT = 16;   // rows of W per panel

struct QX {                   // x quantised: per row m, per pair of blocks p
  int64_t np;                 // pairs of blocks per row (K padded to 64)
  std::vector<uint8_t> u;     // [M, 64 np]  qx + 128
  std::vector<float> d;       // [M, 16 np]  dx of each lane's block
  std::vector<float> s;       // [M, 16 np]  dx * sum of the lane's 4 qx (q4_k_m's offset term)
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

inline QX quantise_x(const float* x, int64_t M, int64_t K) {
  QX q;
  q.np = (K + 63) / 64;
  q.u.assign(M * 64 * q.np, 128);
  q.d.assign(M * 16 * q.np, 0.f);
  q.s.assign(M * 16 * q.np, 0.f);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      for (int64_t b = 0; b < 2 * q.np; ++b) {
        const int64_t k0 = 32 * b, k1 = std::min<int64_t>(K, k0 + 32);
        if (k1 - k0 == 32) {   // a whole block: quantise32, as the loop below
          __m512i q0, q1;
          const float dx = quantise32(xr + k0, q0, q1);
          const __m512i u128 = _mm512_set1_epi32(128);
          uint8_t* u = q.u.data() + m * 64 * q.np + k0;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, u128)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, u128)));
          alignas(64) int32_t v[32];
          _mm512_store_si512(v, q0);
          _mm512_store_si512(v + 16, q1);
          for (int l = 0; l < 8; ++l) {
            q.d[m * 16 * q.np + 8 * b + l] = dx;
            q.s[m * 16 * q.np + 8 * b + l] = dx * static_cast<float>(v[4 * l] + v[4 * l + 1] + v[4 * l + 2] + v[4 * l + 3]);
          }
          continue;
        }
        float amax = 0.f;
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
        const float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
        int lane_sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = k0; k < k1; ++k) {
          const int v = std::max(-127, std::min(127, static_cast<int>(std::nearbyint(xr[k] * inv))));
          q.u[m * 64 * q.np + k] = static_cast<uint8_t>(v + 128);
          lane_sum[(k - k0) / 4] += v;
        }
        for (int l = 0; l < 8; ++l) {
          q.d[m * 16 * q.np + 8 * b + l] = dx;
          q.s[m * 16 * q.np + 8 * b + l] = dx * static_cast<float>(lane_sum[l]);
        }
      }
    }
  });
  return q;
}

// Block b of row n as 32 signed bytes and its scale dw (zeros for b past the row); q4_k_m's
// offset c is add_offsets'. Bytes past K hold whatever the row holds (or 0): x is 0 there, so
// they add nothing.
template <int FMT>
inline __m256i wblock(const Rows& r, int64_t n, int64_t b, float& dw) {
  const int64_t nb = (r.K + 31) / 32;
  if (b >= nb) { dw = 0.f; return _mm256_setzero_si256(); }
  const int64_t k0 = 32 * b;
  const __m128i low4 = _mm_set1_epi8(15);
  if (FMT == Q8_0 || FMT == INT8) {
    const uint8_t* q = r.p[1] + n * r.stride[1] + k0;
    dw = FMT == Q8_0 ? h2f_fast(r.p[0] + n * r.stride[0] + 2 * b) : *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
    const int64_t have = FMT == Q8_0 ? 32 : std::min<int64_t>(32, r.K - k0);
    return _mm256_maskz_loadu_epi8(have == 32 ? ~0u : (1u << have) - 1, q);
  }
  if (FMT == Q4_0) {
    dw = h2f_fast(r.p[0] + n * r.stride[0] + 2 * b);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.p[1] + n * r.stride[1] + 16 * b));
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  }
  // INT4, Q4_K_M: nibbles in order, low nibble first
  const uint8_t* src = FMT == INT4 ? r.p[1] + n * r.stride[1] : r.p[3] + n * r.stride[3];
  const int64_t have = FMT == INT4 ? std::min<int64_t>(16, (r.K + 1) / 2 - 16 * b) : 16;
  const __m128i v = _mm_maskz_loadu_epi8(have == 16 ? 0xffff : (1u << have) - 1, src + 16 * b);
  const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  const __m256i nib = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  if (FMT == INT4) {
    dw = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
    return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
  }
  dw = h2f_fast(r.p[1] + n * r.stride[1] + 2 * b);
  return nib;
}

struct Panel {                 // rows [n0, n0 + rows) of W, per row and pair of blocks
  std::vector<__m512i> w;      // signed bytes of the two blocks
  std::vector<__m512i> corr;   // -128 * sum of each lane's 4 bytes
  std::vector<__m512> dw;      // the lane's block scale
};

template <int FMT>
void unpack_panel(const Rows& r, int64_t n0, int64_t rows, int64_t np, Panel& pn) {
  pn.w.resize(rows * np);
  pn.corr.resize(rows * np);
  pn.dw.resize(rows * np);
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t p = 0; p < np; ++p) {
      float d0, d1;
      const __m256i a = wblock<FMT>(r, n0 + i, 2 * p, d0);
      const __m256i b = wblock<FMT>(r, n0 + i, 2 * p + 1, d1);
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      const int64_t at = i * np + p;
      pn.w[at] = w;
      pn.corr[at] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w));
      pn.dw[at] = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
    }
  }
}

// y[m0 + a, n0 + i0 + j] for a < MR rows of x and j < NR rows of the panel.
template <int FMT, int MR, int NR>
inline void tile(const QX& q, const Panel& pn, int64_t m0, int64_t i0, int64_t n0, float* y, int64_t ldy) {
  const int64_t np = q.np;
  __m512 acc[MR][NR];
  for (int a = 0; a < MR; ++a)
    for (int j = 0; j < NR; ++j) acc[a][j] = _mm512_setzero_ps();
  const uint8_t* u = q.u.data() + m0 * 64 * np;
  const float* d = q.d.data() + m0 * 16 * np;
  for (int64_t p = 0; p < np; ++p) {
    __m512i w[NR], corr[NR];
    __m512 dw[NR];
    for (int j = 0; j < NR; ++j) {
      const int64_t at = (i0 + j) * np + p;
      w[j] = pn.w[at];
      corr[j] = pn.corr[at];
      dw[j] = pn.dw[at];
    }
    for (int a = 0; a < MR; ++a) {
      const __m512i xu = _mm512_loadu_si512(u + (a * np + p) * 64);
      const __m512 xd = _mm512_loadu_ps(d + (a * np + p) * 16);
      for (int j = 0; j < NR; ++j) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr[j], xu, w[j]));
        acc[a][j] = _mm512_fmadd_ps(dot, _mm512_mul_ps(xd, dw[j]), acc[a][j]);
      }
    }
  }
  for (int a = 0; a < MR; ++a)
    for (int j = 0; j < NR; ++j) y[(m0 + a) * ldy + n0 + i0 + j] = _mm512_reduce_add_ps(acc[a][j]);
}

template <int FMT, int MR, int NR>
void int8_fmt(const Rows& r, const QX& q, int64_t M, int64_t N, float* y, int64_t ldy) {
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    Panel pn;
    // The panel's outputs for every row of x, written out a row's NT values at a time: the
    // tiles' scattered stores stay in cache whatever y's row stride (a fused weight's outputs
    // are a column range of a wider y, whose stride can alias in the caches).
    std::vector<float> out(M * NT);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, rows = std::min<int64_t>(NT, N - n0);
      unpack_panel<FMT>(r, n0, rows, q.np, pn);
      for (int64_t m = 0; m < M; m += MR) {
        const bool whole_m = m + MR <= M;
        for (int64_t i = 0; i < rows; i += NR) {
          if (whole_m && i + NR <= rows) {
            tile<FMT, MR, NR>(q, pn, m, i, 0, out.data(), NT);
          } else {
            for (int64_t a = m; a < std::min<int64_t>(M, m + MR); ++a)
              for (int64_t j = i; j < std::min<int64_t>(rows, i + NR); ++j) tile<FMT, 1, 1>(q, pn, a, j, 0, out.data(), NT);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * ldy + n0, out.data() + m * NT, sizeof(float) * rows);
    }
  });
}

// q4_k_m's offset term, y[m, n] += sum_b (dx_b S_b)[m] * c_b[n], as one fp32 GEMM of
// [M, blocks] by [blocks, N] (1/32 of the int8 work) instead of an FMA per lane in the tile.
inline void add_offsets(const Rows& r, const QX& q, int64_t M, int64_t N, float* y, int64_t ldy) {
  const int64_t nb = 2 * q.np, stored = (r.K + 31) / 32;
  auto sx = torch::zeros({M, nb});
  auto c = torch::zeros({N, nb});
  float* ps = sx.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      for (int l = 0; l < 8; ++l) ps[m * nb + b] += q.s[m * 16 * q.np + 8 * b + l];
  float* pc = c.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* dmin = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
      for (int64_t b = 0; b < std::min(nb, stored); ++b)
        pc[n * nb + b] = -dmin[b / 8] * static_cast<float>(r.p[2][n * r.stride[2] + b]);
    }
  });
  torch::from_blob(y, {M, N}, {ldy, 1}).add_(torch::mm(sx, c.t()));
}

// y [M, N] = x [M, K] @ [W_1; W_2; ...]^T over the segments (a fused qkv or gate_up), x
// quantised per block once for all of them (see above) and each segment's outputs written into
// its columns of y; x contiguous fp32.
inline void int8_matmul(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
  const QX q = quantise_x(x, M, segs[0].r.K);
  for (const Seg& g : segs) {
    const Rows& r = g.r;
    float* yg = y + g.off;
    switch (r.fmt) {
      case Q8_0: int8_fmt<Q8_0, 8, 2>(r, q, M, g.n, yg, N); break;
      case Q4_0: int8_fmt<Q4_0, 8, 2>(r, q, M, g.n, yg, N); break;
      case INT8: int8_fmt<INT8, 8, 2>(r, q, M, g.n, yg, N); break;
      case INT4: int8_fmt<INT4, 8, 2>(r, q, M, g.n, yg, N); break;
      default:
        int8_fmt<Q4_K_M, 8, 2>(r, q, M, g.n, yg, N);
        add_offsets(r, q, M, g.n, yg, N);
    }
  }
}
#endif
