/*
 * y = x @ w.T (+ bias) in bfloat16 on AMX tiles, for decode-sized batches (1 to 64 rows). Such a
 * product streams every weight once per step and does little with it: with AMX the multiplies
 * take a few percent of the time the weights take to arrive, so what counts is streaming them.
 * The weight is packed once (kernels/cpu_amx.py) into the tile layout, one contiguous strip of K
 * per 16 output columns, and OpenMP gives each thread whole strips.
 *
 * Tiles: C0..C3 accumulate up to 64 rows x 16 columns in float32 (16 rows each, the last one
 * `tail` rows), A (t4, 16 rows; t5, the tail's rows) holds 32 columns of x, B (t6) the strip's
 * matching 32 x 16 weights as pairs. Rows past 64 run in further passes over the strip, which
 * the core's caches hold by then (oneDNN is much faster for such batches; the worker sends
 * them there).
 */
#include <stdint.h>
#include <string.h>

#include "amx.h"

static void configure(int64_t tail)
{
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { /* C tiles: rows x 16 floats */
        cfg.rows[t] = t == 3 ? (uint8_t)tail : 16;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = 16, cfg.colsb[4] = 64;           /* A: 16 rows x 32 bf16 */
    cfg.rows[5] = (uint8_t)tail, cfg.colsb[5] = 64; /* A for the last row tile */
    cfg.rows[6] = 16, cfg.colsb[6] = 64;           /* B: 16 pairs x 16 columns */
    _tile_loadconfig(&cfg);
}

/* C tiles -> bfloat16 columns [n0, n0 + 16) of y, plus bias, for `rows` rows. */
static void store_rows(const float *c, int64_t rows, const uint16_t *bias, uint16_t *y, int64_t n, int64_t n0)
{
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n0))), 16));
    for (int64_t r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + r * n + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b)));
}

/*
 * x: [rows, k] bf16, rows x_stride elements apart; packed: the weight in tile layout
 * ([n / 16][k / 32][16 pairs][16 columns][2], from kernels/cpu_amx.py); bias: [n] or NULL;
 * y: [rows, n] bf16, contiguous. k a multiple of 32, n of 16.
 */
void duoserve_amx_linear(const uint16_t *x_all, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                         uint16_t *y_all, int64_t rows_all, int64_t n, int64_t k, int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    {
        float c[64 * 16] __attribute__((aligned(64)));
        int64_t configured_tail = -1;
#pragma omp for schedule(static)
        for (int64_t strip_index = 0; strip_index < n / 16; strip_index++) {
            const uint16_t *strip = packed + strip_index * (k / 32) * 512;
            for (int64_t row0 = 0; row0 < rows_all; row0 += 64) {
                const int64_t rows = rows_all - row0 < 64 ? rows_all - row0 : 64;
                const int64_t tiles = (rows + 15) / 16, tail = rows - 16 * (tiles - 1);
                if (tail != configured_tail) {
                    configure(tail);
                    configured_tail = tail;
                }
                const uint16_t *x = x_all + row0 * x_stride;
                const int64_t stride = x_stride * 2; /* bytes */
                /* Row tiles before the last go through A t4 into C0..C2; the last, `tail` rows,
                 * through A t5 into C3. Tile numbers are immediates, hence the unrolling. */
                const int64_t last = 16 * (tiles - 1) * x_stride;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < k / 32; s++) {
                    _tile_loadd(6, strip + s * 512, 64);
                    const uint16_t *a = x + s * 32;
                    if (tiles > 1) {
                        _tile_loadd(4, a, stride);
                        _tile_dpbf16ps(0, 4, 6);
                    }
                    if (tiles > 2) {
                        _tile_loadd(4, a + 16 * x_stride, stride);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (tiles > 3) {
                        _tile_loadd(4, a + 32 * x_stride, stride);
                        _tile_dpbf16ps(2, 4, 6);
                    }
                    _tile_loadd(5, a + last, stride);
                    _tile_dpbf16ps(3, 5, 6);
                }
                if (tiles > 1) _tile_stored(0, c, 64);
                if (tiles > 2) _tile_stored(1, c + 16 * 16, 64);
                if (tiles > 3) _tile_stored(2, c + 32 * 16, 64);
                _tile_stored(3, c + (tiles - 1) * 16 * 16, 64);
                store_rows(c, rows, bias, y_all + row0 * n, n, strip_index * 16);
            }
        }
        _tile_release();
    }
}
