// bfloat16 matrix products with the bits of torch's reference CPU loop, fast:
// TORCH_EXTENSION_NAME::bf16_addmm_out_. Built into the same library as the 8-bit Adam
// kernel (_kernels/_native.py); _kernels/_bf16_matmul.py decides where it may run.
//
// On a CPU that oneDNN cannot run bfloat16 products on (no AVX-512 and no AMX: AVX2 CPUs
// such as AMD Zen 3), torch's bfloat16 mm / addmm / bmm take its reference loop
// (aten's cpublas gemm_stub), far slower than float32 there (figures in
// docs/decisions.md): it is what Newton-Schulz runs on. addmm_one gives its bits. Its
// arithmetic, for each output element:
//
//   s_r = sum over l = r, r + 4, r + 8, ... < 4 floor(k / 4) of a_il b_lj   (r = 0..3, in
//         order of l; the last k mod 4 terms go into s_0), each product and each sum
//         one float32 rounding (products of bfloat16 values are exact in float32; the
//         sums are not fused with them);
//   s   = ((s_0 + s_1) + s_2) + s_3;
//   out = bf16(alpha s)                       if beta == 0,
//         bf16(fma(beta, c, alpha s))         otherwise (one rounding of beta c + alpha s),
//
// bf16() rounding to nearest even (NaN to 0x7FC0), alpha and beta rounded to float32.
// This file computes the same values in the same order, eight outputs of a row at a time
// (one AVX2 lane each, four accumulators per lane), so the bits are equal whatever the
// CPU; _bf16_matmul.py checks them against torch on every process before using it, since
// a torch build may route a product elsewhere (measured: docs/performance.md).
//
// A product with a transposed second operand, a @ b.T with both row-major (Newton-Schulz's
// X X^T), takes another loop instead, one vectorized dot product per output (aten's
// bf16_dot_with_fp32_arith, ~10 GFLOP/s on AVX2); mm_nt_one gives its bits. For each
// output, of rows a_i and b_j,
//
//   acc[t] = fused multiply-adds of a_il b_jl over l = t, t + 64, t + 128, ... below
//            64 floor(k / 64)   (t = 0..63: eight registers of eight lanes, t = 8r + lane);
//   s      = the registers summed r + 4 into r, then r + 2, then r + 1 (lanewise), then
//            the lanes of what is left: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7));
//   s     += the same lane sum of an 8-lane accumulator of fused multiply-adds over the
//            rest below 16 floor(k / 16), in order (16 at a time: 8 lanes, then the next 8);
//   s     += a_il b_jl for the last k mod 16 terms one by one (product, then sum; unfused);
//   out    = bf16(s).
//
// Here each output's 64 accumulators are computed register by register (eight passes over
// the rows, each taking every eighth 8-float run) for a 3 x 3 tile of outputs at once, so
// nine outputs share each load; the accumulators, their order and every rounding are
// those above.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 8;  // outputs of a row computed together (one AVX2 vector)

inline float from_bf16(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint16_t to_bf16(float f) {  // c10's round_to_nearest_even
    if (std::isnan(f)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// sums[i * 8 + q] = the ordered four-way sum of row i of a (rows R, stride k) with
// column q of the packed panel bp (k x 8)
template <int R>
inline void panel_sums(const float* a, int64_t k, const float* bp, float* sums) {
#if defined(__AVX2__)
    __m256 acc[R][4];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
    const int64_t k4 = k & ~int64_t{3};
    int64_t l = 0;
    for (; l < k4; l += 4) {
        for (int r = 0; r < 4; ++r) {
            const __m256 bv = _mm256_loadu_ps(bp + (l + r) * kLanes);
            for (int i = 0; i < R; ++i) {
                const __m256 prod = _mm256_mul_ps(_mm256_broadcast_ss(a + i * k + l + r), bv);
                acc[i][r] = _mm256_add_ps(acc[i][r], prod);  // not fused: -ffp-contract=off
            }
        }
    }
    for (; l < k; ++l) {
        const __m256 bv = _mm256_loadu_ps(bp + l * kLanes);
        for (int i = 0; i < R; ++i)
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(_mm256_broadcast_ss(a + i * k + l), bv));
    }
    for (int i = 0; i < R; ++i) {
        __m256 s = _mm256_add_ps(acc[i][0], acc[i][1]);
        s = _mm256_add_ps(s, acc[i][2]);
        s = _mm256_add_ps(s, acc[i][3]);
        _mm256_storeu_ps(sums + i * kLanes, s);
    }
#else
    for (int i = 0; i < R; ++i) {
        for (int q = 0; q < kLanes; ++q) {
            float p[4] = {0.f, 0.f, 0.f, 0.f};
            const int64_t k4 = k & ~int64_t{3};
            int64_t l = 0;
            for (; l < k4; l += 4)
                for (int r = 0; r < 4; ++r) {
                    const float prod = a[i * k + l + r] * bp[(l + r) * kLanes + q];
                    p[r] = p[r] + prod;
                }
            for (; l < k; ++l) {
                const float prod = a[i * k + l] * bp[l * kLanes + q];
                p[0] = p[0] + prod;
            }
            float s = p[0] + p[1];
            s = s + p[2];
            s = s + p[3];
            sums[i * kLanes + q] = s;
        }
    }
#endif
}

struct Mat {  // a bfloat16 matrix view: base pointer and element strides
    const uint16_t* p;
    int64_t s0, s1;
    uint16_t at(int64_t i, int64_t j) const { return p[i * s0 + j * s1]; }
};

// out (m x n, row stride ldo) = the reference loop's a (m x k) @ b (k x n), with c
void addmm_one(Mat a, Mat b, const Mat* c, int64_t m, int64_t n, int64_t k, float alpha, float beta,
               uint16_t* out, int64_t ldo) {
    std::vector<float> af(static_cast<size_t>(m * k));  // a in float32, row-major (exact)
    for (int64_t i = 0; i < m; ++i)
        for (int64_t l = 0; l < k; ++l) af[i * k + l] = from_bf16(a.at(i, l));
    const int64_t panels = (n + kLanes - 1) / kLanes;
    // a thread takes whole panels of 8 columns; every output's order is its own, so the
    // bits do not depend on the threads
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, m * k));
    at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
        std::vector<float> bp(static_cast<size_t>(k * kLanes));
        float sums[3 * kLanes];
        for (int64_t pj = p0; pj < p1; ++pj) {
            const int64_t j0 = pj * kLanes;
            const int64_t w = std::min<int64_t>(kLanes, n - j0);
            for (int64_t l = 0; l < k; ++l)
                for (int q = 0; q < kLanes; ++q)
                    bp[l * kLanes + q] = q < w ? from_bf16(b.at(l, j0 + q)) : 0.f;
            for (int64_t i0 = 0; i0 < m;) {
                const int64_t rows = std::min<int64_t>(3, m - i0);
                const float* ar = af.data() + i0 * k;
                if (rows == 3)
                    panel_sums<3>(ar, k, bp.data(), sums);
                else if (rows == 2)
                    panel_sums<2>(ar, k, bp.data(), sums);
                else
                    panel_sums<1>(ar, k, bp.data(), sums);
                for (int64_t i = 0; i < rows; ++i) {
                    for (int64_t q = 0; q < w; ++q) {
                        const float s = alpha * sums[i * kLanes + q];
                        const float v = beta == 0.f ? s : std::fma(beta, from_bf16(c->at(i0 + i, j0 + q)), s);
                        out[(i0 + i) * ldo + j0 + q] = to_bf16(v);
                    }
                }
                i0 += rows;
            }
        }
    });
}

#if defined(__AVX2__) && defined(__FMA__)
// the lane sum of torch's AVX2 vec_reduce_all (plus)
inline float lane_sum(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
    return _mm256_cvtss_f32(v);
}

// the rest of one output's dot product after its 64 accumulators (eight registers)
inline float dot_rest(const float* a, const float* b, int64_t k, __m256* x) {
    for (int i = 0; i < 4; ++i) x[i] = _mm256_add_ps(x[i], x[i + 4]);
    for (int i = 0; i < 2; ++i) x[i] = _mm256_add_ps(x[i], x[i + 2]);
    float s = lane_sum(_mm256_add_ps(x[0], x[1]));
    const int64_t k64 = k & ~int64_t{63}, k16 = k & ~int64_t{15};
    __m256 t = _mm256_setzero_ps();
    for (int64_t l = k64; l < k16; l += 16) {
        t = _mm256_fmadd_ps(_mm256_loadu_ps(a + l), _mm256_loadu_ps(b + l), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(a + l + 8), _mm256_loadu_ps(b + l + 8), t);
    }
    s = s + lane_sum(t);  // always added, as torch does (-0 + 0 is +0)
    for (int64_t l = k16; l < k; ++l) {
        const float prod = a[l] * b[l];
        s = s + prod;
    }
    return s;
}

// out (m x n, row-major) = a (m x k) @ b (n x k).T with the dot-product loop's bits
void mm_nt_one(const float* af, const float* bf, int64_t m, int64_t n, int64_t k, uint16_t* out) {
    constexpr int T = 3;  // a T x T tile of outputs shares each load
    const int64_t k64 = k & ~int64_t{63};
    const int64_t tiles_i = (m + T - 1) / T, tiles_j = (n + T - 1) / T;
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, T * n * k));
    at::parallel_for(0, tiles_i, grain, [&](int64_t t0, int64_t t1) {
        __m256 acc8[T][T][8];
        for (int64_t ti = t0; ti < t1; ++ti) {
            const int64_t i0 = ti * T;
            const int ri = static_cast<int>(std::min<int64_t>(T, m - i0));
            const float* ar[T];
            for (int i = 0; i < T; ++i) ar[i] = af + std::min<int64_t>(i0 + i, m - 1) * k;
            for (int64_t tj = 0; tj < tiles_j; ++tj) {
                const int64_t j0 = tj * T;
                const int rj = static_cast<int>(std::min<int64_t>(T, n - j0));
                const float* br[T];
                for (int j = 0; j < T; ++j) br[j] = bf + std::min<int64_t>(j0 + j, n - 1) * k;
                for (int r = 0; r < 8; ++r) {  // register r: elements 8r..8r+7 of every 64
                    __m256 acc[T][T];
                    for (int i = 0; i < T; ++i)
                        for (int j = 0; j < T; ++j) acc[i][j] = _mm256_setzero_ps();
                    for (int64_t l = 8 * r; l < k64; l += 64) {
                        __m256 av[T], bv[T];
                        for (int i = 0; i < T; ++i) av[i] = _mm256_loadu_ps(ar[i] + l);
                        for (int j = 0; j < T; ++j) bv[j] = _mm256_loadu_ps(br[j] + l);
                        for (int i = 0; i < T; ++i)
                            for (int j = 0; j < T; ++j) acc[i][j] = _mm256_fmadd_ps(av[i], bv[j], acc[i][j]);
                    }
                    for (int i = 0; i < T; ++i)
                        for (int j = 0; j < T; ++j) acc8[i][j][r] = acc[i][j];
                }
                for (int i = 0; i < ri; ++i)
                    for (int j = 0; j < rj; ++j)
                        out[(i0 + i) * n + j0 + j] = to_bf16(dot_rest(ar[i], br[j], k, acc8[i][j]));
            }
        }
    });
}
#endif  // __AVX2__ && __FMA__

Mat view(const at::Tensor& t, int64_t batch) {
    const int64_t d = t.dim();
    const auto* base = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    return {base + (d == 3 ? batch * t.stride(0) : 0), t.stride(d - 2), t.stride(d - 1)};
}

// out = beta * c + alpha * (a @ b) with the reference loop's bits; 2-D (m, k) @ (k, n), or
// 3-D batches of them; c (the shape of out) is read only where beta != 0
void bf16_addmm_out_cpu(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& c,
                        double alpha, double beta, const at::Tensor& out) {
    const int64_t d = a.dim();
    TORCH_CHECK(d == 2 || d == 3, "bf16_addmm_out_: a must be 2-D or 3-D, got ", a.sizes());
    TORCH_CHECK(b.dim() == d && out.dim() == d, "bf16_addmm_out_: a, b and out must have the same dims");
    for (const at::Tensor* t : {&a, &b, &out}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16,
                    "bf16_addmm_out_: CPU bfloat16 tensors only, got ", t->scalar_type(), " on ", t->device());
    }
    const int64_t batch = d == 3 ? a.size(0) : 1;
    const int64_t m = a.size(d - 2), k = a.size(d - 1), n = b.size(d - 1);
    TORCH_CHECK(b.size(d - 2) == k && out.size(d - 2) == m && out.size(d - 1) == n &&
                    (d == 2 || (b.size(0) == batch && out.size(0) == batch)),
                "bf16_addmm_out_: shapes ", a.sizes(), " @ ", b.sizes(), " -> ", out.sizes(), " do not match");
    TORCH_CHECK(out.is_contiguous(), "bf16_addmm_out_: out must be contiguous");
    const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
    const bool has_c = beta_f != 0.f;
    if (has_c) {
        TORCH_CHECK(c.has_value() && c->sizes() == out.sizes() && c->device().is_cpu() &&
                        c->scalar_type() == at::kBFloat16,
                    "bf16_addmm_out_: beta != 0 needs c, a CPU bfloat16 tensor of out's shape");
    }
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t e = 0; e < batch; ++e) {
        Mat cm{};
        if (has_c) cm = view(*c, e);
        addmm_one(view(a, e), view(b, e), has_c ? &cm : nullptr, m, n, k, alpha_f, beta_f, o + e * m * n, n);
    }
}

// out = a @ b.mT with the dot-product loop's bits (see mm_nt_one); a (m, k) and b (n, k) row-major, or 3-D batches of them; out contiguous
void bf16_mm_nt_out_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t d = a.dim();
    TORCH_CHECK((d == 2 || d == 3) && b.dim() == d && out.dim() == d,
                "bf16_mm_nt_out_: a, b and out must all be 2-D or all 3-D, got ", a.sizes(), ", ", b.sizes(),
                ", ", out.sizes());
    for (const at::Tensor* t : {&a, &b, &out}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                    "bf16_mm_nt_out_: contiguous CPU bfloat16 tensors only, got ", t->scalar_type(), " on ",
                    t->device(), " (contiguous: ", t->is_contiguous(), ")");
    }
    const int64_t batch = d == 3 ? a.size(0) : 1;
    const int64_t m = a.size(d - 2), k = a.size(d - 1), n = b.size(d - 2);
    TORCH_CHECK(b.size(d - 1) == k && out.size(d - 2) == m && out.size(d - 1) == n &&
                    (d == 2 || (b.size(0) == batch && out.size(0) == batch)),
                "bf16_mm_nt_out_: shapes ", a.sizes(), " @ ", b.sizes(), ".mT -> ", out.sizes(), " do not match");
    const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const bool same = ap == bp && m == n;  // X X^T: convert once
    std::vector<float> af(static_cast<size_t>(m * k)), bf(same ? 0 : static_cast<size_t>(n * k));
    for (int64_t e = 0; e < batch; ++e) {
        for (int64_t i = 0; i < m * k; ++i) af[i] = from_bf16(ap[e * m * k + i]);
        if (!same)
            for (int64_t i = 0; i < n * k; ++i) bf[i] = from_bf16(bp[e * n * k + i]);
        mm_nt_one(af.data(), same ? af.data() : bf.data(), m, n, k, o + e * m * n);
    }
#else
    (void)a, (void)b, (void)out;
    TORCH_CHECK(false, "bf16_mm_nt_out_: built without AVX2 and FMA (the dot-product loop's order is "
                "AVX2's); use a @ b.mT");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
    m.def("bf16_addmm_out_(Tensor a, Tensor b, Tensor? c, float alpha, float beta, Tensor(a!) out) -> ()");
    m.def("bf16_mm_nt_out_(Tensor a, Tensor b, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
    m.impl("bf16_addmm_out_", &bf16_addmm_out_cpu);
    m.impl("bf16_mm_nt_out_", &bf16_mm_nt_out_cpu);
}
