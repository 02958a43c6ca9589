// The small per-token ops of a decoder layer in one call each: RMSNorm, rotary embeddings in
// place on a fused q|k|v row, SiLU(gate) * up and a decode step's attention. Included by
// qmatmul.cpp inside its namespace.
//
// Between two GEMVs that stream their weights from DRAM, each separate torch op (and the
// interpreter running it) starts from cold caches; a layer's norms and rope were ~26 such ops.
// Each function here computes what the torch expression beside it computes, rounding to the
// tensor's dtype (fp32, bf16, fp16) exactly where torch's elementwise ops round, so a 16-bit run
// differs from the torch path only in the order of a norm's sum of squares (fp32 accumulation).
// Rows are independent: threads take whole rows when there are many.

template <class T>
inline float to_f(T v) { return static_cast<float>(v); }
template <class T>
inline T from_f(float v) { return static_cast<T>(v); }   // c10's round-to-nearest-even for bf16 / fp16

// out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)).to(dtype), the mean taken in fp32
// (torch: weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).
template <class T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, rows * D >= (1 << 16) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* o = out + r * D;
      float ss = 0.f;
      for (int64_t i = 0; i < D; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      for (int64_t i = 0; i < D; ++i) o[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(xr[i]) * inv)));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
              w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: contiguous CPU x [..., D] and weight [D] of x's dtype");
  auto out = torch::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, D,
                            static_cast<float>(eps));
  });
  return out;
}

// In place on the first (hq + hk) heads of each row of y [rows, >= (hq + hk) * hd] (a fused
// q|k|v projection; row r is position start + r % S): x * cos + rotate_half(x) * sin with the
// position's row of the cos / sin tables [T, hd] (rotate_half([a, b]) = [-b, a]).
template <class T>
void rope_rows(T* y, int64_t ld, const T* cos, const T* sin, int64_t rows, int64_t S, int64_t start, int64_t heads,
               int64_t hd) {
  const int64_t half = hd / 2;
  at::parallel_for(0, rows, rows >= 64 ? 1 : rows, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(hd);
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos + (start + r % S) * hd;
      const T* s = sin + (start + r % S) * hd;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = y + r * ld + h * hd;
        for (int64_t i = 0; i < hd; ++i) x[i] = to_f(v[i]);
        for (int64_t i = 0; i < hd; ++i) {
          const float rot = i < half ? -x[i + half] : x[i - half];
          v[i] = from_f<T>(to_f(from_f<T>(x[i] * to_f(c[i]))) + to_f(from_f<T>(rot * to_f(s[i]))));
        }
      }
    }
  });
}

void rope_(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t S, int64_t start, int64_t heads, int64_t hd) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == y.scalar_type() && sin.scalar_type() == y.scalar_type() && hd % 2 == 0 &&
              cos.size(1) == hd && S > 0 && y.size(0) % S == 0 && start + S <= cos.size(0) && heads * hd <= y.size(1),
              "rope_: y [rows, cols] with unit column stride, cos / sin [T, hd] of y's dtype covering the positions");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(y.data_ptr<scalar_t>(), y.stride(0), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        y.size(0), S, start, heads, hd);
  });
}

// g [rows, 2 I] (gate | up) -> silu(gate) * up [rows, I] (torch: F.silu(gate).mul_(up)).
torch::Tensor silu_mul(torch::Tensor g) {
  TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.size(-1) % 2 == 0, "silu_mul: contiguous CPU [..., 2 I]");
  const int64_t I = g.size(-1) / 2, rows = I ? g.numel() / (2 * I) : 0;
  auto sizes = g.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_mul", [&] {
    const scalar_t* p = g.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows * I >= (1 << 16) ? 1 : rows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < I; ++i) {
          const float a = to_f(p[r * 2 * I + i]);
          o[r * I + i] = from_f<scalar_t>(to_f(from_f<scalar_t>(a / (1.f + std::exp(-a)))) * to_f(p[r * 2 * I + I + i]));
        }
    });
  });
  return out;
}

// sum_i a[i] * b[i] in fp32, 16 lanes at a time where AVX-512 is and n allows, else two chains of
// 8 with AVX2 (a scalar chain of FMAs waits on each one: on a 2-core AVX2 EPYC decode attention over
// 128 cached tokens took 175 us a layer that way).
template <class T>
inline float dot_f(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float out = 0.f;
#ifdef HETPLAN_AVX512
  if constexpr (!std::is_same<T, double>::value) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
    out = _mm512_reduce_add_ps(acc);
  }
#elif defined(HETPLAN_AVX2)
  if constexpr (!std::is_same<T, double>::value) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
    }
    if (i + 8 <= n) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
      i += 8;
    }
    out = hsum8(_mm256_add_ps(acc0, acc1));
  }
#endif
  for (; i < n; ++i) out += a[i] * to_f(b[i]);
  return out;
}

// One new query per sequence over its cached keys: o [B, 1, H hd] = softmax(q k^T * scale) v over
// positions [0, T) (torch: scaled_dot_product_attention with the G = H / KVH query heads of a
// key/value head sharing it), q [B, 1, H, hd], k / v [B, T, KVH, hd] views whose (head, dim) rows
// are contiguous; scores, softmax and sums in fp32, the output rounded once to the dtype.
// Threads take (sequence, key/value head) pairs when the cache is long enough to share.
template <class T>
void decode_attention_heads(const T* q, int64_t qs0, const T* k, int64_t ks0, int64_t ks1, const T* v, int64_t vs0,
                            int64_t vs1, T* o, int64_t B, int64_t H, int64_t KVH, int64_t hd, int64_t len, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, len * H * hd >= (1 << 17) ? 1 : B * KVH, [&](int64_t p0, int64_t p1) {
    std::vector<float> qf(G * hd), s(G * len), acc(G * hd);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / KVH, h = p % KVH;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i) qf[g * hd + i] = to_f(q[b * qs0 + (h * G + g) * hd + i]);
      for (int64_t t = 0; t < len; ++t) {
        const T* kt = k + b * ks0 + t * ks1 + h * hd;
        for (int64_t g = 0; g < G; ++g) s[g * len + t] = dot_f(qf.data() + g * hd, kt, hd) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[g * len + t]);
        for (int64_t t = 0; t < len; ++t) sum += (s[g * len + t] = std::exp(s[g * len + t] - mx));
        for (int64_t t = 0; t < len; ++t) s[g * len + t] /= sum;
      }
      for (int64_t t = 0; t < len; ++t) {
        const T* vt = v + b * vs0 + t * vs1 + h * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float w = s[g * len + t];
          for (int64_t i = 0; i < hd; ++i) acc[g * hd + i] += w * to_f(vt[i]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < hd; ++i) o[b * H * hd + (h * G + g) * hd + i] = from_f<T>(acc[g * hd + i]);
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(1) == 1 &&
              k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 &&
              q.size(2) % k.size(2) == 0 && q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: q [B, 1, H, hd], k / v [B, T, KVH, hd] of q's dtype");
  const int64_t hd = q.size(3);
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.stride(3) == 1 && t.stride(2) == hd, "decode_attention: each (head, dim) row contiguous");
  const int64_t B = q.size(0), H = q.size(2), KVH = k.size(2), len = k.size(1);
  auto o = torch::empty({B, 1, H * hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_heads<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k.data_ptr<scalar_t>(), k.stride(0),
                                     k.stride(1), v.data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                                     o.data_ptr<scalar_t>(), B, H, KVH, hd, len, static_cast<float>(scale));
  });
  return o;
}
