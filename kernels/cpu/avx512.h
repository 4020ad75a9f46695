/*
 * AVX-512 helpers the CPU kernels share (include only where __AVX512F__ is defined).
 */
#ifndef DUOSERVE_AVX512_H
#define DUOSERVE_AVX512_H

#include <immintrin.h>

/* Lane j of the result is the sum of v[j]'s 16 lanes: 16 horizontal sums in one transposing tree. */
static inline __m512 sum16(const __m512 v[16])
{
    __m512 b[8], c[4];
    for (int j = 0; j < 8; j++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        b[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) /* per 128-bit lane: that lane's sums of v[4j] .. v[4j+3] */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif
