/*
 * AVX-512 helpers the CPU kernels share (include only where __AVX512F__ is defined).
 */
#ifndef DUOSERVE_AVX512_H
#define DUOSERVE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* 16 bfloat16 values (their bits) as float32: exact, a shift into the upper half. */
static inline __m512 widen16_bf16(__m256i bits)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* The 16 bfloat16 values at p as float32. */
static inline __m512 load16_bf16(const uint16_t *p) { return widen16_bf16(_mm256_loadu_si256((const __m256i *)p)); }

#ifdef __AVX512BF16__
/* The bfloat16 pair at p[0], p[1] in all 16 lanes: the A operand of a vdpbf16ps row product. */
static inline __m512bh broadcast_pair_bf16(const uint16_t *p)
{
    int32_t bits;
    __builtin_memcpy(&bits, p, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
}
#endif

static inline __m512 add_lanes(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 max_lanes(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

/* Lane j of the result is op over v[j]'s 16 lanes, for 16 vectors in one transposing tree (op is
 * add_lanes or max_lanes, and inlined: the callers below pass it as a constant). */
static inline __m512 across16(const __m512 v[16], __m512 (*op)(__m512, __m512))
{
    __m512 b[8], c[4];
    for (int j = 0; j < 8; j++) /* per 128-bit lane: [x0 op x2, y0 op y2, x1 op x3, y1 op y3] */
        b[j] = op(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) /* per 128-bit lane: op over that lane of v[4j] .. v[4j+3] */
        c[j] = op(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                  _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e01 = op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e23 = op(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return op(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Lane j of the result is the sum of v[j]'s 16 lanes: 16 horizontal sums in one tree. */
static inline __m512 sum16(const __m512 v[16]) { return across16(v, add_lanes); }

/* Lane j of the result is the largest of v[j]'s 16 lanes (a max is exact in any order). */
static inline __m512 max16(const __m512 v[16]) { return across16(v, max_lanes); }

/*
 * Lane j of the result is _mm512_reduce_add_ps(v[j]), to the bit: the same pairs added in the same
 * order (lanes i and i + 8, then i and i + 4, i and i + 2, i and i + 1), for 16 vectors at once.
 */
static inline __m512 reduce_add16(const __m512 v[16])
{
    __m512 w[8], u[4], z[2];
    for (int k = 0; k < 8; k++) /* [a of v[2k], a of v[2k + 1]], a_i = x_(i+8) + x_i */
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int m = 0; m < 4; m++) /* 128-bit lane L: b of v[4m + L], b_i = a_(i+4) + a_i */
        u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int n = 0; n < 2; n++) /* lane L: c0, c1 of v[8n + L], then of v[8n + 4 + L]; c_i = b_i + b_(i+2) */
        z[n] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * n], u[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * n], u[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane L, element e: c0 + c1 of v[L + 4e]; element 4L + e back to lane L + 4e */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* elements.h's exp_nonpositive on 16 lanes, step for step: 2^n * p(f), n = floor(y + 1/2). */
static inline __m512 exp16_nonpositive(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    /* p * 2^n, exact (n >= -125 after the clamp, so the product is a normal number): one scalef in
     * place of building 2^n's bits and multiplying, four instructions; the same bits. */
    return _mm512_scalef_ps(p, n);
}

/* fused_ops.c's silu, x * sigmoid(x), on 16 lanes, step for step (exp16_nonpositive of -|x|, one
 * division either side). */
static inline __m512 silu16(__m512 x)
{
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), negative, x);
    const __m512 e = exp16_nonpositive(minus_abs); /* exp(-|x|) */
    const __m512 numerator = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), negative, e);
    return _mm512_mul_ps(x, _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

#endif
