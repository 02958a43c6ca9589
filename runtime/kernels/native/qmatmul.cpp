// y[M, N] = x[M, K] @ W^T for a weight W [N, K] held packed (hetplan.runtime.kernels.quant) or
// in a 16-bit float dtype, reading the packed bytes: no whole-weight dequantisation.
//
// Every format stores each output row on its own (quant.row_parts): for row n, block b of 32
// values (the row zero-padded to whole blocks; int8/int4 scale whole rows):
//   q8_0   w = d[n, b] * q[n, 32 b + t]                         d fp16, q int8
//   q4_0   w = d[n, b] * (nib - 8), byte 16 b + j holds t = j (low) and t = j + 16 (high)
//   int8   w = d[n] * q[n, k]                                   d fp32, q int8 [N, K]
//   int4   w = d[n] * (nib(k) - 8), byte k / 2, low nibble for even k
//   q4_k_m w = d[n, b] * nib - dmin[n, b / 8] * m[n, b], nibbles as int4 within the row
//   bf16/fp16: w = float(W[n, k])
// Small M (decode): each thread takes a range of rows n; per block the 32 weights are
// dequantised into registers and multiplied with every row of x (fp32 accumulation), so the
// weight bytes are read once per call. Large M (prefill), on a CPU with AVX-512 VNNI, for the
// quantised formats: x is quantised per block of 32 as q8_0 is (dx = max|x_b| / 127,
// qx = round(x / dx)) and each block's dot product is taken in int8 (qint8.h); elsewhere (and
// where the caller asks for it, int8 = false) a tile of rows is dequantised into an fp32
// scratch that stays in cache and multiplied by at::mm.
// Plain C++ written for the compiler's vectoriser (built with -O3 and the host's -march); it
// runs correctly on any x86-64 or ARM CPU the compiler targets.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <atomic>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HETPLAN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HETPLAN_AVX2 1
#endif
#include <type_traits>
#include <vector>

namespace {

enum Fmt { Q8_0 = 0, Q4_0 = 1, INT8 = 2, INT4 = 3, Q4_K_M = 4, BF16 = 5, FP16 = 6, FP32 = 7 };

struct Rows {
  int fmt;
  int64_t K;
  const uint8_t* p[4];   // the row_parts arrays, each [N, count]
  int64_t stride[4];     // bytes per row of each array
};

inline float h2f(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The 32 weights of block b of row n into out (zeros past K).
template <int FMT>
inline void block(const Rows& r, int64_t n, int64_t b, float* __restrict out) {
  const int64_t k0 = 32 * b;
  const int64_t valid = std::min<int64_t>(32, r.K - k0);
  switch (FMT) {
    case Q8_0: {
      const float d = h2f(r.p[0] + n * r.stride[0] + 2 * b);
      const int8_t* q = reinterpret_cast<const int8_t*>(r.p[1] + n * r.stride[1] + k0);
      for (int t = 0; t < 32; ++t) out[t] = d * static_cast<float>(q[t]);
      break;
    }
    case Q4_0: {
      const float d = h2f(r.p[0] + n * r.stride[0] + 2 * b);
      const uint8_t* q = r.p[1] + n * r.stride[1] + 16 * b;
      for (int j = 0; j < 16; ++j) {
        out[j] = d * static_cast<float>(static_cast<int>(q[j] & 15) - 8);
        out[j + 16] = d * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
      }
      break;
    }
    case INT8: {
      const float d = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
      const int8_t* q = reinterpret_cast<const int8_t*>(r.p[1] + n * r.stride[1] + k0);
      if (valid == 32) {
        for (int t = 0; t < 32; ++t) out[t] = d * static_cast<float>(q[t]);
      } else {
        for (int t = 0; t < 32; ++t) out[t] = t < valid ? d * static_cast<float>(q[t]) : 0.f;
      }
      break;
    }
    case INT4: {
      const float d = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
      const uint8_t* q = r.p[1] + n * r.stride[1] + 16 * b;
      if (valid == 32) {
        for (int j = 0; j < 16; ++j) {
          out[2 * j] = d * static_cast<float>(static_cast<int>(q[j] & 15) - 8);
          out[2 * j + 1] = d * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
        }
      } else {
        for (int t = 0; t < 32; ++t) {
          const int nib = t & 1 ? q[t / 2] >> 4 : q[t / 2] & 15;
          out[t] = t < valid ? d * static_cast<float>(nib - 8) : 0.f;
        }
      }
      break;
    }
    case Q4_K_M: {
      const float dmin = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0] + 4 * (b / 8));
      const float d = h2f(r.p[1] + n * r.stride[1] + 2 * b);
      const float m = dmin * static_cast<float>(r.p[2][n * r.stride[2] + b]);
      const uint8_t* q = r.p[3] + n * r.stride[3] + 16 * b;
      for (int j = 0; j < 16; ++j) {
        out[2 * j] = d * static_cast<float>(q[j] & 15) - m;
        out[2 * j + 1] = d * static_cast<float>(q[j] >> 4) - m;
      }
      break;
    }
    case BF16: {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(r.p[0] + n * r.stride[0]) + k0;
      if (valid == 32) {
        for (int t = 0; t < 32; ++t) {
          const uint32_t bits = static_cast<uint32_t>(w[t]) << 16;
          std::memcpy(out + t, &bits, 4);
        }
      } else {
        for (int t = 0; t < 32; ++t) {
          const uint32_t bits = t < valid ? static_cast<uint32_t>(w[t]) << 16 : 0u;
          std::memcpy(out + t, &bits, 4);
        }
      }
      break;
    }
    case FP16: {
      const c10::Half* w = reinterpret_cast<const c10::Half*>(r.p[0] + n * r.stride[0]) + k0;
      for (int t = 0; t < 32; ++t) out[t] = t < valid ? static_cast<float>(w[t]) : 0.f;
      break;
    }
    case FP32: {
      const float* w = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]) + k0;
      for (int t = 0; t < 32; ++t) out[t] = t < valid ? w[t] : 0.f;
      break;
    }
  }
}

Rows rows_of(int64_t fmt, int64_t K, const std::vector<torch::Tensor>& parts) {
  TORCH_CHECK(fmt >= Q8_0 && fmt <= FP32, "qmatmul: unknown format id ", fmt);
  TORCH_CHECK(!parts.empty() && parts.size() <= 4, "qmatmul: 1 to 4 packed arrays");
  Rows r{static_cast<int>(fmt), K, {nullptr, nullptr, nullptr, nullptr}, {0, 0, 0, 0}};
  const int64_t N = parts[0].size(0);
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& t = parts[i];
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == N && t.stride(1) == 1,
                "qmatmul: packed array ", i, " must be a CPU [N, count] row-major view");
    r.p[i] = static_cast<const uint8_t*>(t.data_ptr());
    r.stride[i] = t.stride(0) * t.element_size();
  }
  return r;
}

constexpr int64_t SMALL_M = 8;   // rows of x up to which the direct kernel runs

// Weight bytes a decode thread takes at a time (dynamic_for's chunk).
constexpr int64_t CHUNK_BYTES = int64_t(1) << 18;

// f(a, e) over [0, n) in chunks of `chunk` items, each handed to whichever of torch's intra-op
// threads is free next (an atomic counter), not one fixed share per thread: on a shared host a
// vCPU held up for a few milliseconds in the middle of a GEMV delays only the chunk it holds,
// while the other threads take the rest. Inline where there is one thread or one chunk.
template <class F>
inline void dynamic_for(int64_t n, int64_t chunk, F f) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// Rows of weight r per dynamic_for chunk: about CHUNK_BYTES of them (a row's bytes with its
// scales; int8 / int4's one fp32 scale per row left out), a multiple of 16.
inline int64_t chunk_rows(const Rows& r) {
  static constexpr int64_t per32[] = {34, 18, 32, 16, 18, 64, 64, 128};   // bytes per 32 weights, by Fmt
  const int64_t row_bytes = (r.K + 31) / 32 * per32[r.fmt];
  return std::max<int64_t>(16, CHUNK_BYTES / std::max<int64_t>(1, row_bytes) / 16 * 16);
}

// f(std::integral_constant<int, fmt>{}) for a quantised format: the kernels' format as a
// compile-time constant.
template <class F>
inline void with_quantised(int fmt, F f) {
  switch (fmt) {
    case Q8_0: return f(std::integral_constant<int, Q8_0>{});
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case INT8: return f(std::integral_constant<int, INT8>{});
    case INT4: return f(std::integral_constant<int, INT4>{});
    default: return f(std::integral_constant<int, Q4_K_M>{});
  }
}

// f(std::integral_constant<int, m>{}) for m = rows in 1..SMALL_M (more: SMALL_M): the kernels'
// row count as a compile-time constant, so that their accumulators stay in registers.
template <class F>
inline void with_rows(int64_t rows, F f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

struct Seg {                      // one linear of a fused weight: its rows, at columns [off, off + n) of y
  Rows r;
  int64_t off, n;
};

// f(seg, n0, n1) for the part [n0, n1) (the segment's own rows) of each segment that [a, e) covers.
template <class F>
inline void over_segments(const std::vector<Seg>& segs, int64_t a, int64_t e, F f) {
  for (const Seg& g : segs) {
    const int64_t lo = std::max(a, g.off), hi = std::min(e, g.off + g.n);
    if (lo < hi) f(g, lo - g.off, hi - g.off);
  }
}

#if defined(HETPLAN_AVX512) || defined(HETPLAN_AVX2)
// The sum of the 8 lanes of v.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float h2f_fast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The scale of block b of row n: fp16 per block (q8_0, q4_0), fp32 per row (int8, int4).
template <int FMT>
inline float block_scale(const Rows& r, int64_t n, int64_t b) {
  return FMT == Q8_0 || FMT == Q4_0 ? h2f_fast(r.p[0] + n * r.stride[0] + 2 * b)
                                    : *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]);
}

// A 16/32-bit weight row is streamed once: prefetch its block b + 8 past L2/L3 (see qdecode.h).
template <int FMT>
inline void stream_ahead(const Rows& r, int64_t n, int64_t b) {
  if (FMT == BF16 || FMT == FP16 || FMT == FP32) {
    const char* ahead = reinterpret_cast<const char*>(r.p[0] + n * r.stride[0]) + (FMT == FP32 ? 128 : 64) * b + 1024;
    _mm_prefetch(ahead, _MM_HINT_NTA);
    if (FMT == FP32) _mm_prefetch(ahead + 64, _MM_HINT_NTA);
  }
}
#endif

#ifdef HETPLAN_AVX512
// 16 values from p as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512 nib_lo(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(15)))); }
inline __m512 nib_hi(__m128i v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15))));
}

// Block b of row n (a whole block, inside K) as two vectors: values t = 0..15 and 16..31.
template <int FMT>
inline void block_vec(const Rows& r, int64_t n, int64_t b, __m512& w0, __m512& w1) {
  const int64_t k0 = 32 * b;
  if (FMT == Q8_0 || FMT == INT8) {
    const __m512 vd = _mm512_set1_ps(block_scale<FMT>(r, n, b));
    const uint8_t* q = r.p[1] + n * r.stride[1] + k0;
    w0 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
    w1 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))));
  } else if (FMT == Q4_0) {
    const __m512 vd = _mm512_set1_ps(block_scale<FMT>(r, n, b));
    const __m512 eight = _mm512_set1_ps(8.f);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.p[1] + n * r.stride[1] + 16 * b));
    w0 = _mm512_mul_ps(vd, _mm512_sub_ps(nib_lo(v), eight));
    w1 = _mm512_mul_ps(vd, _mm512_sub_ps(nib_hi(v), eight));
  } else if (FMT == INT4 || FMT == Q4_K_M) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        (FMT == INT4 ? r.p[1] + n * r.stride[1] : r.p[3] + n * r.stride[3]) + 16 * b));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
    if (FMT == INT4) {
      const __m512 vd = _mm512_set1_ps(block_scale<FMT>(r, n, b));
      const __m512 eight = _mm512_set1_ps(8.f);
      w0 = _mm512_mul_ps(vd, _mm512_sub_ps(a, eight));
      w1 = _mm512_mul_ps(vd, _mm512_sub_ps(c, eight));
    } else {
      const float dmin = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0] + 4 * (b / 8));
      const __m512 vd = _mm512_set1_ps(h2f_fast(r.p[1] + n * r.stride[1] + 2 * b));
      const __m512 vm = _mm512_set1_ps(dmin * static_cast<float>(r.p[2][n * r.stride[2] + b]));
      w0 = _mm512_fmsub_ps(vd, a, vm);
      w1 = _mm512_fmsub_ps(vd, c, vm);
    }
  } else if (FMT == BF16) {
    const auto* w = reinterpret_cast<const c10::BFloat16*>(r.p[0] + n * r.stride[0]) + k0;
    w0 = load16(w);
    w1 = load16(w + 16);
  } else if (FMT == FP32) {
    const float* w = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]) + k0;
    w0 = load16(w);
    w1 = load16(w + 16);
  } else {
    const auto* w = reinterpret_cast<const c10::Half*>(r.p[0] + n * r.stride[0]) + k0;
    w0 = load16(w);
    w1 = load16(w + 16);
  }
}
#endif

#ifdef HETPLAN_AVX2
// 8 values from p as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Bytes 0..7 and 8..15 of v, unsigned, as fp32.
inline __m256 u8_lo(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 u8_hi(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))); }

// Block b of row n (a whole block, inside K) as four vectors: values 8 i .. 8 i + 7.
template <int FMT>
inline void block_vec(const Rows& r, int64_t n, int64_t b, __m256 (&w)[4]) {
  const int64_t k0 = 32 * b;
  if (FMT == Q8_0 || FMT == INT8) {
    const __m256 vd = _mm256_set1_ps(block_scale<FMT>(r, n, b));
    const uint8_t* q = r.p[1] + n * r.stride[1] + k0;
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))));
  } else if (FMT == Q4_0 || FMT == INT4 || FMT == Q4_K_M) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        (FMT == Q4_0 || FMT == INT4 ? r.p[1] + n * r.stride[1] : r.p[3] + n * r.stride[3]) + 16 * b));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
    __m128i first = lo, second = hi;        // q4_0: values 0..15 low nibbles, 16..31 high
    if (FMT != Q4_0) {                      // int4, q4_k_m: value 2 j low, 2 j + 1 high nibble of byte j
      first = _mm_unpacklo_epi8(lo, hi);
      second = _mm_unpackhi_epi8(lo, hi);
    }
    w[0] = u8_lo(first), w[1] = u8_hi(first), w[2] = u8_lo(second), w[3] = u8_hi(second);
    if (FMT == Q4_K_M) {
      const float dmin = *reinterpret_cast<const float*>(r.p[0] + n * r.stride[0] + 4 * (b / 8));
      const __m256 vd = _mm256_set1_ps(h2f_fast(r.p[1] + n * r.stride[1] + 2 * b));
      const __m256 vm = _mm256_set1_ps(dmin * static_cast<float>(r.p[2][n * r.stride[2] + b]));
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmsub_ps(vd, w[i], vm);
    } else {
      const __m256 vd = _mm256_set1_ps(block_scale<FMT>(r, n, b)), eight = _mm256_set1_ps(8.f);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(vd, _mm256_sub_ps(w[i], eight));
    }
  } else if (FMT == BF16) {
    const auto* p = reinterpret_cast<const c10::BFloat16*>(r.p[0] + n * r.stride[0]) + k0;
    for (int i = 0; i < 4; ++i) w[i] = load8(p + 8 * i);
  } else if (FMT == FP32) {
    const float* p = reinterpret_cast<const float*>(r.p[0] + n * r.stride[0]) + k0;
    for (int i = 0; i < 4; ++i) w[i] = load8(p + 8 * i);
  } else {
    const auto* p = reinterpret_cast<const c10::Half*>(r.p[0] + n * r.stride[0]) + k0;
    for (int i = 0; i < 4; ++i) w[i] = load8(p + 8 * i);
  }
}

#endif

#include "qint8.h"
#include "qdecode.h"
#include "qdecode_avx2.h"
#include "smallops.h"

// Rows [n0, n1) of y for M rows of x (padded to Kp): FMT and M known at compile time, so the
// block's 32 weights and the M accumulators stay in vector registers (AVX-512 intrinsics where
// the compiler targets them, else AVX2 + FMA + F16C ones; the portable loop otherwise, and for a
// row's partial last block).
template <int FMT, int M>
void direct_rows(const Rows& r, const float* __restrict x, int64_t Kp, float* __restrict y, int64_t ldy,
                 int64_t n0, int64_t n1) {
  const int64_t nb = Kp / 32, whole = r.K / 32;
  alignas(64) float w[32];
  for (int64_t n = n0; n < n1; ++n) {
#ifdef HETPLAN_AVX512
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < whole; ++b) {
      stream_ahead<FMT>(r, n, b);
      __m512 w0, w1;
      block_vec<FMT>(r, n, b, w0, w1);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * Kp + 32 * b;
        acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w1, acc[m][1]);
      }
    }
    for (int64_t b = whole; b < nb; ++b) {
      block<FMT>(r, n, b, w);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * Kp + 32 * b;
        acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), _mm512_load_ps(w), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), _mm512_load_ps(w + 16), acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#elif defined(HETPLAN_AVX2)
    __m256 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 wv[4];
      if (b < whole) {
        stream_ahead<FMT>(r, n, b);
        block_vec<FMT>(r, n, b, wv);
      } else {                               // a row's partial last block, zero-padded
        block<FMT>(r, n, b, w);
        for (int i = 0; i < 4; ++i) wv[i] = _mm256_load_ps(w + 8 * i);
      }
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * Kp + 32 * b;
        for (int i = 0; i < 4; ++i) acc[m][i] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * i), wv[i], acc[m][i]);
      }
    }
    for (int m = 0; m < M; ++m)
      y[m * ldy + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
#else
    alignas(64) float acc[M][32];
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < 32; ++t) acc[m][t] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      block<FMT>(r, n, b, w);
      for (int m = 0; m < M; ++m) {
        const float* __restrict xb = x + m * Kp + 32 * b;
        for (int t = 0; t < 32; ++t) acc[m][t] += xb[t] * w[t];
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int t = 0; t < 32; ++t) s += acc[m][t];
      y[m * ldy + n] = s;
    }
#endif
  }
}

// Rows [a, e) of W into o (rows of K fp32 values, row n at o + (n - n0) * K).
template <int FMT>
void dequantise_rows(const Rows& r, int64_t n0, int64_t a, int64_t e, float* o) {
  const int64_t K = r.K, nb = (K + 31) / 32, whole = K / 32;
  alignas(64) float w[32];
  for (int64_t n = a; n < e; ++n) {
    float* row = o + (n - n0) * K;
    int64_t b = 0;
#ifdef HETPLAN_AVX512
    for (; b < whole; ++b) {
      __m512 w0, w1;
      block_vec<FMT>(r, n, b, w0, w1);
      _mm512_storeu_ps(row + 32 * b, w0);
      _mm512_storeu_ps(row + 32 * b + 16, w1);
    }
#elif defined(HETPLAN_AVX2)
    for (; b < whole; ++b) {
      __m256 wv[4];
      block_vec<FMT>(r, n, b, wv);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(row + 32 * b + 8 * i, wv[i]);
    }
#endif
    for (; b < nb; ++b) {
      block<FMT>(r, n, b, w);
      std::memcpy(row + 32 * b, w, sizeof(float) * std::min<int64_t>(32, K - 32 * b));
    }
  }
}

// y [M, N] (N the segments' rows together) for M <= SMALL_M, one parallel region for all segments.
template <int FMT>
void direct_fmt(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, int64_t Kp, float* y) {
  dynamic_for(N, chunk_rows(segs[0].r), [&](int64_t a, int64_t e) {
    over_segments(segs, a, e, [&](const Seg& g, int64_t n0, int64_t n1) {
      const Rows& r = g.r;
      float* yg = y + g.off;
      with_rows(M, [&](auto m) { direct_rows<FMT, decltype(m)::value>(r, x, Kp, yg, N, n0, n1); });
    });
  });
}

void direct(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, int64_t Kp, float* y) {
  switch (segs[0].r.fmt) {
    case Q8_0: return direct_fmt<Q8_0>(segs, x, M, N, Kp, y);
    case Q4_0: return direct_fmt<Q4_0>(segs, x, M, N, Kp, y);
    case INT8: return direct_fmt<INT8>(segs, x, M, N, Kp, y);
    case INT4: return direct_fmt<INT4>(segs, x, M, N, Kp, y);
    case Q4_K_M: return direct_fmt<Q4_K_M>(segs, x, M, N, Kp, y);
    case BF16: return direct_fmt<BF16>(segs, x, M, N, Kp, y);
    case FP16: return direct_fmt<FP16>(segs, x, M, N, Kp, y);
    default: return direct_fmt<FP32>(segs, x, M, N, Kp, y);
  }
}

}  // namespace

// W's rows [n0, n1) dequantised into out [n1 - n0, K] (fp32).
void dequantise(int64_t fmt, int64_t K, std::vector<torch::Tensor> parts, int64_t n0, int64_t n1,
                torch::Tensor out) {
  const Rows r = rows_of(fmt, K, parts);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kFloat32 && out.size(0) == n1 - n0 &&
              out.size(1) == K, "dequantise: out must be a contiguous fp32 [n1 - n0, K] tensor");
  float* o = out.data_ptr<float>();
  at::parallel_for(n0, n1, 4, [&](int64_t a, int64_t e) {
    switch (r.fmt) {
      case Q8_0: return dequantise_rows<Q8_0>(r, n0, a, e, o);
      case Q4_0: return dequantise_rows<Q4_0>(r, n0, a, e, o);
      case INT8: return dequantise_rows<INT8>(r, n0, a, e, o);
      case INT4: return dequantise_rows<INT4>(r, n0, a, e, o);
      case Q4_K_M: return dequantise_rows<Q4_K_M>(r, n0, a, e, o);
      case BF16: return dequantise_rows<BF16>(r, n0, a, e, o);
      case FP16: return dequantise_rows<FP16>(r, n0, a, e, o);
      default: return dequantise_rows<FP32>(r, n0, a, e, o);
    }
  });
}

#if defined(HETPLAN_VNNI) || defined(HETPLAN_INT8_AVX2)
#define HETPLAN_INT8 1
// y [M, N] = x [M, K] @ W^T with x quantised per block of 32 and multiplied in int8.
inline void int8_rows(const std::vector<Seg>& segs, const float* x, int64_t M, int64_t N, float* y) {
#ifdef HETPLAN_VNNI
  if (M <= SMALL_M) return vnni_decode(segs, x, M, N, y);
  return int8_matmul(segs, x, M, N, y);
#else
  return avx2_int8(segs, x, M, N, y);
#endif
}
#endif

bool has_int8() {
#ifdef HETPLAN_INT8
  return true;
#else
  return false;
#endif
}

// x [M, K] fp32 -> y [M, N] fp32 with W (format fmt, arrays parts, N rows of K values); for
// a quantised format, int8 = true multiplies in int8 where has_int8() (x quantised per block of
// 32: with VNNI qdecode.h for M <= SMALL_M and qint8.h beyond, with AVX2 qdecode_avx2.h); the
// fp32 paths run otherwise.
torch::Tensor matmul_cat(torch::Tensor x, int64_t fmt, int64_t K, std::vector<std::vector<torch::Tensor>> segments,
                         bool int8);

torch::Tensor matmul(torch::Tensor x, int64_t fmt, int64_t K, std::vector<torch::Tensor> parts, bool int8) {
  return matmul_cat(x, fmt, K, {parts}, int8);
}

// The same for several weights of one format and width (a fused qkv or gate_up: each its own
// row arrays), their outputs side by side in one y [M, sum of rows]: x is read (and, in int8,
// quantised) once, and decode runs one parallel region over all their rows.
torch::Tensor matmul_cat(torch::Tensor x, int64_t fmt, int64_t K, std::vector<std::vector<torch::Tensor>> segments,
                         bool int8) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32,
              "qmatmul: x must be a CPU fp32 [M, K] tensor, K = ", K);
  TORCH_CHECK(!segments.empty(), "qmatmul: no weights");
  std::vector<Seg> segs;
  int64_t N = 0;
  for (const auto& parts : segments) {
    const Rows r = rows_of(fmt, K, parts);
    const int64_t n = parts[0].size(0);
    segs.push_back(Seg{r, N, n});
    N += n;
  }
  const int64_t M = x.size(0), Kp = (K + 31) / 32 * 32;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  torch::Tensor xc = x.contiguous();
#ifdef HETPLAN_INT8
  if (int8 && fmt <= Q4_K_M) {   // every segment in one call: x quantised once
    int8_rows(segs, xc.data_ptr<float>(), M, N, y.data_ptr<float>());
    return y;
  }
#endif
  if (M <= SMALL_M) {
    if (Kp != K) xc = torch::constant_pad_nd(xc, {0, Kp - K});
    direct(segs, xc.data_ptr<float>(), M, N, Kp, y.data_ptr<float>());
    return y;
  }
  for (size_t s = 0; s < segs.size(); ++s) {
    const Seg& g = segs[s];
    if (segs.size() > 1) {
      y.narrow(1, g.off, g.n).copy_(matmul_cat(xc, fmt, K, {segments[s]}, int8));
      continue;
    }
    // a tile of about 1 MiB of fp32 weights, in cache while at::mm reads it
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(N, (int64_t(1) << 18) / Kp / 16 * 16));
    auto scratch = torch::empty({tile, K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
      const int64_t n1 = std::min(N, n0 + tile);
      auto w = scratch.narrow(0, 0, n1 - n0);
      dequantise(fmt, K, segments[s], n0, n1, w);
      y.narrow(1, n0, n1 - n0).copy_(torch::mm(xc, w.t()));
    }
  }
  return y;
}

// How many threads one of this library's parallel regions runs on over n items (grain 1): the
// threads torch.set_num_threads gives it when the library is built with OpenMP, 1 otherwise.
int64_t parallel_threads(int64_t n) {
  std::vector<std::atomic<int>> seen(64);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[std::min<int64_t>(63, at::get_thread_num())] = 1; });
  int64_t count = 0;
  for (auto& s : seen) count += s.load();
  return count;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "y = x @ W^T, W packed (format id, K, row arrays, int8)");
  m.def("matmul_cat", &matmul_cat, "y = x @ [W_1; W_2; ...]^T, each W packed (format id, K, row arrays of each, int8)");
  m.def("has_int8", &has_int8, "whether the quantised formats can multiply x in int8 (AVX-512 VNNI or AVX2)");
  m.def("dequantise", &dequantise, "rows [n0, n1) of a packed W into an fp32 tensor");
  m.def("parallel_threads", &parallel_threads, "threads one parallel region of this library runs on");
  m.def("rms_norm", &rms_norm, "w * (x * rsqrt(mean(x^2) + eps)).to(dtype) over the last dim");
  m.def("rope_", &rope_, "rotary embeddings in place on the first heads of each row of a fused q|k|v");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [..., 2 I] gate|up");
  m.def("decode_attention", &decode_attention, "one query per sequence over its cached keys and values");
}
