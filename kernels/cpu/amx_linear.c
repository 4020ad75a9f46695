/*
 * y = x @ w.T (+ bias) in bfloat16 on AMX tiles, for decode-sized batches (1 to 64 rows). Such a
 * product streams every weight once per step. Up to 16 rows the weights' arrival sets its time;
 * at 64 rows the tile loads and products add about as much again (skipping only x's tile loads,
 * for a timing, made the 64-row product a quarter faster). The weight is packed once
 * (kernels/cpu_amx.py) into the tile layout, one contiguous strip of K per 16 output columns,
 * and OpenMP gives each thread whole strips.
 *
 * Strips go in pairs (a, b) and rows in passes of up to 32: per 32 columns of x, one load of
 * each strip's weights and of each row tile of x feeds four products, where a 64-row pass over
 * one strip loaded x's four row tiles for every strip's weights (from the second-level cache:
 * x outgrows the first) and took about a tenth longer at 64 rows. A strip pair's weights are
 * read from memory by the first pass and from the cache by the next.
 *
 * Tiles: C t0, t1 (strip a) and t2, t3 (strip b) accumulate the pass's first and second row
 * tiles in float32 (16 rows, the last one `tail` rows); A t4, t5 hold those row tiles' 32
 * columns of x; B t6, t7 the two strips' matching 32 x 16 weights as pairs. The worker sends
 * batches past 64 rows to oneDNN, which is much faster for them.
 */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "avx512.h"

/* A pass of `tiles` row tiles (1 or 2), the last of `tail` rows, over a pair of strips. */
static void configure(int64_t tiles, int64_t tail)
{
    const uint8_t first = (uint8_t)(tiles == 1 ? tail : 16);
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[2] = cfg.rows[4] = first; /* C (strips a, b) and A of the first row tile */
    cfg.rows[1] = cfg.rows[3] = cfg.rows[5] = (uint8_t)tail; /* the second row tile's */
    cfg.rows[6] = cfg.rows[7] = 16; /* B of strips a and b: 16 pairs x 16 columns */
    _tile_loadconfig(&cfg);
}

/* C tiles -> bfloat16 columns [n0, n0 + 16) of y, plus bias, for `rows` rows. */
static void store_rows(const float *c, int64_t rows, const uint16_t *bias, uint16_t *y, int64_t n, int64_t n0)
{
    __m512 b = _mm512_setzero_ps();
    if (bias) b = load16_bf16(bias + n0);
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
    const int64_t strips = n / 16, ksteps = k / 32;
#pragma omp parallel num_threads(num_threads)
    {
        float c[2][32 * 16] __attribute__((aligned(64)));
        int64_t configured_rows = -1; /* the pass size the tiles are configured for */
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (strips + 1) / 2; pair++) {
            const int64_t first_strip = 2 * pair;
            const int has_b = first_strip + 1 < strips;
            const uint16_t *strip_a = packed + first_strip * ksteps * 512, *strip_b = strip_a + ksteps * 512;
            for (int64_t row0 = 0; row0 < rows_all; row0 += 32) {
                const int64_t rows = rows_all - row0 < 32 ? rows_all - row0 : 32;
                const int64_t tiles = (rows + 15) / 16, tail = rows - 16 * (tiles - 1);
                if (rows != configured_rows) {
                    configure(tiles, tail);
                    configured_rows = rows;
                }
                const uint16_t *x = x_all + row0 * x_stride;
                const int64_t stride = x_stride * 2; /* bytes */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < ksteps; s++) {
                    const uint16_t *a = x + s * 32;
                    _tile_loadd(6, strip_a + s * 512, 64);
                    if (has_b) _tile_loadd(7, strip_b + s * 512, 64);
                    _tile_loadd(4, a, stride);
                    _tile_dpbf16ps(0, 4, 6);
                    if (has_b) _tile_dpbf16ps(2, 4, 7);
                    if (tiles > 1) {
                        _tile_loadd(5, a + 16 * x_stride, stride);
                        _tile_dpbf16ps(1, 5, 6);
                        if (has_b) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                if (tiles > 1) _tile_stored(1, c[0] + 16 * 16, 64);
                store_rows(c[0], rows, bias, y_all + row0 * n, n, first_strip * 16);
                if (has_b) {
                    _tile_stored(2, c[1], 64);
                    if (tiles > 1) _tile_stored(3, c[1] + 16 * 16, 64);
                    store_rows(c[1], rows, bias, y_all + row0 * n, n, (first_strip + 1) * 16);
                }
            }
        }
        _tile_release();
    }
}
