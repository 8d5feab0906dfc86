// The fused 8-bit Adam / AdamW step on the CPU: see vefsdp_optim/_kernels/_native.py (why; the measurements: docs/decisions.md) and
// vefsdp_optim/_math/_adam8bit_step.py (the float32 operations, in order).
//
// Bits: every float operation below is one correctly rounded IEEE add, sub, mul, div or
// sqrt; the build uses -ffp-contract=off and no fast-math, so the AVX-512 paths, the AVX2
// paths and the portable loops give the same bits, and so does the eager torch path. The
// Triton kernel (_quant8_triton.py) runs the same sequence.
//
// The AVX2 paths (x86-64 without AVX-512: AMD Zen 1-3, Intel before Skylake-X) are the
// AVX-512 ones at 8 lanes, with vector masks for mask registers and, for the table
// lookups, scalar loads inserted into vectors (Zen 3 has no permute over a 256-entry
// table, and its 8-lane gathers are slower than 8 loads: lut8_ps, lut8_epi32), and the
// requantization by division (see qvec); each sits
// beside its AVX-512 twin, which it leaves untouched.
#include "quant8_adam.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VEFSDP_LANES 16
#else
#define VEFSDP_LANES 8  // AVX2 and the portable loops, which list no vectors to redo
#endif

namespace vefsdp {
namespace {

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* one code map, as the kernel reads it: the 256 values, the packed bucket table and,
   with AVX-512 VBMI, the values' 4 byte planes (built once per call, not per block) */
struct Map {
    const float* code;    // 256 sorted values
    const uint32_t* tab;  // 65536 packed bucket words (see _pack_buckets in vefsdp_optim/_math/_quant8.py)
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    alignas(64) uint8_t planes[4][256];  // planes[k][j]: byte k of code[j]'s bits
    alignas(64) uint8_t order[64];       // byte 16 L + 4 j + q takes element 16 j + 4 L + q
#endif
};

static void map_init(Map* m, const float* code, const uint32_t* tab) {
    m->code = code;
    m->tab = tab;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    for (int j = 0; j < 256; ++j) {
        const uint32_t u = bits_of(code[j]);
        for (int k = 0; k < 4; ++k) m->planes[k][j] = (uint8_t)(u >> (8 * k));
    }
    for (int L = 0; L < 4; ++L)
        for (int j = 0; j < 4; ++j)
            for (int q = 0; q < 4; ++q) m->order[16 * L + 4 * j + q] = (uint8_t)(16 * j + 4 * L + q);
#endif
}

#if defined(__AVX512F__)
/* code[ix] for 16 indices in [0, 256): permutes over the 256-value table in 16 registers
   (cheaper than a gather); exact, as a load */
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
#elif defined(__AVX2__)
/* t[c[k]] for the 8 codes at c: scalar loads inserted into a vector; exact, as a load.
   On a Zen 3 (docs/performance.md) 0.44 ns an element against an 8-lane gather's 0.73
   alone, and the kernel's step 0.85-1.0x (median ~0.93x) the gathers' at one thread */
static inline __m256 lut8_ps(const float* t, const uint8_t* c) {
    uint64_t w;
    memcpy(&w, c, 8);
    __m128 lo = _mm_load_ss(t + (w & 255));
    lo = _mm_insert_ps(lo, _mm_load_ss(t + ((w >> 8) & 255)), 0x10);
    lo = _mm_insert_ps(lo, _mm_load_ss(t + ((w >> 16) & 255)), 0x20);
    lo = _mm_insert_ps(lo, _mm_load_ss(t + ((w >> 24) & 255)), 0x30);
    __m128 hi = _mm_load_ss(t + ((w >> 32) & 255));
    hi = _mm_insert_ps(hi, _mm_load_ss(t + ((w >> 40) & 255)), 0x10);
    hi = _mm_insert_ps(hi, _mm_load_ss(t + ((w >> 48) & 255)), 0x20);
    hi = _mm_insert_ps(hi, _mm_load_ss(t + (w >> 56)), 0x30);
    return _mm256_set_m128(hi, lo);
}

/* t[ix[k]] for 8 indices below 65536, the same way */
static inline __m256i lut8_epi32(const uint32_t* t, __m256i ix) {
    const __m128i a = _mm256_castsi256_si128(ix), b = _mm256_extracti128_si256(ix, 1);
    const uint64_t a0 = (uint64_t)_mm_cvtsi128_si64(a), a1 = (uint64_t)_mm_extract_epi64(a, 1);
    const uint64_t b0 = (uint64_t)_mm_cvtsi128_si64(b), b1 = (uint64_t)_mm_extract_epi64(b, 1);
    __m128i lo = _mm_cvtsi32_si128((int)t[(uint32_t)a0]);
    lo = _mm_insert_epi32(lo, (int)t[a0 >> 32], 1);
    lo = _mm_insert_epi32(lo, (int)t[(uint32_t)a1], 2);
    lo = _mm_insert_epi32(lo, (int)t[a1 >> 32], 3);
    __m128i hi = _mm_cvtsi32_si128((int)t[(uint32_t)b0]);
    hi = _mm_insert_epi32(hi, (int)t[b0 >> 32], 1);
    hi = _mm_insert_epi32(hi, (int)t[(uint32_t)b1], 2);
    hi = _mm_insert_epi32(hi, (int)t[b1 >> 32], 3);
    return _mm256_set_m128i(hi, lo);
}
#endif

/* out[i] = code[c[i]] * scale, i < len */
static void dequantize(const uint8_t* __restrict__ c, int64_t len, const Map* map, float scale,
                       float* __restrict__ out) {
    const float* __restrict__ code = map->code;
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* 64 codes at a time: the map's 4 byte planes looked up with byte permutes, the
       indices first reordered so that the byte interleaves give the floats in order;
       the floats' bits are code[c[i]]'s, so this is exact */
    if (len >= 64) {
        __m512i pt[4][4];
        for (int k = 0; k < 4; ++k)
            for (int q = 0; q < 4; ++q) pt[k][q] = _mm512_load_si512((const void*)(map->planes[k] + 64 * q));
        const __m512i ord = _mm512_load_si512((const void*)map->order);
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
    if (len - i >= 16) {
        __m512 t[16];
        for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(code + 16 * j);
        const __m512 sc = _mm512_set1_ps(scale);
        for (; i + 16 <= len; i += 16) {
            const __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(lut256(t, ix), sc));
        }
    }
#elif defined(__AVX2__)
    {  /* loads from the 1 KiB map (in L1) */
        const __m256 sc = _mm256_set1_ps(scale);
        for (; i + 8 <= len; i += 8) {
            _mm256_storeu_ps(out + i, _mm256_mul_ps(lut8_ps(code, c + i), sc));
        }
    }
#endif
    for (; i < len; ++i) out[i] = code[c[i]] * scale;
}

/* the code of one value by the packed bucket table of its map (see _pack_buckets in vefsdp_optim/_math/_quant8.py: lo8 << 16 | the low 16 bits of the bucket's midpoint) */
static inline uint8_t code_of(float normed, const uint32_t* tab) {
    const uint32_t u = bits_of(normed), e = tab[u >> 16], xl = u & 0xFFFFu, t = e & 0xFFFFu;
    const uint32_t up = (u >> 31) ? (xl < t) : (xl > t);
    return (uint8_t)((e >> 16) + up);
}

#if defined(__AVX512F__)
/* code_of for 16 values q: a gather from the packed table; near (within NEAR = 8 bit
   patterns of) the bucket's midpoint or the bucket's ends, in *near. The bucket's
   midpoint as a float (q's high 16 bits, the table's low 16) compares with q as code_of
   compares the low bits; a bucket without one holds its largest value there, which no
   value of the bucket exceeds */
static inline __m512i codes16(__m512 q, const uint32_t* tab, __mmask16* near) {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(u, 16), (const void*)tab, 4);
    const __m512i mid = _mm512_ternarylogic_epi32(u, e, _mm512_set1_epi32(0xFFFF), 0xD8);  // c ? e : u
    const __mmask16 up = _mm512_cmp_ps_mask(q, _mm512_castsi512_ps(mid), _CMP_GT_OQ);
    *near = (__mmask16)(
        _mm512_cmple_epu32_mask(_mm512_abs_epi32(_mm512_sub_epi32(u, mid)), _mm512_set1_epi32(8)) |
        _mm512_testn_epi32_mask(_mm512_add_epi32(u, _mm512_set1_epi32(8)), _mm512_set1_epi32(0xFFF0)));
    const __m512i lo8 = _mm512_srli_epi32(e, 16);
    return _mm512_mask_add_epi32(lo8, up, lo8, _mm512_set1_epi32(1));
}
#elif defined(__AVX2__)
/* code_of for 8 values q, the packed table read by lut8_epi32 (the midpoint compared as
   in codes16) */
static inline __m256i codes8(__m256 q, const uint32_t* tab) {
    const __m256i u = _mm256_castps_si256(q), low = _mm256_set1_epi32(0xFFFF);
    const __m256i e = lut8_epi32(tab, _mm256_srli_epi32(u, 16));
    const __m256i mid = _mm256_or_si256(_mm256_andnot_si256(low, u), _mm256_and_si256(e, low));
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(q, _mm256_castsi256_ps(mid), _CMP_GT_OQ));
    return _mm256_sub_epi32(_mm256_srli_epi32(e, 16), up);  // up: -1 where the code is one more
}

/* 8 codes (each < 256) as 8 bytes */
static inline void store8(uint8_t* out, __m256i c) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i*)out, _mm_packus_epi16(w, w));
}

/* the largest of 8 uint32 */
static inline uint32_t hmax8(__m256i x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}
#endif

/* codes of x[i] / scale, i < len, into out.

   The code of x is the number of the map's midpoints below d = x / scale (one correctly
   rounded division; searchsorted's rule). The vector loop multiplies instead,
   q = x * r with r = 1 / scale (both rounded): with scale and r normal, q is within
   2.5 ulps of d (two relative errors of 2^-24; 5 bit patterns across a power of two,
   1 in the subnormal range), so no midpoint between q and d unless one lies within
   NEAR = 8 bit patterns of q: for the table's one midpoint per bucket that is
   |low 16 bits of q - those of the midpoint| <= 8, and q within 8 patterns of its
   bucket's ends for a neighbour's. Those vectors (a few percent in blocks of 256, nearly
   all for the block's absmax, whose normed value 1.0 sits at a bucket's end; figure in
   docs/decisions.md) are listed and redone with the division after the block's other
   vectors. So every code is the division's, which the tests check against the eager ops.

   The AVX2 paths divide instead (the AVX2 qvec below). */
struct QPlan {  // the requantization of one moment of one block
    const float* x;       // the block's new moment (len)
    uint8_t* out;         // its codes (len)
    const uint32_t* tab;  // the map's packed bucket table
    int64_t len;
    float scale;
#if defined(__AVX512F__)
    __m512 vr, vs;  // 1 / scale, scale
    bool fast;      // scale and 1 / scale normal: the product's bound holds
    int32_t* redo;  // the vectors near a midpoint, redone with the division at the end
    int64_t nredo;  // (len / 16 + 1 slots: one is written for every vector)
#elif defined(__AVX2__)
    __m256 vs;  // scale
#endif
};

static inline void qplan_init(QPlan* q, const float* x, int64_t len, float scale, const uint32_t* tab,
                              uint8_t* out, int32_t* redo) {
    q->x = x;
    q->out = out;
    q->tab = tab;
    q->len = len;
    q->scale = scale;
#if defined(__AVX512F__)
    const float r = 1.0f / scale;
    q->vr = _mm512_set1_ps(r);
    q->vs = _mm512_set1_ps(scale);
    q->fast = scale >= FLT_MIN && r >= FLT_MIN && scale <= FLT_MAX;
    q->redo = redo;
    q->nredo = 0;
#elif defined(__AVX2__)
    q->vs = _mm256_set1_ps(scale);
    (void)redo;
#else
    (void)redo;
#endif
}

#if defined(__AVX512F__)
/* the 16 codes at i (i + 16 <= len) by the division */
static inline void qvec_exact(const QPlan& q, int64_t i) {
    __mmask16 unused;
    const __m512i c = codes16(_mm512_div_ps(_mm512_loadu_ps(q.x + i), q.vs), q.tab, &unused);
    _mm_storeu_si128((__m128i*)(q.out + i), _mm512_cvtepi32_epi8(c));
}

/* the 16 codes at i (i + 16 <= len); near a midpoint, the vector is listed to be redone
   (appended without a branch: a branch per vector mispredicts on every block's absmax,
   whose normed value 1.0 sits at a bucket's end) */
static inline void qvec(QPlan& q, int64_t i) {
    if (!q.fast) return qvec_exact(q, i);
    __mmask16 near;
    const __m512i c = codes16(_mm512_mul_ps(_mm512_loadu_ps(q.x + i), q.vr), q.tab, &near);
    _mm_storeu_si128((__m128i*)(q.out + i), _mm512_cvtepi32_epi8(c));
    q.redo[q.nredo] = (int32_t)i;
    q.nredo += near != 0;
}
#elif defined(__AVX2__)
/* On a Zen 3 the AVX-512 paths' product with the reciprocal, its test for a nearby
   midpoint and the list of vectors to redo cost more than the division they save: a
   256-bit division issues every ~3.3 cycles there, and the step, bound by its table
   lookups, has room for two more per 8 elements. Dividing is also the eager path's
   operation itself. Measured in docs/decisions.md. */

/* the 8 codes at i (i + 8 <= len) */
static inline void qvec(QPlan& q, int64_t i) {
    store8(q.out + i, codes8(_mm256_div_ps(_mm256_loadu_ps(q.x + i), q.vs), q.tab));
}
#endif

/* the codes from element i (a multiple of the lane count) on, then the listed vectors
   again */
static void qrest(QPlan& q, int64_t i) {
#if defined(__AVX512F__)
    for (; i + 16 <= q.len; i += 16) qvec(q, i);
    for (int64_t j = 0; j < q.nredo; ++j) qvec_exact(q, q.redo[j]);
    q.nredo = 0;
#elif defined(__AVX2__)
    for (; i + 8 <= q.len; i += 8) qvec(q, i);
#endif
    for (; i < q.len; ++i) q.out[i] = code_of(q.x[i] / q.scale, q.tab);
}

struct Hp {
    float c_wd, wd, w1, beta2, w2, bc2, eps, neg_step, gsign;
};

/* the update of len elements of one block (see vefsdp_optim/_math/_adam8bit_step.py): p in place,
   the new moments (non-finite ones as 0) into sm, sv; returns their absmax bits (for
   |x| the uint32 order is the float order: an exact max) */
template <int WD>
static void update(float* __restrict__ pb, const float* __restrict__ gb, float* __restrict__ sm,
                   float* __restrict__ sv, int64_t len, const Hp& h, uint32_t* um_out,
                   uint32_t* uv_out, QPlan* qm, QPlan* qv, int64_t qn, float* __restrict__ dn,
                   float* __restrict__ mu) {
    int64_t i = 0;
    uint32_t um = 0, uv = 0;
#if defined(__AVX512F__)
    {
        const __m512 gsign = _mm512_set1_ps(h.gsign), c_wd = _mm512_set1_ps(h.c_wd);
        const __m512 wd = _mm512_set1_ps(h.wd), w1 = _mm512_set1_ps(h.w1);
        const __m512 beta2 = _mm512_set1_ps(h.beta2), w2 = _mm512_set1_ps(h.w2);
        const __m512 bc2 = _mm512_set1_ps(h.bc2), eps = _mm512_set1_ps(h.eps);
        const __m512 neg_step = _mm512_set1_ps(h.neg_step), big = _mm512_set1_ps(FLT_MAX);
        const __m512i absm = _mm512_set1_epi32(0x7fffffff);
        __m512i vm = _mm512_setzero_si512(), vv = _mm512_setzero_si512();
        for (; i + 16 <= len; i += 16) {
            __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(gb + i), gsign);
            __m512 pi = _mm512_loadu_ps(pb + i);
            if (WD == 1) pi = _mm512_mul_ps(pi, c_wd);
            else if (WD == 2) gi = _mm512_add_ps(gi, _mm512_mul_ps(pi, wd));
            __m512 m = _mm512_loadu_ps(sm + i), v = _mm512_loadu_ps(sv + i);
            m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_sub_ps(gi, m), w1));
            v = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(gi, gi), w2));
            const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
            _mm512_storeu_ps(pb + i, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(m, neg_step), denom)));
            const __m512i mb = _mm512_and_si512(_mm512_castps_si512(m), absm);
            const __m512i vb = _mm512_and_si512(_mm512_castps_si512(v), absm);
            /* |x| <= FLT_MAX (false for NaN) */
            const __mmask16 fm = _mm512_cmp_ps_mask(_mm512_castsi512_ps(mb), big, _CMP_LE_OQ);
            const __mmask16 fv = _mm512_cmp_ps_mask(_mm512_castsi512_ps(vb), big, _CMP_LE_OQ);
            _mm512_storeu_ps(sm + i, _mm512_maskz_mov_ps(fm, m));
            _mm512_storeu_ps(sv + i, _mm512_maskz_mov_ps(fv, v));
            vm = _mm512_mask_max_epu32(vm, fm, vm, mb);
            vv = _mm512_mask_max_epu32(vv, fv, vv, vb);
            if (i < qn) {  // the previous block's codes, alongside this block's divisions
                qvec(*qm, i);
                qvec(*qv, i);
            }
        }
        um = _mm512_reduce_max_epu32(vm);
        uv = _mm512_reduce_max_epu32(vv);
    }
#elif defined(__AVX2__)
    /* The update's chain, square root -> division -> division, is ~40 cycles deep on a
       Zen 3, and one pass's ~100 operations per vector let its out-of-order window hold
       too few vectors to hide it. So the AVX2 loop runs the block twice: the moments
       and the denominators first (dn; the unmasked first moment in mu: the parameter's
       update takes it before the non-finite ones become 0), then the parameter's
       division and the previous block's codes. The same operations on the same
       operands: the same bits. Measured in docs/decisions.md. */
    {
        const __m256 gsign = _mm256_set1_ps(h.gsign), c_wd = _mm256_set1_ps(h.c_wd);
        const __m256 wd = _mm256_set1_ps(h.wd), w1 = _mm256_set1_ps(h.w1);
        const __m256 beta2 = _mm256_set1_ps(h.beta2), w2 = _mm256_set1_ps(h.w2);
        const __m256 bc2 = _mm256_set1_ps(h.bc2), eps = _mm256_set1_ps(h.eps);
        const __m256 big = _mm256_set1_ps(FLT_MAX);
        const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256i vm = _mm256_setzero_si256(), vv = _mm256_setzero_si256();
        const int64_t n8 = len / 8 * 8;
        for (; i < n8; i += 8) {
            __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(gb + i), gsign);
            if (WD == 2) gi = _mm256_add_ps(gi, _mm256_mul_ps(_mm256_loadu_ps(pb + i), wd));
            __m256 m = _mm256_loadu_ps(sm + i), v = _mm256_loadu_ps(sv + i);
            m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_sub_ps(gi, m), w1));
            v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(gi, gi), w2));
            _mm256_storeu_ps(dn + i, _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps));
            const __m256 mb = _mm256_and_ps(m, absm), vb = _mm256_and_ps(v, absm);
            /* |x| <= FLT_MAX (false for NaN): all ones where finite; a non-finite moment is +0 */
            const __m256 fm = _mm256_cmp_ps(mb, big, _CMP_LE_OQ), fv = _mm256_cmp_ps(vb, big, _CMP_LE_OQ);
            _mm256_storeu_ps(mu + i, m);
            _mm256_storeu_ps(sm + i, _mm256_and_ps(fm, m));
            _mm256_storeu_ps(sv + i, _mm256_and_ps(fv, v));
            vm = _mm256_max_epu32(vm, _mm256_castps_si256(_mm256_and_ps(fm, mb)));
            vv = _mm256_max_epu32(vv, _mm256_castps_si256(_mm256_and_ps(fv, vb)));
        }
        const __m256 neg_step = _mm256_set1_ps(h.neg_step);
        for (int64_t j = 0; j < n8; j += 8) {
            __m256 pi = _mm256_loadu_ps(pb + j);
            if (WD == 1) pi = _mm256_mul_ps(pi, c_wd);
            const __m256 upd = _mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(mu + j), neg_step),
                                             _mm256_loadu_ps(dn + j));
            _mm256_storeu_ps(pb + j, _mm256_add_ps(pi, upd));
            if (j < qn) {  // the previous block's codes, alongside this block's divisions
                qvec(*qm, j);
                qvec(*qv, j);
            }
        }
        um = hmax8(vm);
        uv = hmax8(vv);
    }
#else
    (void)qm, (void)qv, (void)qn;
#endif
#if !defined(__AVX2__) || defined(__AVX512F__)
    (void)dn, (void)mu;  // scratch of the AVX2 passes only
#endif
    for (; i < len; ++i) {
        float gi = gb[i] * h.gsign;
        float pi = pb[i];
        if (WD == 1) pi = pi * h.c_wd;
        else if (WD == 2) gi = gi + pi * h.wd;
        float m = sm[i], v = sv[i];
        m = m + (gi - m) * h.w1;
        v = v * h.beta2 + (gi * gi) * h.w2;
        float denom = sqrtf(v) / h.bc2 + h.eps;
        pb[i] = pi + (m * h.neg_step) / denom;
        m = fabsf(m) <= FLT_MAX ? m : 0.0f;
        v = fabsf(v) <= FLT_MAX ? v : 0.0f;
        sm[i] = m;
        sv[i] = v;
        const uint32_t a = bits_of(m) & 0x7fffffffu, b = bits_of(v) & 0x7fffffffu;
        um = a > um ? a : um;
        uv = b > uv ? b : uv;
    }
    *um_out = um;
    *uv_out = uv;
}

/* Where the step's tensors come from memory (a step after others, as in training: the
   model's other optimizer steps and the backward leave the cache with other data), the
   block's loads wait on memory at each start of a stream; the hardware's prefetchers
   do not run far enough ahead of the kernel's ~3 GB/s. So each block first asks for
   the block kPrefetchBlocks ahead: its parameter and gradient (one request per 64-byte
   line) and its codes. The AVX-512 paths leave it out: a prefetch measured slower
   there. The measurements are in docs/decisions.md. */
constexpr int64_t kPrefetchBlocks = 4;

static inline void prefetch_block(const float* p, const float* g, const uint8_t* mc,
                                  const uint8_t* vc, int64_t lo, int64_t bs, int64_t n) {
    const int64_t hi = lo + bs < n ? lo + bs : n;
    for (int64_t e = lo; e < hi; e += 16) {
        __builtin_prefetch(p + e);
        __builtin_prefetch(g + e);
    }
    for (int64_t e = lo; e < hi; e += 64) {
        __builtin_prefetch(mc + e);
        __builtin_prefetch(vc + e);
    }
}

/* Block k's update is bound by its divisions and square roots, the requantization by
   its table gathers; so the loop over block k's vectors also requantizes the vectors
   of block k - 1 (its moments in the other half of the scratch), and the rest of block
   k - 1 follows. Each block's codes and absmax are its own: the same bits. */
template <int WD>
static void run_blocks(float* __restrict__ p, const float* __restrict__ g, uint8_t* __restrict__ mc,
                       float* __restrict__ ma, uint8_t* __restrict__ vc, float* __restrict__ va,
                       int64_t n, int64_t bs, const Hp& h, const Map* sm_map, const Map* sv_map,
                       float* __restrict__ scratch, int32_t* __restrict__ redo) {
    QPlan qm = {}, qv = {};  // the previous block's requantization (len 0: none)
    for (int64_t lo = 0, k = 0; lo < n; lo += bs, ++k) {
        const int64_t len = n - lo < bs ? n - lo : bs;
#if !defined(__AVX512F__)
        prefetch_block(p, g, mc, vc, lo + kPrefetchBlocks * bs, bs, n);
#endif
        float* sm = scratch + (k & 1) * 2 * bs;
        float* sv = sm + bs;
        uint8_t* __restrict__ mb = mc + lo;
        uint8_t* __restrict__ vb = vc + lo;
        dequantize(mb, len, sm_map, ma[k], sm);
        dequantize(vb, len, sv_map, va[k], sv);
        uint32_t um, uv;
#if defined(__AVX512F__)
        const int64_t qn = (qm.len < len ? qm.len : len) / 16 * 16;  // done inside update
#elif defined(__AVX2__)
        const int64_t qn = (qm.len < len ? qm.len : len) / 8 * 8;
#else
        const int64_t qn = 0;
#endif
        update<WD>(p + lo, g + lo, sm, sv, len, h, &um, &uv, &qm, &qv, qn, scratch + 4 * bs,
                   scratch + 5 * bs);
        qrest(qm, qn);
        qrest(qv, qn);
        const float amax_m = float_of(um), amax_v = float_of(uv);
        qplan_init(&qm, sm, len, amax_m > 0.0f ? amax_m : 1.0f, sm_map->tab, mb, redo);
        qplan_init(&qv, sv, len, amax_v > 0.0f ? amax_v : 1.0f, sv_map->tab, vb, redo + bs / VEFSDP_LANES + 1);
        ma[k] = amax_m;
        va[k] = amax_v;
    }
    qrest(qm, 0);
    qrest(qv, 0);
}

}  // namespace

int adam8bit_step(float* __restrict__ p, const float* __restrict__ g, uint8_t* __restrict__ mc,
                  float* __restrict__ ma, uint8_t* __restrict__ vc, float* __restrict__ va,
                  int64_t n, int64_t bs, const float* __restrict__ hp, int flags,
                  const float* __restrict__ scode, const float* __restrict__ ucode,
                  const uint32_t* __restrict__ stab, const uint32_t* __restrict__ utab) {
    const Hp h = {hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[7], (flags & 1) ? -1.0f : 1.0f};
    const int wd_mode = (flags & 2) ? ((flags & 4) ? 1 : 2) : 0;
    Map smap, umap;
    map_init(&smap, scode, stab);
    map_init(&umap, ucode, utab);
    /* 2 blocks' moments, the AVX2 passes' denominators and first moment (bs each), then 2
       lists of vectors to redo */
    float* scratch = (float*)malloc((size_t)(6 * bs + 2 * (bs / VEFSDP_LANES + 1)) * sizeof(float));
    if (scratch == NULL) return -1;
    int32_t* redo = (int32_t*)(scratch + 6 * bs);
    if (wd_mode == 1) run_blocks<1>(p, g, mc, ma, vc, va, n, bs, h, &smap, &umap, scratch, redo);
    else if (wd_mode == 2) run_blocks<2>(p, g, mc, ma, vc, va, n, bs, h, &smap, &umap, scratch, redo);
    else run_blocks<0>(p, g, mc, ma, vc, va, n, bs, h, &smap, &umap, scratch, redo);
    free(scratch);
    return 0;
}

}  // namespace vefsdp
