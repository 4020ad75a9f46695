/*
 * bench/int8_probe.py's C side: would int8 dot products (AVX-512 VNNI) multiply a Q4_1 model
 * faster than the bfloat16 dot products the pair-layout kernel runs on?
 *
 * - probe_bf16_peak / probe_int8_peak: 12 independent chains of vdpbf16ps / vpdpbusd on
 *   registers, no memory: the instructions' own throughput (returns seconds).
 * - probe_q4_gemm: y = x @ w.T with w in Q4_1's form (4-bit q, and per 32 weights of a row a
 *   scale d and a minimum m: w = d q + m) and x quantized per 32 values to int8 (x = dx qx, with
 *   sx = dx * sum(qx) per block, as llama.cpp quantizes activations for its integer products).
 *   Per block of 32, each of 8 rows x 32 columns takes 8 vpdpbusd into int32, then the block's
 *   float epilogue: y += float(sum) * (d * dx) + m * sx. That epilogue is what a per-32 scale
 *   costs; the probe measures whether the integer products' 2x leaves anything after it.
 *
 * Layouts (bench/int8_probe.py packs them): w [n / 16][k / 32][8][16][4] uint8 (16 columns, 4
 * consecutive k of each, as vpdpbusd takes them); wd, wm [n / 16][k / 32][16] float32; x [rows][k]
 * int8; xd, xs [rows][k / 32] float32; y [rows][n] float32. rows % 8 == 0, n % 32 == 0, k % 32 == 0.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define ROWS 8   /* rows of a register tile */
#define GROUPS 2 /* 16-column groups of a register tile */

double probe_bf16_peak(int64_t iters, int threads)
{
    const double started = omp_get_wtime();
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512 acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
        __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f803f81);
        for (int64_t i = 0; i < iters; i++) {
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
            __asm__ volatile("" : "+v"(a)); /* keeps the loop from being folded */
        }
        for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
    }
    __asm__ volatile("" ::"x"(sink));
    return omp_get_wtime() - started;
}

double probe_int8_peak(int64_t iters, int threads)
{
    const double started = omp_get_wtime();
    int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512i acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
        __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x01010101);
        for (int64_t i = 0; i < iters; i++) {
            for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
            __asm__ volatile("" : "+v"(a));
        }
        for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(acc[i]);
    }
    __asm__ volatile("" ::"r"(sink));
    return omp_get_wtime() - started;
}

static void tile(const uint8_t *w, const float *wd, const float *wm, const int8_t *x, const float *xd,
                 const float *xs, float *y, int64_t n, int64_t k, int64_t r0, int64_t g0)
{
    const int64_t blocks = k / 32;
    __m512 out[ROWS][GROUPS];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < GROUPS; c++) out[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[ROWS][GROUPS];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < GROUPS; c++) sums[r][c] = _mm512_setzero_si512();
        for (int quad = 0; quad < 8; quad++) {
            __m512i weights[GROUPS];
            for (int c = 0; c < GROUPS; c++)
                weights[c] = _mm512_loadu_si512(w + ((g0 + c) * blocks + b) * 512 + quad * 64);
            for (int r = 0; r < ROWS; r++) {
                const __m512i four = _mm512_set1_epi32(*(const int32_t *)(x + (r0 + r) * k + b * 32 + quad * 4));
                for (int c = 0; c < GROUPS; c++) sums[r][c] = _mm512_dpbusd_epi32(sums[r][c], weights[c], four);
            }
        }
        for (int c = 0; c < GROUPS; c++) {
            const __m512 d = _mm512_loadu_ps(wd + ((g0 + c) * blocks + b) * 16);
            const __m512 m = _mm512_loadu_ps(wm + ((g0 + c) * blocks + b) * 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[(r0 + r) * blocks + b]));
                out[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), scale, out[r][c]);
                out[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[(r0 + r) * blocks + b]), out[r][c]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < GROUPS; c++) _mm512_storeu_ps(y + (r0 + r) * n + (g0 + c) * 16, out[r][c]);
}

void probe_q4_gemm(const uint8_t *w, const float *wd, const float *wm, const int8_t *x, const float *xd,
                   const float *xs, float *y, int64_t rows, int64_t n, int64_t k, int threads)
{
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t g0 = 0; g0 < n / 16; g0 += GROUPS)
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) tile(w, wd, wm, x, xd, xs, y, n, k, r0, g0);
}
