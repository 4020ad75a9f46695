/*
 * y = x @ w.T (+ bias) in bfloat16 for decode-sized batches (1 to 64 rows; any size on the dot
 * products), on a weight packed once (kernels/cpu_pair_linear.py) into pairs: one contiguous strip
 * of K per 16 output columns,
 * [n / 16][k / 32][16 pairs][16 columns][2], the layout both AMX tiles and vdpbf16ps take. Such
 * a product streams every weight once per step. Two engines, chosen when the library is built:
 *
 * AMX tiles, where the CPU has AMX-BF16 (and NO_AMX is not defined to 1). Up to 16 rows the
 * weights' arrival sets the time; at 64 rows the tile loads and products add about as much again
 * (skipping only x's tile loads, for a timing, made the 64-row product a quarter faster).
 * Strips go in pairs (a, b) and rows in passes of up to 32: per 32 columns of x, one load of
 * each strip's weights and of each row tile of x feeds four products, where a 64-row pass over
 * one strip loaded x's four row tiles for every strip's weights (from the second-level cache:
 * x outgrows the first) and took about a tenth longer at 64 rows. A strip pair's weights are
 * read from memory by the first pass and from the cache by the next. Tiles: C t0, t1 (strip a)
 * and t2, t3 (strip b) accumulate the pass's first and second row tiles in float32 (16 rows, the
 * last one `tail` rows); A t4, t5 hold those row tiles' 32 columns of x; B t6, t7 the two
 * strips' matching 32 x 16 weights as pairs.
 *
 * AVX-512 BF16 dot products elsewhere: a register block of up to 6 rows x 4 strips (24 float32
 * accumulators) walks K one pair at a time, each strip's packed row of pairs loaded once for the
 * block's rows and each row's pair broadcast once for its strips, so a 6 x 4 block does 24 dot
 * products per 10 loads. Each thread takes an equal run of strips. On a 2-core AMD EPYC
 * (SmolLM2's four linears, 30 layers of weights from memory) it took 33.7 ms at 64 rows where
 * oneDNN's packed kernel took 36.8-41.2, and 12.1 against 15.2 at 16.
 *
 * The engines add the same products in different orders, so they agree to float32 rounding,
 * not bit for bit. With AMX the worker sends batches past 64 rows to oneDNN; the dot products take
 * every batch (at 2048 rows on a 2-core Zen 5: 440 ms against oneDNN's 481 for SmolLM2's four
 * linears of 30 layers), and have a gate_up entry that ends in the MLP's SiLU and multiply
 * (duoserve_pair_linear_silu).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !NO_AMX
#define USE_AMX 1
#include "amx.h"
#else
#define USE_AMX 0
#if !defined(__AVX512BF16__)
#error "the pair linear needs AMX-BF16 or AVX-512 BF16"
#endif
#include <immintrin.h>
#endif
#include "avx512.h"

/* 1 when the kernel multiplies on AMX tiles (the caller then requests the tile state). */
int duoserve_pair_linear_uses_amx(void) { return USE_AMX; }

#if USE_AMX

/*
 * Cache lines of each of the next pair's strips fetched at each k step of a pass that reads the
 * current pair from the cache: 4 of a strip's 16 lines a k step, a quarter of the next pair. In
 * the first pass the hardware streams the weights in; in a second it had nothing to read from
 * memory. On the AMX
 * Xeon, the four linears of 30 layers at 64 rows took 12.3-12.7 ms against 12.8-13.1 without, and a
 * 64-sequence decode step (LM head included) 39.4-41.1 ms against 40.3-41.4 in four paired runs;
 * 8 lines did no better, 16 (all of the next pair, in bursts) worse. Up to 32 rows there is one
 * pass, and nothing changes.
 */
#define NEXT_PAIR_LINES 4

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
 * x: [rows, k] bf16, rows x_stride elements apart; packed: the weight in pair layout
 * ([n / 16][k / 32][16 pairs][16 columns][2], from kernels/cpu_pair_linear.py); bias: [n] or NULL;
 * y: [rows, n] bf16, contiguous. k a multiple of 32, n of 16.
 */
void duoserve_pair_linear(const uint16_t *x_all, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
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
                /* Passes after the first read this pair from the cache and nothing from memory:
                 * they fetch the start of the next pair's two strips meanwhile. */
                const int fetch_next = row0 > 0 && first_strip + 3 < strips;
                const char *next_a = fetch_next ? (const char *)(strip_a + 2 * ksteps * 512) : NULL;
                const char *next_b = fetch_next ? next_a + ksteps * 1024 : NULL;
                for (int64_t s = 0; s < ksteps; s++) {
                    const uint16_t *a = x + s * 32;
                    if (fetch_next)
                        for (int line = 0; line < NEXT_PAIR_LINES; line++) {
                            __builtin_prefetch(next_a + 64 * (NEXT_PAIR_LINES * s + line), 0, 1);
                            __builtin_prefetch(next_b + 64 * (NEXT_PAIR_LINES * s + line), 0, 1);
                        }
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
#else
/*
 * y's rows [0, ROWS) x the columns of STRIPS strips: x [ROWS, k] (rows x_stride apart) times the
 * strips' pairs (`pairs` = k / 2 rows of 16 columns' pairs each; strip s at strip[s]). Plain
 * (SILU = 0): the strips' columns plus bias, rounded to bfloat16. SILU = 1 (gate_up): strips
 * [0, STRIPS / 2) are gate's and [STRIPS / 2, STRIPS) the matching up ones, and y's columns are
 * round(round(silu(round(gate))) * round(up)), what the plain product followed by
 * duoserve_silu_and_mul (fused_ops.c) gives, to the bit.
 */
static inline __attribute__((always_inline)) void dot_block(const uint16_t *x, int64_t x_stride,
                                                        const uint16_t *const strip[4], int64_t pairs,
                                                        const uint16_t *bias, uint16_t *y, int64_t n,
                                                        const int ROWS, const int STRIPS, const int SILU)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int s = 0; s < STRIPS; s++) acc[r][s] = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; c++) {
        __m512bh w[4];
#pragma GCC unroll 4
        for (int s = 0; s < STRIPS; s++) w[s] = (__m512bh)_mm512_loadu_si512(strip[s] + c * 32);
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            const __m512bh a = broadcast_pair_bf16(x + r * x_stride + 2 * c);
#pragma GCC unroll 4
            for (int s = 0; s < STRIPS; s++) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], a, w[s]);
        }
    }
    if (SILU) {
#pragma GCC unroll 2
        for (int s = 0; s < STRIPS / 2; s++)
#pragma GCC unroll 6
            for (int r = 0; r < ROWS; r++) {
                const __m512 gate = widen16_bf16((__m256i)_mm512_cvtneps_pbh(acc[r][s]));
                const __m512 up = widen16_bf16((__m256i)_mm512_cvtneps_pbh(acc[r][s + STRIPS / 2]));
                const __m512 activated = widen16_bf16((__m256i)_mm512_cvtneps_pbh(silu16(gate)));
                _mm256_storeu_si256((__m256i *)(y + r * n + s * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(activated, up)));
            }
        return;
    }
#pragma GCC unroll 4
    for (int s = 0; s < STRIPS; s++) {
        const __m512 b = bias ? load16_bf16(bias + s * 16) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n + s * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][s], b)));
    }
}

#define BLOCK_OF_ROWS(STRIPS, SILU)                                                   \
    switch (rows) {                                                                  \
    case 6: dot_block(x, x_stride, strip, pairs, bias, y, n, 6, STRIPS, SILU); break;   \
    case 5: dot_block(x, x_stride, strip, pairs, bias, y, n, 5, STRIPS, SILU); break;   \
    case 4: dot_block(x, x_stride, strip, pairs, bias, y, n, 4, STRIPS, SILU); break;   \
    case 3: dot_block(x, x_stride, strip, pairs, bias, y, n, 3, STRIPS, SILU); break;   \
    case 2: dot_block(x, x_stride, strip, pairs, bias, y, n, 2, STRIPS, SILU); break;   \
    default: dot_block(x, x_stride, strip, pairs, bias, y, n, 1, STRIPS, SILU); break;  \
    }

/* One block of `rows` (1..6) rows and `strips` (1..4) strips; with `silu`, strips is 2 or 4. */
static void any_dot_block(const uint16_t *x, int64_t x_stride, const uint16_t *const strip[4], int64_t pairs,
                          const uint16_t *bias, uint16_t *y, int64_t n, int rows, int strips, int silu)
{
    if (silu) {
        if (strips == 4)
            BLOCK_OF_ROWS(4, 1)
        else
            BLOCK_OF_ROWS(2, 1)
        return;
    }
    switch (strips) {
    case 4: BLOCK_OF_ROWS(4, 0); break;
    case 3: BLOCK_OF_ROWS(3, 0); break;
    case 2: BLOCK_OF_ROWS(2, 0); break;
    default: BLOCK_OF_ROWS(1, 0); break;
    }
}

/*
 * y [rows, n] for the `n` / 16 strips from `packed` on: each thread takes an equal run of them,
 * walked 4 at a time, each over all rows in blocks of six. With `silu` (gate_up), the strips walked
 * are gate's, 2 at a time, each beside the up strip n / 16 strips on (any_dot_block's SILU).
 */
static void walk_strips(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *y, int64_t rows, int64_t n, int64_t k, int num_threads, int silu)
{
    const int64_t strips = n / 16, pairs = k / 2, step = silu ? 2 : 4;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = strips * me / threads, last = strips * (me + 1) / threads;
        for (int64_t s0 = first; s0 < last; s0 += step) {
            const int count = (int)(last - s0 < step ? last - s0 : step);
            const uint16_t *strip[4];
            for (int s = 0; s < count; s++) {
                strip[s] = packed + (s0 + s) * pairs * 32;
                if (silu) strip[count + s] = packed + (strips + s0 + s) * pairs * 32;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += 6)
                any_dot_block(x + r0 * x_stride, x_stride, strip, pairs, bias ? bias + s0 * 16 : NULL, y + r0 * n + s0 * 16,
                              n, (int)(rows - r0 < 6 ? rows - r0 : 6), silu ? 2 * count : count, silu);
        }
    }
}

void duoserve_pair_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias,
                            uint16_t *y, int64_t rows, int64_t n, int64_t k, int num_threads)
{
    walk_strips(x, x_stride, packed, bias, y, rows, n, k, num_threads, 0);
}

/*
 * SiLU(x @ gate.T) * (x @ up.T), rounded as the plain product followed by duoserve_silu_and_mul
 * rounds it, to the bit: y [rows, ffn] from x [rows, k] and `packed`, a gate_up weight [2 ffn, k]
 * (gate's rows, then up's) packed whole by kernels/cpu_pair_linear.py. The [rows, 2 ffn] product
 * is never written: each gate strip's sums meet those of the up strip ffn / 16 strips on, in
 * registers.
 */
void duoserve_pair_linear_silu(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *y, int64_t rows,
                               int64_t ffn, int64_t k, int num_threads)
{
    walk_strips(x, x_stride, packed, NULL, y, rows, ffn, k, num_threads, 1);
}
#endif
