/*
 * y = x @ w.T (+ bias) in bfloat16 for a few rows of x (decode steps of one to a few
 * sequences). Such a product reads every weight once and does little with it, so its speed is
 * the speed of streaming w from memory: each weight row is read once, contiguously, and used
 * for every row of x, with AVX-512 BF16 dot products accumulating in float32, and the next
 * rows are prefetched. Built by kernels/cpu_linear.py with -DMAX_ROWS; OpenMP shares the
 * output columns out. On this machine it streams about 16 GB/s against oneDNN's 12.
 */
#include <stdint.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512F__)
#error "the small-batch linear kernel needs AVX-512 BF16"
#endif
#include "avx512.h"
#ifndef MAX_ROWS
#error "build with -DMAX_ROWS=.."
#endif
#define PREFETCH_ROWS 8 /* weight rows ahead (about 9 KB for 576 columns), measured best of 2..16 */

static inline __m512 load_bias16(const uint16_t *bias)
{
    return bias ? load16_bf16(bias) : _mm512_setzero_ps();
}

/*
 * x: [rows, k] bf16, rows x_stride elements apart; w: [n, k] bf16, contiguous; bias: [n] or NULL;
 * y: [rows, n] bf16, contiguous. k % 32 == 0, n % 16 == 0, 1 <= rows <= MAX_ROWS.
 */
void duoserve_small_batch_linear(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,
                                 uint16_t *y, int64_t rows, int64_t n, int64_t k, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n0 = 0; n0 < n; n0 += 16) {
        __m512 part[MAX_ROWS][16];
        for (int j = 0; j < 16; j++) {
            const uint16_t *row = w + (n0 + j) * k;
            __m512 acc[MAX_ROWS];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t c = 0; c < k; c += 32) {
                __builtin_prefetch(row + PREFETCH_ROWS * k + c);
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(row + c));
                for (int r = 0; r < rows; r++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * x_stride + c));
                    acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
                }
            }
            for (int r = 0; r < rows; r++) part[r][j] = acc[r];
        }
        const __m512 b = load_bias16(bias ? bias + n0 : 0);
        for (int r = 0; r < rows; r++) {
            const __m512 sums = _mm512_add_ps(sum16(part[r]), b);
            _mm256_storeu_si256((__m256i *)(y + r * n + n0), (__m256i)_mm512_cvtneps_pbh(sums));
        }
    }
}
