// The fused 8-bit Adam / AdamW step on the CPU: see [Note: fused 8-bit step] in
// vefsdp_optim/_math/_quant8_fused.py (why, the measurements, what was tried) and
// [Note: 8-bit Adam op order] in _quant8.py (the float32 operations, in order).
//
// Bits: every float operation below is one correctly rounded IEEE add, sub, mul, div or
// sqrt; the build uses -ffp-contract=off and no fast-math, so the AVX-512 paths and the
// portable loops give the same bits, and so does the eager torch path. The Triton
// kernel (_quant8_triton.py) runs the same sequence.
#include "quant8_adam.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace vefsdp {
namespace {

#if defined(__AVX512F__)
/* code[ix] for 16 indices in [0, 256): permutes over the 256-value table in 16 registers
   (a gather costs ~3x more here); exact, as a load */
static inline __m512 lut256(const __m512* t, __m512i ix) {
    const __mmask16 b5 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(128));
    __m512 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(t[2 * j], ix, t[2 * j + 1]);
    const __m512 s0 = _mm512_mask_blend_ps(b5, r[0], r[1]), s1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
    const __m512 s2 = _mm512_mask_blend_ps(b5, r[4], r[5]), s3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
    const __m512 u0 = _mm512_mask_blend_ps(b6, s0, s1), u1 = _mm512_mask_blend_ps(b6, s2, s3);
    return _mm512_mask_blend_ps(b7, u0, u1);
}
#endif

/* out[i] = code[c[i]] * scale, i < len */
static void dequantize(const uint8_t* __restrict__ c, int64_t len, const float* __restrict__ code,
                       float scale, float* __restrict__ out) {
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* 64 codes at a time: the map's 4 byte planes looked up with byte permutes, the
       indices first reordered so that the byte interleaves give the floats in order;
       the floats' bits are code[c[i]]'s, so this is exact */
    if (len >= 64) {
        uint8_t planes[4][256];
        for (int j = 0; j < 256; ++j) {
            uint32_t u; memcpy(&u, code + j, 4);
            for (int k = 0; k < 4; ++k) planes[k][j] = (uint8_t)(u >> (8 * k));
        }
        __m512i pt[4][4];
        for (int k = 0; k < 4; ++k)
            for (int q = 0; q < 4; ++q) pt[k][q] = _mm512_loadu_si512((const void*)(planes[k] + 64 * q));
        uint8_t order[64];  /* byte 16 L + 4 j + q takes element 16 j + 4 L + q */
        for (int L = 0; L < 4; ++L)
            for (int j = 0; j < 4; ++j)
                for (int q = 0; q < 4; ++q) order[16 * L + 4 * j + q] = (uint8_t)(16 * j + 4 * L + q);
        const __m512i ord = _mm512_loadu_si512((const void*)order);
        const __m512 sc = _mm512_set1_ps(scale);
        for (; i + 64 <= len; i += 64) {
            const __m512i ix = _mm512_permutexvar_epi8(ord, _mm512_loadu_si512((const void*)(c + i)));
            const __mmask64 top = _mm512_movepi8_mask(ix);
            __m512i b[4];
            for (int k = 0; k < 4; ++k)
                b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(pt[k][0], ix, pt[k][1]),
                                              _mm512_permutex2var_epi8(pt[k][2], ix, pt[k][3]));
            const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
            const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l)), sc));
            _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l)), sc));
            _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h)), sc));
            _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h)), sc));
        }
    }
#endif
#if defined(__AVX512F__)
    __m512 t[16];
    for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(code + 16 * j);
    const __m512 sc = _mm512_set1_ps(scale);
    for (; i + 16 <= len; i += 16) {
        const __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(lut256(t, ix), sc));
    }
#endif
    for (; i < len; ++i) out[i] = code[c[i]] * scale;
}

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* the code of one value by the packed bucket table of its map ([Note: packed bucket
   table]: lo8 << 16 | the low 16 bits of the bucket's midpoint) */
static inline uint8_t code_of(float normed, const uint32_t* tab) {
    const uint32_t u = bits_of(normed), e = tab[u >> 16], xl = u & 0xFFFFu, t = e & 0xFFFFu;
    const uint32_t up = (u >> 31) ? (xl < t) : (xl > t);
    return (uint8_t)((e >> 16) + up);
}

#if defined(__AVX512F__)
/* the 8 levels of a branch-free binary search over the 255 midpoints mid[j] =
   (code[j] + code[j + 1]) / 2 of a code map (as quantize_blockwise rounds them): level
   L's 2^L midpoints mid[k * 2s + s - 1] (s = 2^(7 - L), k < 2^L) at srch[2^L - 1 + r],
   r = k's L bits reversed, so that the bits found so far index the level directly */
static void search_levels(const float* code, float* srch) {
    float mid[255];
    for (int j = 0; j < 255; ++j) mid[j] = (code[j] + code[j + 1]) / 2.0f;
    for (int L = 0; L < 8; ++L)
        for (int k = 0, s = 128 >> L; k < (1 << L); ++k) {
            int r = 0;
            for (int b = 0; b < L; ++b) r |= ((k >> (L - 1 - b)) & 1) << b;
            srch[(1 << L) - 1 + r] = mid[k * 2 * s + s - 1];
        }
    for (int j = 255; j < 272; ++j) srch[j] = 0.0f;
}

typedef struct { __m512 sc, t0, t1, t2, t3, t4, t5[2], t6[4], t7[8]; } levels_t;

/* codes of 16 * U values x[i] / scale: at level L, bit L of r (the code's bit 7 - L)
   is mid < x for the level's midpoint picked by r's bits so far; r's byte is reversed
   at the end. The same division and exact float compares, so searchsorted's codes */
static inline __attribute__((always_inline)) void search(const levels_t* T, const float* x,
                                                         uint8_t* out, const int U) {
#define EACH for (int u = 0; u < U; ++u)
#define LT(t) _mm512_cmp_ps_mask(t, xn[u], _CMP_LT_OQ)
#define OR(m, b) r[u] = _mm512_mask_or_epi32(r[u], m, r[u], _mm512_set1_epi32(b))
#define P2(t, j) _mm512_permutex2var_ps((t)[j], r[u], (t)[(j) + 1])
    __m512 xn[8]; __m512i r[8]; __mmask16 k5[8], k6[8];
    EACH xn[u] = _mm512_div_ps(_mm512_loadu_ps(x + 16 * u), T->sc);
    EACH r[u] = _mm512_maskz_mov_epi32(LT(T->t0), _mm512_set1_epi32(1));
    EACH OR(LT(_mm512_permutexvar_ps(r[u], T->t1)), 2);
    EACH OR(LT(_mm512_permutexvar_ps(r[u], T->t2)), 4);
    EACH OR(LT(_mm512_permutexvar_ps(r[u], T->t3)), 8);
    EACH OR(LT(_mm512_permutexvar_ps(r[u], T->t4)), 16);
    EACH k5[u] = LT(P2(T->t5, 0));
    EACH k6[u] = LT(_mm512_mask_blend_ps(k5[u], P2(T->t6, 0), P2(T->t6, 2)));
    EACH {
        const __m512 q0 = _mm512_mask_blend_ps(k5[u], P2(T->t7, 0), P2(T->t7, 2));
        const __m512 q1 = _mm512_mask_blend_ps(k5[u], P2(T->t7, 4), P2(T->t7, 6));
        const __mmask16 k7 = LT(_mm512_mask_blend_ps(k6[u], q0, q1));
        OR(k5[u], 32); OR(k6[u], 64); OR(k7, 128);
    }
#if defined(__GFNI__)
    const __m128i rev = _mm_set1_epi64x((long long)0x8040201008040201ULL);  /* byte reversal */
    EACH _mm_storeu_si128((__m128i*)(out + 16 * u),
                          _mm_gf2p8affine_epi64_epi8(_mm512_cvtepi32_epi8(r[u]), rev, 0));
#else  /* the reversal of r's byte: rev4(low nibble) << 4 | rev4(high nibble) */
    const __m128i rlo = _mm_setr_epi8(0, -128, 64, -64, 32, -96, 96, -32, 16, -112, 80, -48, 48, -80, 112, -16);
    const __m128i rhi = _mm_setr_epi8(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
    const __m128i nib = _mm_set1_epi8(15);
    EACH {
        const __m128i b = _mm512_cvtepi32_epi8(r[u]);
        _mm_storeu_si128((__m128i*)(out + 16 * u),
                         _mm_or_si128(_mm_shuffle_epi8(rlo, _mm_and_si128(b, nib)),
                                      _mm_shuffle_epi8(rhi, _mm_and_si128(_mm_srli_epi16(b, 4), nib))));
    }
#endif
#undef EACH
#undef LT
#undef OR
#undef P2
}
#endif

/* codes of x[i] / scale, i < len, into out: code_of, or with AVX-512 the
   search over srch (register permutes: a gather from the bucket table costs ~20 cycles
   for 16 lanes, 8 levels of the search ~15; every finite float gets code_of's code) */
static void quantize(const float* __restrict__ x, int64_t len, float scale, const float* __restrict__ srch,
                     const uint32_t* __restrict__ tab, uint8_t* __restrict__ out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    levels_t T;  // srch is read only here: the portable build leaves it unused
    T.sc = _mm512_set1_ps(scale);
    T.t0 = _mm512_set1_ps(srch[0]);
    T.t1 = _mm512_loadu_ps(srch + 1), T.t2 = _mm512_loadu_ps(srch + 3);
    T.t3 = _mm512_loadu_ps(srch + 7), T.t4 = _mm512_loadu_ps(srch + 15);
    for (int j = 0; j < 2; ++j) T.t5[j] = _mm512_loadu_ps(srch + 31 + 16 * j);
    for (int j = 0; j < 4; ++j) T.t6[j] = _mm512_loadu_ps(srch + 63 + 16 * j);
    for (int j = 0; j < 8; ++j) T.t7[j] = _mm512_loadu_ps(srch + 127 + 16 * j);
    /* 8 vectors at a time: each level's permute and compare wait on the one before */
    for (; i + 128 <= len; i += 128) search(&T, x + i, out + i, 8);
    for (; i + 16 <= len; i += 16) search(&T, x + i, out + i, 1);
#else
    (void)srch;
#endif
    for (; i < len; ++i) out[i] = code_of(x[i] / scale, tab);
}

}  // namespace

int adam8bit_step(float* __restrict__ p, const float* __restrict__ g, uint8_t* __restrict__ mc,
                  float* __restrict__ ma, uint8_t* __restrict__ vc, float* __restrict__ va,
                  int64_t n, int64_t bs, const float* __restrict__ hp, int flags,
                  const float* __restrict__ scode, const float* __restrict__ ucode,
                  const uint32_t* __restrict__ stab, const uint32_t* __restrict__ utab) {
    const float c_wd = hp[0], wd = hp[1], w1 = hp[2], beta2 = hp[3], w2 = hp[4];
    const float bc2 = hp[5], eps = hp[6], neg_step = hp[7];
    const float gsign = (flags & 1) ? -1.0f : 1.0f;
    const int wd_mode = (flags & 2) ? ((flags & 4) ? 1 : 2) : 0;
    float ssrch[272] = {0}, usrch[272] = {0};
#if defined(__AVX512F__)
    search_levels(scode, ssrch);
    search_levels(ucode, usrch);
#endif
    float* scratch = (float*)malloc((size_t)(2 * bs) * sizeof(float));
    if (scratch == NULL) return -1;
    float* __restrict__ sm = scratch;
    float* __restrict__ sv = scratch + bs;
    for (int64_t lo = 0; lo < n; lo += bs) {
        const int64_t len = n - lo < bs ? n - lo : bs;
        const int64_t blk = lo / bs;
        const float am = ma[blk], av = va[blk];
        float* __restrict__ pb = p + lo;
        const float* __restrict__ gb = g + lo;
        uint8_t* __restrict__ mb = mc + lo;
        uint8_t* __restrict__ vb = vc + lo;
        dequantize(mb, len, scode, am, sm);
        dequantize(vb, len, ucode, av, sv);
        uint32_t um = 0, uv = 0;
        for (int64_t i = 0; i < len; ++i) {
            float gi = gb[i] * gsign;
            float pi = pb[i];
            if (wd_mode == 1) pi = pi * c_wd;
            else if (wd_mode == 2) gi = gi + pi * wd;
            float m = sm[i], v = sv[i];
            m = m + (gi - m) * w1;
            v = v * beta2 + (gi * gi) * w2;
            float denom = sqrtf(v) / bc2 + eps;
            pb[i] = pi + (m * neg_step) / denom;
            m = fabsf(m) <= FLT_MAX ? m : 0.0f;
            v = fabsf(v) <= FLT_MAX ? v : 0.0f;
            sm[i] = m;
            sv[i] = v;
        }
        /* absmax on the bits: for |x| the uint32 order is the float order (an exact max) */
        for (int64_t i = 0; i < len; ++i) { uint32_t a = bits_of(sm[i]) & 0x7fffffffu; um = a > um ? a : um; }
        for (int64_t i = 0; i < len; ++i) { uint32_t a = bits_of(sv[i]) & 0x7fffffffu; uv = a > uv ? a : uv; }
        const float amax_m = float_of(um), amax_v = float_of(uv);
        const float scale_m = amax_m > 0.0f ? amax_m : 1.0f;
        const float scale_v = amax_v > 0.0f ? amax_v : 1.0f;
        quantize(sm, len, scale_m, ssrch, stab, mb);
        quantize(sv, len, scale_v, usrch, utab, vb);
        ma[blk] = amax_m;
        va[blk] = amax_v;
    }
    free(scratch);
    return 0;
}

}  // namespace vefsdp
