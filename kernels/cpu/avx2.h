/*
 * AVX2 + FMA helpers the CPU kernels share (include only where __AVX2__ and __FMA__ are defined).
 */
#ifndef DUOSERVE_AVX2_H
#define DUOSERVE_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* The 8 bfloat16 values at p (their bits) as float32: exact, a shift into the upper half. */
static inline __m256 load8_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Lane j of the result is the sum of v[j]'s 8 lanes: 8 horizontal sums in one transposing tree. */
static inline __m256 sum8x8(const __m256 v[8])
{
    /* per 128-bit half: [v0 pairs, v1 pairs, ...], then each vector's half sums side by side */
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The sum and the largest of v's 8 lanes. */
static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* All ones in lanes j < n, zero in the others. */
static inline __m256 lanes_below(int64_t n)
{
    return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)n), _CMP_LT_OQ);
}

/* exp(x) for x <= 0 by 2^n * p(f), |f| <= 1/2 (elements.h's polynomial), and exactly 0 below -87
 * (where it would be subnormal) and for -inf: masked scores weigh nothing. */
static inline __m256 exp8_nonpositive(__m256 x)
{
    const __m256 floor = _mm256_set1_ps(-87.0f);
    const __m256 kept = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
    const __m256 y = _mm256_mul_ps(_mm256_max_ps(x, floor), _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), kept);
}

#endif
