// bfloat16 matrix products with the bits of torch's reference CPU loop, fast:
// TORCH_EXTENSION_NAME::bf16_addmm_out_. Built into the same library as the 8-bit Adam
// kernel (_quant8_fused.py); _math/_bf16_matmul.py decides where it may run.
//
// [Note: torch's bfloat16 reference matmul]
// On a CPU that oneDNN cannot run bfloat16 products on (no AVX-512 and no AMX: AVX2 CPUs
// such as AMD Zen 3), torch's bfloat16 mm / addmm / bmm take its reference loop
// (aten's cpublas gemm_stub), about 1 GFLOP/s, 40x slower than float32 there: it is
// what Newton-Schulz runs on. Its arithmetic, for each output element:
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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
    m.def("bf16_addmm_out_(Tensor a, Tensor b, Tensor? c, float alpha, float beta, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
    m.impl("bf16_addmm_out_", &bf16_addmm_out_cpu);
}
