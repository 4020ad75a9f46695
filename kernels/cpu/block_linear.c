/*
 * y = x @ w.T (+ bias) in float32 on a weight kept as its file stores it: the GGUF file's own
 * blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, the K-quants Q2_K to Q6_K, IQ4_XS, the
 * codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, the ternary TQ1_0 and
 * TQ2_0, and the 4-bit floats MXFP4 and NVFP4), or 16-bit floats (F16, BF16: a GGUF file's or
 * a safetensors checkpoint's). A decode step streams every
 * weight once and does two flops with each byte-sized piece of it, so its time is the weights'
 * bytes over the memory's speed:
 * SmolLM2-135M's Q4_1 linears and Q8_0 head are 96 MB where their float32 copies are 538 MB.
 *
 * Each block is widened in registers (blocks.h: the layouts and the widening) to the very values
 * dequantizing it in float32 gives, so the result is x @ dequantize(w).T with the additions in
 * another order: equal to float32 rounding.
 *
 * Two paths, by the number of rows of x:
 * - up to STREAM_ROWS (a decode step of a few sequences), and up to WIDE_STREAM_ROWS for types of
 *   32-weight blocks where x's rows fit WIDE_STREAM_FLOATS (k = 576: 12 rows, 1024: 11, 1536: 7):
 *   each thread takes an equal run of output rows and widens each weight row's blocks once, in
 *   registers, for all rows of x. At one row the widening sets the time, at a few more the
 *   multiplies join it; a widened block is never stored. On a 2-core AMD EPYC (Zen 4), SmolLM2's
 *   Q4_1 linears and Q8_0 head took 6.7 ms at one row, 13.8 at six, 16.4 at seven and 24.8 at
 *   twelve, where 16-row tiles took 29.5 for any of 7 to 16 (bench/block_linear_ab.py); at k =
 *   1024 and 12 rows the tiles were faster (0.78-0.85x). With AVX-512 BW, Q4_0, Q4_1 and Q8_0
 *   stream up to STREAM_ROWS rows on 512-bit registers instead (pass_512, dot_pass_512), each Q4
 *   weight looked up among its block's 16 values; on bfloat16 dot products Q5_0, Q5_1, IQ4_NL,
 *   MXFP4, Q4_K, Q5_K and IQ4_XS too (dot_pass_512, dot_pass_super_512), each weight looked up
 *   among its group's values.
 * - more (larger decode batches, prefill chunks): the multiplies set the time; the tiled path
 *   below widens panels of weight rows into cache and multiplies in register tiles of 16 rows.
 *   A tail of up to STREAM_ROWS rows past whole tiles is streamed instead.
 *
 * duoserve_block_linear_bf16 serves bfloat16 models on CPUs that cannot multiply bfloat16
 * (no AVX-512 BF16, no AMX): the weights are widened as above and rounded on to bfloat16 (the
 * values the model's bfloat16 copy holds), x and the bias are widened to float32 exactly, the
 * products and sums are float32, and y is rounded to bfloat16 once: a bfloat16 matmul's result.
 * On a CPU with AVX-512 BF16 its streaming path multiplies on bfloat16 dot products instead
 * (dot_pass): the same rounded weights and exact products, in half the instructions.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the block linear needs AVX2, FMA and F16C"
#endif

/*
 * Built as PARTS objects side by side, then linked into one library (kernels/cpu_build.py reads
 * the PARTS line and compiles with -DPART=0 to PARTS - 1): the streaming paths' copies for every
 * type and row count take most of the compile. On a 2-core Zen 4 (GCC 12) the bfloat16 build took
 * 48 s as one object and takes 28 s in these three; float32 24 and 15 s. The products are the
 * same bits, at the same speed. Each part defines its share of the functions, the others declare them:
 * NARROW_PART the streaming path up to STREAM_ROWS rows, DOT_PART its bfloat16 dot products,
 * MAIN_PART the rest and the library's entries.
 */
#define PARTS 3
#define NARROW_PART 0
#define DOT_PART 1
#define MAIN_PART 2
#ifndef PART
#error "block_linear.c builds in parts: -DPART=0 to PARTS - 1, as kernels/cpu_build.py builds it"
#endif
#define SHARED __attribute__((visibility("hidden"))) /* one part's, called from another's */

#include "avx2.h"
#include "bf16.h"
#include "blocks.h"

/* Each build of this file serves one element type of x and y: BFLOAT16=1 builds
 * duoserve_block_linear_bf16 (weights rounded to bfloat16), else duoserve_block_linear. Built
 * apart, each compiles in half the time, and a worker builds only the one it multiplies in. */
#ifndef BFLOAT16
#define BFLOAT16 0
#endif
/* SPLIT_512=1 where the CPU runs each 512-bit operation as two 256-bit halves (Zen 4; set by
 * kernels/cpu_block_linear.py): float32 then streams every type on 256-bit registers (see pass_512),
 * and the bfloat16 lookup computes a block's 16 values in two 256-bit halves (see group_bf16). */
#ifndef SPLIT_512
#define SPLIT_512 0
#endif

/* TYPE_MASK: the block types this build multiplies, bit t for ggml's type t (every type unless
 * set). A test that needs a build of a few types at another setting (SPLIT_512) compiles only
 * those: the others' code is never instantiated, and their types are refused like unknown ones. */
#ifndef TYPE_MASK
#define TYPE_MASK (~0ull)
#endif
#define BUILT(type) ((((unsigned long long)(TYPE_MASK)) >> (type)) & 1ull)
static inline int built_type(int type) { return known_type(type) && BUILT(type); }

/* Runs CALL(T, B) with T the constant equal to `type` (one of the twenty-five) and B the build's
 * BFLOAT16, so that each type gets its own inlined copy of what CALL calls. BF16 weights need no
 * rounding to bfloat16, so they take B = 0 either way. */
/* A case of WITH_TYPE: CALL(T, B) where this build multiplies type T (TYPE_MASK), else nothing. */
#define ONE_TYPE(T, B, CALL)                                                                         \
    case T:                                                                                          \
        if (BUILT(T)) CALL(T, B);                                                                    \
        break
#define WITH_TYPE(type, CALL)                                                                        \
    do {                                                                                             \
        switch (type) {                                                                              \
            ONE_TYPE(TYPE_Q8_0, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q4_1, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q4_0, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q5_1, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q5_0, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_IQ4_NL, BFLOAT16, CALL);                                                   \
            ONE_TYPE(TYPE_Q2_K, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q3_K, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q4_K, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q5_K, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_Q6_K, BFLOAT16, CALL);                                                     \
            ONE_TYPE(TYPE_IQ4_XS, BFLOAT16, CALL);                                                   \
            ONE_TYPE(TYPE_IQ2_XXS, BFLOAT16, CALL);                                                  \
            ONE_TYPE(TYPE_IQ2_XS, BFLOAT16, CALL);                                                   \
            ONE_TYPE(TYPE_IQ2_S, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_IQ3_XXS, BFLOAT16, CALL);                                                  \
            ONE_TYPE(TYPE_IQ3_S, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_IQ1_S, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_IQ1_M, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_TQ1_0, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_TQ2_0, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_MXFP4, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_NVFP4, BFLOAT16, CALL);                                                    \
            ONE_TYPE(TYPE_F16, BFLOAT16, CALL);                                                      \
            ONE_TYPE(TYPE_BF16, 0, CALL);                                                            \
        default: break;                                                                              \
        }                                                                                            \
    } while (0)

#define STREAM_ROWS 6 /* any type */
#define WIDE_STREAM_ROWS 12 /* types that stream_wide, while x's rows fit WIDE_STREAM_FLOATS */
/* 44 KB of x: past it, loading x's rows from the second-level cache cost more than a tile's padding. */
#define WIDE_STREAM_FLOATS (11 * 1024)

/*
 * The weight rows PREFETCH_BYTES ahead of the one about to be widened are fetched into the cache
 * by hand, a row at a time. Without it, on a 2-core Intel Xeon (Sapphire Rapids class, AMX), the
 * streaming paths read their blocks from memory at 4-5 GB/s, where the same calls with the blocks
 * already in the cache took a third of the time: the hardware's prefetchers do not run far enough
 * ahead of rows this short (360 bytes for Q4_1 at k = 576). SmolLM2's Q4_1 linears and Q8_0 head
 * in float32 (bench/linear_ab.py): one row 18.5-19.2 ms before, 8.6-9.1 after; two rows 19.5-19.7
 * against 8.2-9.9; four 21.6-21.9 against 10.8-11.7; six 26.8-27.2 against 13.5-14.3; bfloat16
 * dot products at one row 24.1-26.4 against 10.0-10.2. The tiled path's panels, whose widening
 * also reads each row once: 16 rows 30.5-31.4 against 32.1, 64 rows 92.9-95.6 against 94.2-98.3.
 * 2, 3 and 4 KB ahead did as well as each other, 8 KB a little worse. A prefetch never faults, so
 * the rows past the weight's end that the last ones ask for cost nothing but the request.
 */
#define PREFETCH_BYTES 4096

static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *row, int64_t row_bytes)
{
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(row + PREFETCH_BYTES + line, 0, 3);
}

/* Types whose streaming path also takes STREAM_ROWS + 1 to WIDE_STREAM_ROWS rows: those of 32-weight
 * blocks. A super-block's widening needs more registers beside a sum for each row (Q6_K at 8 rows
 * spilled: 0.75x the tiled path's speed), and six more unrolled row counts of every type add to the
 * build. */
static inline int stream_wide(int type)
{
    return !super_blocks(type);
}

/*
 * Output `n` for `rows` (1 to WIDE_STREAM_ROWS) rows of x from `x`, on `type` blocks widened as
 * `bf16` says (all three constants once inlined). Chains of additions: four per row for one or two
 * rows, two per row up to STREAM_ROWS, one past that (the rows' own chains are then enough, and
 * more would not fit the registers), so that the additions' latency hides behind the widening and
 * the loads.
 */
#if defined(__AVX512BW__)
#define PASS_512 1
/* A Q4_0 or Q4_1 block's d and m (-8d for Q4_0) in every lane, as widen computes them. */
static inline __attribute__((always_inline)) void q4_scales(const uint8_t *block, const int type, __m512 *scale,
                                                            __m512 *add)
{
    if (type == TYPE_Q4_1) {
        int32_t pair;
        __builtin_memcpy(&pair, block, 4);
        const __m512 both = _mm512_cvtph_ps(_mm256_set1_epi32(pair)); /* d, m, d, m, ... */
        *scale = _mm512_moveldup_ps(both);
        *add = _mm512_movehdup_ps(both);
    } else {
        uint16_t bits;
        __builtin_memcpy(&bits, block, 2);
        *scale = _mm512_cvtph_ps(_mm256_set1_epi16((short)bits));
        *add = _mm512_mul_ps(*scale, _mm512_set1_ps(-8.0f)); /* exact */
    }
}

/* The 16 values a Q4_0 or Q4_1 block's nibbles stand for, fma(q, d, m) for q = 0..15, in float32. */
static inline __attribute__((always_inline)) __m512 q4_values(const uint8_t *block, const int type)
{
    __m512 scale, add;
    q4_scales(block, type, &scale, &add);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(q, scale, add);
}

/*
 * A group of Q4_0, Q4_1 or Q8_0 widened into two 512-bit registers, w[0] its weights 0..15 and
 * w[1] 16..31, each the very value widen gives: Q4 weights looked up by nibble among their block's
 * 16 values (vpermps reads an index's low four bits, so the low nibbles need no mask), Q8_0's
 * each q times d.
 */
static inline __attribute__((always_inline)) void widen_512(const uint8_t *block, const int type, __m512 w[2])
{
    if (type == TYPE_Q8_0) {
        uint16_t bits;
        __builtin_memcpy(&bits, block, 2);
        const __m512 scale = _mm512_cvtph_ps(_mm256_set1_epi16((short)bits));
        const uint8_t *q = block + quants_at(type);
        for (int j = 0; j < 2; j++)
            w[j] = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * j)))), scale);
        return;
    }
    const __m512 values = q4_values(block, type);
    const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + quants_at(type))));
    w[0] = _mm512_permutexvar_ps(index, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), values);
}

/* The types the 512-bit paths (pass_512, dot_pass_512) widen. */
static inline int widens_512(int type)
{
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0;
}

/*
 * pass in float32 (no rounding) for the types that widen_512 takes, on 512-bit registers: about
 * half the instructions of widening into four 256-bit ones. Chains of additions: four a row for
 * one or two rows (two groups at a time), two past that. On a 2-core AMD EPYC (Zen 5), SmolLM2's
 * Q4_1 linears and Q8_0 head against the 256-bit path (bench/block_linear_ab.py, medians of 40 in
 * one run): one row 5.43 ms against 6.03, two 6.19 against 6.57, three 6.91 against 7.80, six
 * 10.17 against 11.63. On Zen 4, which runs each 512-bit operation as two 256-bit halves, it lost:
 * 6.46 against 6.05 at one row, 7.73 against 7.04 at two, 13.26 against 12.32 at six (the same
 * benchmark), and widening each Q4 weight by conversion instead of lookup lost more (6.71-6.96 at
 * one row); there float32 keeps the 256-bit path (SPLIT_512).
 */
static inline __attribute__((always_inline)) void pass_512(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int rows)
{
    const int pairs = rows <= 2 ? 2 : 1; /* groups whose sums go to chains of their own */
    const int64_t bytes = block_bytes(type);
    __m512 acc[STREAM_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        __m512 even[2], odd[2];
        widen_512(row + b * bytes, type, even);
        widen_512(row + (b + 1) * bytes, type, odd);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + 32 * b;
            for (int j = 0; j < 2; j++) {
                acc[r][j] = _mm512_fmadd_ps(even[j], _mm512_loadu_ps(xb + 16 * j), acc[r][j]);
                acc[r][2 * (pairs - 1) + j] =
                    _mm512_fmadd_ps(odd[j], _mm512_loadu_ps(xb + 32 + 16 * j), acc[r][2 * (pairs - 1) + j]);
            }
        }
    }
    if (b < blocks) {
        __m512 last[2];
        widen_512(row + b * bytes, type, last);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 2; j++)
                acc[r][j] = _mm512_fmadd_ps(last[j], _mm512_loadu_ps(x + r * x_stride + 32 * b + 16 * j), acc[r][j]);
    }
    for (int r = 0; r < rows; r++) {
        __m512 total = _mm512_add_ps(acc[r][0], acc[r][1]);
        if (pairs == 2) total = _mm512_add_ps(total, _mm512_add_ps(acc[r][2], acc[r][3]));
        y[r * y_stride + n] = _mm512_reduce_add_ps(total) + bias;
    }
}
#else
#define PASS_512 0
#endif

static inline __attribute__((always_inline)) void pass(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int bf16, const int rows)
{
#if PASS_512 && !SPLIT_512
    if (!bf16 && rows <= STREAM_ROWS && widens_512(type)) {
        pass_512(x, x_stride, blocks, row, y, y_stride, n, bias, type, rows);
        return;
    }
#endif
    const int chains = rows <= 2 ? 4 : rows <= STREAM_ROWS ? 2 : 1;
    __m256 acc[WIDE_STREAM_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chains; c++) acc[r][c] = _mm256_setzero_ps();
    FOR_EACH_GROUP(row, blocks, type, bf16, {
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + 32 * b;
            for (int j = 0; j < 4; j++)
                acc[r][j % chains] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % chains]);
        }
    });
    for (int r = 0; r < rows; r++) {
        __m256 total = acc[r][0];
        for (int c = 1; c < chains; c++) total = _mm256_add_ps(total, acc[r][c]);
        y[r * y_stride + n] = hsum8(total) + bias;
    }
}

/* Output `n` for every row of x (at most STREAM_ROWS), on `type` blocks widened as `bf16` says
 * (constants once inlined). */
static inline __attribute__((always_inline)) void output(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t rows,
    int64_t y_stride, int64_t n, float bias, const int type, const int bf16)
{
    switch (rows) {
    case 6: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 6); break;
    case 5: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 5); break;
    case 4: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 4); break;
    case 3: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 3); break;
    case 2: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 2); break;
    case 1: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 1); break;
    default: break;
    }
}

/* output for STREAM_ROWS + 1 to WIDE_STREAM_ROWS rows of x, where `type` streams wide. */
static inline __attribute__((always_inline)) void output_wide(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t rows,
    int64_t y_stride, int64_t n, float bias, const int type, const int bf16)
{
    if (!stream_wide(type)) return;
    switch (rows) {
    case 12: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 12); break;
    case 11: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 11); break;
    case 10: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 10); break;
    case 9: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 9); break;
    case 8: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 8); break;
    case 7: pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, bf16, 7); break;
    default: break;
    }
}

/* The streaming path: each weight row read once from memory, for all rows of x in one pass: up to
 * STREAM_ROWS rows (stream_narrow_rows), or more where `type` streams wide (stream_wide_rows). Two
 * functions, one for each switch: with both switches in one loop the 1-2 row steps ran 1.6-3%
 * slower, and with one always-inline loop over a constant choice the 8-10 row steps 2.5-5%. */
SHARED void stream_narrow_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads);
SHARED void stream_wide_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads);

#if PART == NARROW_PART
SHARED void stream_narrow_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    const int64_t blocks = k / 32;
    const int64_t row_bytes = k / weights_per_block(type) * block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
        fetch_ahead(row, row_bytes);
        const float b = bias == NULL ? 0.0f : bias[o];
#define OUTPUT(T, B) output(x, x_stride, blocks, row, y, rows, y_stride, o, b, T, B)
        WITH_TYPE(type, OUTPUT);
#undef OUTPUT
    }
}
#endif

#if PART == MAIN_PART
SHARED void stream_wide_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    const int64_t blocks = k / 32;
    const int64_t row_bytes = k / weights_per_block(type) * block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
        fetch_ahead(row, row_bytes);
        const float b = bias == NULL ? 0.0f : bias[o];
#define OUTPUT(T, B) output_wide(x, x_stride, blocks, row, y, rows, y_stride, o, b, T, B)
        WITH_TYPE(type, OUTPUT);
#undef OUTPUT
    }
}

static void stream_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    if (rows > STREAM_ROWS)
        stream_wide_rows(x, x_stride, w, type, bias, y, y_stride, rows, n, k, threads);
    else
        stream_narrow_rows(x, x_stride, w, type, bias, y, y_stride, rows, n, k, threads);
}
#endif

#if BFLOAT16 && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define DOT_BF16 1
/*
 * The bfloat16 streaming path on a CPU that multiplies bfloat16 (AVX-512 BF16): each group's 32
 * widened weights are rounded to bfloat16 by the two conversions that pack them (nearest even, as
 * round_bf16 rounds; the flush of float32 subnormals to zero aside, which no block type's widened
 * weight is but for a 4-bit float under the smallest e8m0 scales) and multiplied with x's bfloat16
 * pairs as they are: the products exact, their sums float32, as in the rounding path but for the
 * order of the additions. Half the instructions of rounding each weight and multiplying x widened
 * to float32: SmolLM2's Q4_1 linears and Q8_0 head at one row 6.95 ms against 9.88 on a 2-core
 * Zen 4 (1.42x; 1.32-1.42x at 2-6 rows), and against the pair-layout kernel's 9.0 on the model's
 * bfloat16 copy (gpu_worker/linear.py takes it for steps of up to SMALL_STEP_ROWS rows there). On an Intel Xeon
 * with AMX the same: 1.05-1.14x at 1-2 rows but 0.89-0.96x at 4-6, where the dot products, not
 * the bytes, set the pace; kernels/cpu_block_linear.py sets dot_rows to 2 on such CPUs.
 */
#if PASS_512
#define DOT_512 1
/* The 32 weights of a group whose 16 quant bytes hold weights 0..15 in their low nibbles and 16..31
 * in their high ones (Q4_0, Q4_1, IQ4_NL, MXFP4, IQ4_XS), as 16-bit indices: the bytes twice, the
 * second copy shifted down by 4, masked, then widened. */
static inline __attribute__((always_inline)) __m512i nibble_index(const uint8_t *quants)
{
    const __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quants));
    const __m256i shifts = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi16(twice, shifts), _mm256_set1_epi8(0x0f));
    return _mm512_cvtepu8_epi16(nibbles);
}

/* ggml's non-linear 4-bit levels (IQ4_NL, IQ4_XS) and MXFP4's doubled E2M1 values, by nibble, in
 * float32: nl_levels' and fp4_levels' bytes. */
static inline __m512 nl_values(void)
{
    return _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}
static inline __m512 fp4_values(void)
{
    return _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

/* The types whose 32-weight blocks dot_pass_512 looks up by nibble (Q5_0 and Q5_1 by nibble and
 * fifth bit). */
static inline int looks_up_512(int type)
{
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_IQ4_NL || type == TYPE_MXFP4 || type == TYPE_Q5_0 ||
           type == TYPE_Q5_1;
}

/* A Q5_0 or Q5_1 block as 32 bfloat16 weights: its 32 values fma(q, d, m) (m = -16d for Q5_0) for q
 * = 0..31, as widen computes them, rounded to bfloat16 once; each weight's nibble (nibble_index)
 * plus 16 where bit j of h, just before the quants, is set for weight j. On a 2-core AMD EPYC (Zen
 * 4), a 1B-class layer's four linears (as for dot_pass_super_512 below) against the 256-bit path:
 * Q5_0 10.32 ms against 13.99 at one row, 18.39 against 24.23 at six (1.32-1.42x at 1-6 rows); Q5_1
 * 10.78 against 16.44 and 18.04 against 28.48 (1.52-1.65x). */
static inline __attribute__((always_inline)) __m512bh q5_group_bf16(const uint8_t *block, const int type)
{
    const __m512 scale = _mm512_set1_ps(half_to_float(block));
    const __m512 add = type == TYPE_Q5_1 ? _mm512_set1_ps(half_to_float(block + 2))
                                         : _mm512_mul_ps(scale, _mm512_set1_ps(-16.0f)); /* exact */
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i values = (__m512i)_mm512_cvtne2ps_pbh(
        _mm512_fmadd_ps(_mm512_add_ps(q, _mm512_set1_ps(16.0f)), scale, add), _mm512_fmadd_ps(q, scale, add));
    const uint8_t *quants = block + quants_at(type);
    uint32_t fifth;
    __builtin_memcpy(&fifth, quants - 4, 4);
    const __m512i index = nibble_index(quants);
    return (__m512bh)_mm512_permutexvar_epi16(
        _mm512_mask_add_epi16(index, (__mmask32)fifth, index, _mm512_set1_epi16(16)), values);
}

/* The 16 values a block of a type that looks_up_512 takes stands for, by nibble, in float32: each
 * the very value widen gives (fma(q, d, m), d * NL[q], FP4[q] * 2^(e - 128)). */
static inline __attribute__((always_inline)) __m512 nibble_values(const uint8_t *block, const int type)
{
    if (type == TYPE_IQ4_NL) return _mm512_mul_ps(nl_values(), _mm512_set1_ps(half_to_float(block)));
    if (type == TYPE_MXFP4) return _mm512_mul_ps(fp4_values(), _mm512_set1_ps(e8m0_half(block[0])));
    return q4_values(block, type);
}

/* nibble_values in bfloat16, computed as two halves of 8 on 256-bit registers: the same values, in
 * fewer passes where 512-bit operations take two (SPLIT_512). */
static inline __attribute__((always_inline)) __m256bh nibble_values_256(const uint8_t *block, const int type)
{
    __m256 scale, add = _mm256_setzero_ps(), low, high;
    if (type == TYPE_Q4_1) { /* d, m, d, m, ... */
        int32_t pair;
        __builtin_memcpy(&pair, block, 4);
        const __m256 both = _mm256_cvtph_ps(_mm_set1_epi32(pair));
        scale = _mm256_moveldup_ps(both);
        add = _mm256_movehdup_ps(both);
    } else if (type == TYPE_MXFP4) {
        scale = _mm256_set1_ps(e8m0_half(block[0]));
    } else {
        uint16_t bits;
        __builtin_memcpy(&bits, block, 2);
        scale = _mm256_cvtph_ps(_mm_set1_epi16((short)bits));
        if (type == TYPE_Q4_0) add = _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f)); /* exact */
    }
    if (type == TYPE_Q4_0 || type == TYPE_Q4_1) {
        low = _mm256_fmadd_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), scale, add);
        high = _mm256_fmadd_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), scale, add);
    } else {
        const __m512 levels = type == TYPE_IQ4_NL ? nl_values() : fp4_values();
        low = _mm256_mul_ps(_mm512_castps512_ps256(levels), scale);
        high = _mm256_mul_ps(_mm512_extractf32x8_ps(levels, 1), scale);
    }
    return _mm256_cvtne2ps_pbh(high, low);
}

/*
 * A block of a type that looks_up_512 takes as 32 bfloat16 weights in one 512-bit register: its 16
 * values rounded to bfloat16 once, as the packing below rounds them, then vpermw picks each
 * weight's. So each weight is the very value of the 256-bit path. Q8_0's are widened and rounded
 * as the 256-bit path rounds them. Where 512-bit operations take two passes the 16 values come
 * from nibble_values_256: on a 2-core AMD EPYC (Zen 4), SmolLM2's Q4_1 linears and Q8_0 head at one
 * row 6.05 ms against 6.55, at two 6.84 against 7.27; a 1B-class layer in IQ4_NL 1.03-1.11x at one
 * to four rows, in MXFP4 no change.
 */
static inline __attribute__((always_inline)) __m512bh group_bf16(const uint8_t *block, const int type)
{
    if (type == TYPE_Q8_0) {
        __m512 w[2];
        widen_512(block, type, w);
        return _mm512_cvtne2ps_pbh(w[1], w[0]);
    }
    if (type == TYPE_Q5_0 || type == TYPE_Q5_1) return q5_group_bf16(block, type);
    const __m256bh values = SPLIT_512 ? nibble_values_256(block, type) : _mm512_cvtneps_pbh(nibble_values(block, type));
    return (__m512bh)_mm512_permutexvar_epi16(nibble_index(block + quants_at(type)), _mm512_castsi256_si512((__m256i)values));
}

/*
 * dot_pass for Q8_0 and the types looks_up_512 takes, on 512-bit registers: a group's 32 weights in one
 * register, one dot product a row, two chains of additions a row (even and odd groups). On a
 * 2-core AMD EPYC (Zen 5), SmolLM2's Q4_1 linears and Q8_0 head against the 256-bit path
 * (bench/block_linear_ab.py --dtype bfloat16, medians of 40 in one run): one row 3.62 ms against
 * 4.91, two 3.91 against 5.47, three 4.34 against 6.89, six 5.75 against 8.46. With the blocks in
 * the cache one row took as long per byte, so the widening, not the memory, still sets the pace.
 * On Zen 4, whose 512-bit operations take two passes, it still won from two rows: 1.08x at two,
 * 1.17-1.21x at three to six, and tied at one (7.19 against 7.18 ms), before group_bf16 took
 * nibble_values_256 there.
 */
static inline __attribute__((always_inline)) void dot_pass_512(
    const uint16_t *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int rows)
{
    const int64_t bytes = block_bytes(type);
    __m512 acc[STREAM_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#define X_512(r, b) ((__m512bh)_mm512_loadu_si512(x + (r) * x_stride + 32 * (b)))
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const __m512bh even = group_bf16(row + b * bytes, type), odd = group_bf16(row + (b + 1) * bytes, type);
        for (int r = 0; r < rows; r++) {
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], even, X_512(r, b));
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], odd, X_512(r, b + 1));
        }
    }
    if (b < blocks) {
        const __m512bh last = group_bf16(row + b * bytes, type);
        for (int r = 0; r < rows; r++) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], last, X_512(r, b));
    }
#undef X_512
    for (int r = 0; r < rows; r++) y[r * y_stride + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + bias;
}

/* The super-block types dot_pass_super_512 looks up by nibble. */
static inline int looks_up_super_512(int type)
{
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_IQ4_XS;
}

/*
 * dot_pass for Q4_K, Q5_K and IQ4_XS on 512-bit registers, as dot_pass_512 takes Q4_0 and Q4_1:
 * each weight looked up among its group's values, each the very value widen_group gives, rounded
 * to bfloat16 once. Q4_K's and IQ4_XS's groups g and g + 1 share one register of values (g's 16 in
 * words 0-15, fma(q, d * sc, -dmin * m) or d * (s - 32) * NL[q]; g + 1's in 16-31), so vpermw
 * takes g + 1's nibbles plus 16. Q5_K's groups have 32 values each, the fifth bit (bit g of qh[j])
 * adding 16 to the nibble. On a 2-core AMD EPYC (Zen 4), a 1B-class layer's four linears
 * (bench/block_types.py's shapes, four copies a pass, the two builds alternating) against the
 * 256-bit path, at one row and at six: Q4_K 7.66 ms against 12.32 and 15.90 against 23.00, Q5_K
 * 11.07 against 14.08 and 17.98 against 23.82, IQ4_XS 8.50 against 14.94 and 19.93 against 27.39
 * (1.27-1.76x at one to six rows). dot_pass_512's IQ4_NL: 7.77 against 11.69 and 16.03 against
 * 21.90; MXFP4 (another run) 8.86 against 16.58 and 15.73 against 26.52.
 */
static inline __attribute__((always_inline)) void dot_pass_super_512(
    const uint16_t *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int rows)
{
    const int64_t bytes = block_bytes(type);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i nibble = _mm512_set1_epi16(0x0f), second = _mm512_set1_epi16(0x10);
    __m512 acc[STREAM_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#define X_512(r, b) ((__m512bh)_mm512_loadu_si512(x + (r) * x_stride + 32 * (b)))
    for (int64_t first = 0; first < blocks; first += 8) {
        const uint8_t *block = row + (first >> 3) * bytes;
        super_scales s;
        prepare_super(block, type, &s);
        __m512i fifth = _mm512_setzero_si512();
        if (type == TYPE_Q5_K) fifth = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 16)));
        /* Not unrolled: on Zen 4 unrolling the four pairs made Q4_K 5-13% slower and IQ4_XS 12-37% at
         * three and four rows, Q5_K 3-4% faster. */
#pragma GCC unroll 1
        for (int g = 0; g < 8; g += 2) {
            __m512bh even, odd;
            if (type == TYPE_Q5_K) {
                const __m512i quants = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 48 + 16 * g)));
                __m512i low = _mm512_and_si512(quants, nibble), high = _mm512_srli_epi16(quants, 4);
                low = _mm512_mask_add_epi16(low, _mm512_test_epi16_mask(fifth, _mm512_set1_epi16((short)(1 << g))), low, second);
                high = _mm512_mask_add_epi16(
                    high, _mm512_test_epi16_mask(fifth, _mm512_set1_epi16((short)(1 << (g + 1)))), high, second);
                const __m512 q16 = _mm512_add_ps(q, _mm512_set1_ps(16.0f));
                for (int h = 0; h < 2; h++) {
                    const __m512 times = _mm512_set1_ps(s.times[g + h]), minus = _mm512_set1_ps(s.minus[g + h]);
                    const __m512i values = (__m512i)_mm512_cvtne2ps_pbh(
                        _mm512_fmadd_ps(q16, times, minus), _mm512_fmadd_ps(q, times, minus));
                    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(h ? high : low, values);
                    if (h) odd = w; else even = w;
                }
            } else {
                __m512 low_values, high_values;
                __m512i low, high;
                if (type == TYPE_IQ4_XS) {
                    low_values = _mm512_mul_ps(nl_values(), _mm512_set1_ps(s.times[g]));
                    high_values = _mm512_mul_ps(nl_values(), _mm512_set1_ps(s.times[g + 1]));
                    low = nibble_index(block + 8 + 16 * g);
                    high = nibble_index(block + 8 + 16 * (g + 1));
                } else {
                    low_values = _mm512_fmadd_ps(q, _mm512_set1_ps(s.times[g]), _mm512_set1_ps(s.minus[g]));
                    high_values = _mm512_fmadd_ps(q, _mm512_set1_ps(s.times[g + 1]), _mm512_set1_ps(s.minus[g + 1]));
                    const __m512i quants = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + 16 + 16 * g)));
                    low = _mm512_and_si512(quants, nibble);
                    high = _mm512_srli_epi16(quants, 4);
                }
                const __m512i values = (__m512i)_mm512_cvtne2ps_pbh(high_values, low_values);
                even = (__m512bh)_mm512_permutexvar_epi16(low, values);
                odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(high, second), values);
            }
            for (int r = 0; r < rows; r++) {
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], even, X_512(r, first + g));
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], odd, X_512(r, first + g + 1));
            }
        }
    }
#undef X_512
    for (int r = 0; r < rows; r++) y[r * y_stride + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + bias;
}
#else
#define DOT_512 0
#endif

static inline __attribute__((always_inline)) void dot_pass(
    const uint16_t *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int rows)
{
#if DOT_512
    if (type == TYPE_Q8_0 || looks_up_512(type)) {
        dot_pass_512(x, x_stride, blocks, row, y, y_stride, n, bias, type, rows);
        return;
    }
    if (looks_up_super_512(type)) {
        dot_pass_super_512(x, x_stride, blocks, row, y, y_stride, n, bias, type, rows);
        return;
    }
#endif
    /* Two chains of additions for one or two rows, one past that (the rows' own chains). */
    const int chains = rows <= 2 ? 2 : 1, bf16 = 0; /* widened exactly: the packing rounds */
    __m256 acc[STREAM_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 2; c++) acc[r][c] = _mm256_setzero_ps();
    FOR_EACH_GROUP(row, blocks, type, bf16, {
        const __m256bh low = _mm256_cvtne2ps_pbh(w[1], w[0]), high = _mm256_cvtne2ps_pbh(w[3], w[2]);
        for (int r = 0; r < rows; r++) {
            const uint16_t *xb = x + r * x_stride + 32 * b;
            acc[r][0] = _mm256_dpbf16_ps(acc[r][0], low, (__m256bh)_mm256_loadu_si256((const __m256i *)xb));
            acc[r][chains - 1] =
                _mm256_dpbf16_ps(acc[r][chains - 1], high, (__m256bh)_mm256_loadu_si256((const __m256i *)(xb + 16)));
        }
    });
    for (int r = 0; r < rows; r++) {
        const __m256 total = chains == 2 ? _mm256_add_ps(acc[r][0], acc[r][1]) : acc[r][0];
        y[r * y_stride + n] = hsum8(total) + bias;
    }
}

/* dot_pass for every row of x (at most STREAM_ROWS), `type` constant once inlined. */
static inline __attribute__((always_inline)) void dot_output(
    const uint16_t *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t rows,
    int64_t y_stride, int64_t n, float bias, const int type)
{
    switch (rows) {
    case 6: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 6); break;
    case 5: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 5); break;
    case 4: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 4); break;
    case 3: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 3); break;
    case 2: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 2); break;
    case 1: dot_pass(x, x_stride, blocks, row, y, y_stride, n, bias, type, 1); break;
    default: break;
    }
}

/* The streaming path on dot products: y [rows, n] in float32 (bias added), x bfloat16. */
SHARED void dot_stream_rows(
    const uint16_t *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads);

#if PART == DOT_PART
SHARED void dot_stream_rows(
    const uint16_t *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    const int64_t blocks = k / 32;
    const int64_t row_bytes = k / weights_per_block(type) * block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
        fetch_ahead(row, row_bytes);
        const float b = bias == NULL ? 0.0f : bias[o];
#define OUTPUT(T, B) dot_output(x, x_stride, blocks, row, y, rows, y_stride, o, b, T)
        WITH_TYPE(type, OUTPUT);
#undef OUTPUT
    }
}
#endif
static int dot_rows = STREAM_ROWS; /* set by duoserve_block_linear_bf16_dot_rows */
#else
#define DOT_BF16 0
#endif

/* The rest is MAIN_PART's: the tiled path, and the library's entries. */
#if PART == MAIN_PART
const uint8_t *grid_iq2_xxs, *grid_iq2_xs, *grid_iq2_s, *grid_iq3_xxs, *grid_iq3_s, *grid_iq1, *ksigns;

/* Hands over the tables: IQ2_XXS's 256 rows of 8, IQ2_XS's 512, IQ2_S's 1024, IQ3_XXS's 256 rows
 * of 4, IQ3_S's 512 (unsigned values), the IQ1 types' 2048 rows of 8 (signed: 8 times -1, 0 or
 * 1), and the 128 sign patterns. They must outlive every call. */
void duoserve_block_linear_use_codebooks(const uint8_t *iq2_xxs, const uint8_t *iq2_xs, const uint8_t *iq2_s,
                                         const uint8_t *iq3_xxs, const uint8_t *iq3_s, const uint8_t *iq1,
                                         const uint8_t *signs)
{
    grid_iq2_xxs = iq2_xxs, grid_iq2_xs = iq2_xs, grid_iq2_s = iq2_s;
    grid_iq3_xxs = iq3_xxs, grid_iq3_s = iq3_s, grid_iq1 = iq1, ksigns = signs;
}

/*
 * Many rows (prefill chunks, large decode batches): there the multiplies, not the weights' bytes,
 * set the time, and widening a block again for every few rows costs more than it saves. Each
 * thread widens a panel of output rows once into a float32 scratch that stays in its second-level
 * cache. x is copied once a call into column order, TILE_ROWS rows at a time ([k][TILE_ROWS], the
 * last group padded with zeros), so that a register tile of TILE_ROWS rows by TILE_OUTS outputs
 * takes, per k, two loads of x and one broadcast weight per output for 2 * TILE_OUTS
 * multiply-adds into as many independent sums. Rows go in bands of BAND_GROUPS groups, each
 * panel widened again per band, so that a band of x stays in cache while the panels pass over it.
 * The values multiplied are the same widened ones as above; each sum runs over k in order.
 */
#define TILE_ROWS 16
#define TILE_OUTS 6
#define BAND_GROUPS 4 /* row groups a panel is widened for: x's band stays in cache */
#define PANEL_BYTES (160 * 1024) /* of a core's 512 KB second-level cache on Zen 3 */

static inline __attribute__((always_inline)) void widen_row(
    const uint8_t *row, int64_t blocks, const int type, const int bf16, float *out)
{
    FOR_EACH_GROUP(row, blocks, type, bf16, {
        for (int j = 0; j < 4; j++) _mm256_store_ps(out + 32 * b + 8 * j, w[j]);
    });
}

/* y[r][o] = x[r] . w[o] (+ bias[o]) for r < rows and o < outs (at most TILE_ROWS and TILE_OUTS;
 * xt holds TILE_ROWS rows and w TILE_OUTS outputs, padded with zeros). xt is [k][TILE_ROWS], w the
 * widened panel, row stride k. The sums are named, not an array, so that they stay in registers. */
static void tile(const float *xt, const float *w, int64_t k, float *y, int64_t y_stride, const float *bias,
                 int rows, int outs)
{
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k, *w4 = w + 4 * k, *w5 = w + 5 * k;
    for (int64_t i = 0; i < k; i++) {
        const __m256 x0 = _mm256_load_ps(xt + i * TILE_ROWS);
        const __m256 x1 = _mm256_load_ps(xt + i * TILE_ROWS + 8);
        __m256 b = _mm256_broadcast_ss(w0 + i);
        a00 = _mm256_fmadd_ps(b, x0, a00);
        a01 = _mm256_fmadd_ps(b, x1, a01);
        b = _mm256_broadcast_ss(w1 + i);
        a10 = _mm256_fmadd_ps(b, x0, a10);
        a11 = _mm256_fmadd_ps(b, x1, a11);
        b = _mm256_broadcast_ss(w2 + i);
        a20 = _mm256_fmadd_ps(b, x0, a20);
        a21 = _mm256_fmadd_ps(b, x1, a21);
        b = _mm256_broadcast_ss(w3 + i);
        a30 = _mm256_fmadd_ps(b, x0, a30);
        a31 = _mm256_fmadd_ps(b, x1, a31);
        b = _mm256_broadcast_ss(w4 + i);
        a40 = _mm256_fmadd_ps(b, x0, a40);
        a41 = _mm256_fmadd_ps(b, x1, a41);
        b = _mm256_broadcast_ss(w5 + i);
        a50 = _mm256_fmadd_ps(b, x0, a50);
        a51 = _mm256_fmadd_ps(b, x1, a51);
    }
    float columns[TILE_OUTS][TILE_ROWS] __attribute__((aligned(32)));
    _mm256_store_ps(columns[0], a00), _mm256_store_ps(columns[0] + 8, a01);
    _mm256_store_ps(columns[1], a10), _mm256_store_ps(columns[1] + 8, a11);
    _mm256_store_ps(columns[2], a20), _mm256_store_ps(columns[2] + 8, a21);
    _mm256_store_ps(columns[3], a30), _mm256_store_ps(columns[3] + 8, a31);
    _mm256_store_ps(columns[4], a40), _mm256_store_ps(columns[4] + 8, a41);
    _mm256_store_ps(columns[5], a50), _mm256_store_ps(columns[5] + 8, a51);
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++) y[r * y_stride + o] = columns[o][r] + (bias == NULL ? 0.0f : bias[o]);
}

/* Scratch of this thread's, grown as needed and kept for its next call: a panel for each thread
 * that multiplies, and x in column order for each thread that calls. */
static __thread float *panel_floats = NULL, *column_floats = NULL;
static __thread int64_t panel_capacity = 0, column_capacity = 0;

static float *thread_scratch(float **scratch, int64_t *capacity, int64_t floats)
{
    if (floats > *capacity) {
        free(*scratch);
        *scratch = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        *capacity = *scratch == NULL ? 0 : floats;
    }
    return *scratch;
}

/* Widen weight rows first .. first + outs - 1 into `panel` (row stride k), zero rows after them
 * up to a whole tile. */
static void widen_panel(const uint8_t *w, int type, int64_t first, int64_t outs, int64_t k, float *panel)
{
    const int64_t blocks = k / 32;
    const int64_t row_bytes = k / weights_per_block(type) * block_bytes(type);
    for (int64_t o = 0; o < outs; o++) {
        const uint8_t *row = w + (first + o) * row_bytes;
        fetch_ahead(row, row_bytes);
#define WIDEN_ROW(T, B) widen_row(row, blocks, T, B, panel + o * k)
        WITH_TYPE(type, WIDEN_ROW);
#undef WIDEN_ROW
    }
    for (int64_t o = outs; o < (outs + TILE_OUTS - 1) / TILE_OUTS * TILE_OUTS; o++)
        for (int64_t i = 0; i < k; i++) panel[o * k + i] = 0.0f;
}

/* Rows first_row .. first_row + TILE_ROWS - 1 of x (those below `rows`; zeros past them) into xt
 * as [k][TILE_ROWS]. */
static void columns_of(const float *x, int64_t x_stride, int64_t rows, int64_t first_row, int64_t k, float *xt)
{
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t row = first_row + r;
        for (int64_t i = 0; i < k; i++) xt[i * TILE_ROWS + r] = row < rows ? x[row * x_stride + i] : 0.0f;
    }
}

/* The tiled path, x copied into `xt` (ceil(rows / TILE_ROWS) * TILE_ROWS * k floats, 32-byte
 * aligned); -2 where a thread's panel cannot be had. */
static int tiled_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, float *xt, int threads)
{
    const int64_t groups = (rows + TILE_ROWS - 1) / TILE_ROWS;
    /* Panels of a multiple of TILE_OUTS outputs, as many as fit PANEL_BYTES, their count a
     * multiple of the threads so that each thread gets as much to do. */
    int64_t most = PANEL_BYTES / (4 * k) / TILE_OUTS * TILE_OUTS;
    if (most < TILE_OUTS) most = TILE_OUTS;
    int64_t panels = (n + most - 1) / most;
    panels = (panels + threads - 1) / threads * threads;
    const int64_t width = ((n + panels - 1) / panels + TILE_OUTS - 1) / TILE_OUTS * TILE_OUTS;
    panels = (n + width - 1) / width;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) columns_of(x, x_stride, rows, g * TILE_ROWS, k, xt + g * k * TILE_ROWS);
        float *panel = thread_scratch(&panel_floats, &panel_capacity, width * k);
        failed = panel == NULL;
        /* Every thread meets every loop (OpenMP's rule); the same panels go to the same thread in
         * every band, so none waits for the others between bands. */
        for (int64_t band = 0; band < groups; band += BAND_GROUPS) {
            const int64_t band_end = band + BAND_GROUPS < groups ? band + BAND_GROUPS : groups;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                if (panel == NULL) continue;
                const int64_t first = p * width;
                const int64_t outs = n - first < width ? n - first : width;
                widen_panel(w, type, first, outs, k, panel);
                for (int64_t g = band; g < band_end; g++) {
                    const int64_t r = g * TILE_ROWS;
                    const int tile_rows = rows - r < TILE_ROWS ? (int)(rows - r) : TILE_ROWS;
                    for (int64_t o = 0; o < outs; o += TILE_OUTS)
                        tile(xt + g * k * TILE_ROWS, panel + o * k, k, y + r * y_stride + first + o, y_stride,
                             bias == NULL ? NULL : bias + first + o, tile_rows,
                             outs - o < TILE_OUTS ? (int)(outs - o) : TILE_OUTS);
                }
            }
        }
    }
    return failed ? -2 : 0;
}

/* The product on weights widened as the build says (BFLOAT16); see duoserve_block_linear. */
static int block_linear(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    if (!built_type(type) || k % weights_per_block(type) != 0) return -1;
    const int wide = stream_wide(type) && rows <= WIDE_STREAM_ROWS && rows * k <= WIDE_STREAM_FLOATS;
    if (rows <= STREAM_ROWS || wide) {
        stream_rows(x, x_stride, w, type, bias, y, y_stride, rows, n, k, threads);
        return 0;
    }
    /* A last group of at most STREAM_ROWS rows past whole tiles streams the weight once more
     * instead: cheaper than a tile's multiplies padded to TILE_ROWS rows. */
    const int64_t tail = rows % TILE_ROWS <= STREAM_ROWS ? rows % TILE_ROWS : 0;
    const int64_t tiled = rows - tail;
    if (tiled > 0) {
        float *xt = thread_scratch(&column_floats, &column_capacity, (tiled + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS * k);
        if (xt == NULL) return -2;
        const int status = tiled_rows(x, x_stride, w, type, bias, y, y_stride, tiled, n, k, xt, threads);
        if (status != 0) return status;
    }
    if (tail > 0)
        stream_rows(x + tiled * x_stride, x_stride, w, type, bias, y + tiled * y_stride, y_stride, tail, n, k,
                    threads);
    return 0;
}

/*
 * y [rows, n] (row stride y_stride >= n) = x [rows, k] (row stride x_stride) @ w.T + bias, w [n, k] as
 * `type` blocks, k / 32 per output row (k / 256 super-blocks of a K-quant); bias may be NULL. Up
 * to STREAM_ROWS rows (WIDE_STREAM_ROWS for some types and shapes) stream the weight once (a decode
 * step's time is its bytes and the widening); more take the tiled path (their time is the
 * multiplies), but for a tail of up to STREAM_ROWS rows past whole tiles. Returns 0, -1 for an
 * unknown type or k not in whole blocks, -2 when scratch cannot be had.
 */
#if !BFLOAT16
int duoserve_block_linear(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y, int64_t y_stride,
    int64_t rows, int64_t n, int64_t k, int threads)
{
    return block_linear(x, x_stride, w, type, bias, y, y_stride, rows, n, k, threads);
}

/*
 * out [n, k] (32-byte aligned) = w [n, k] as `type` blocks, widened to float32: every value the
 * dequantized weight itself, as the tiled path multiplies it. A worker makes its float32 copies of
 * the weights so, instead of dequantizing them in numpy. Returns 0, -1 for an unknown type, k not
 * in whole blocks or `out` not aligned, -2 when scratch cannot be had.
 */
int duoserve_block_dequantize(const uint8_t *w, int type, float *out, int64_t n, int64_t k, int threads)
{
    if (!built_type(type) || k % weights_per_block(type) != 0 || (uintptr_t)out % 32 != 0) return -1;
    /* widen_panel writes whole tiles of rows: the rows past the last whole tile go through scratch. */
    const int64_t whole = n / TILE_OUTS * TILE_OUTS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t first = 0; first < whole; first += TILE_OUTS) widen_panel(w, type, first, TILE_OUTS, k, out + first * k);
    if (whole < n) {
        float *panel = thread_scratch(&panel_floats, &panel_capacity, TILE_OUTS * k);
        if (panel == NULL) return -2;
        widen_panel(w, type, whole, n - whole, k, panel);
        memcpy(out + whole * k, panel, (size_t)((n - whole) * k) * sizeof(float));
    }
    return 0;
}
#else

/* Scratch of the calling thread's for the bfloat16 entry: x, y and the bias in float32. */
static __thread float *x_floats = NULL, *y_floats = NULL, *bias_floats = NULL;
static __thread int64_t x_capacity = 0, y_capacity = 0, bias_capacity = 0;

/* Conversions of more elements than this share the threads. */
#define CONVERT_ALONE 65536

/*
 * duoserve_block_linear in bfloat16: x [rows, k] (row stride x_stride), bias [n] (or NULL) and
 * y [rows, n] (row stride y_stride) are bfloat16, and so are the weights: each widened weight is rounded to bfloat16,
 * the value a bfloat16 copy of the dequantized weight holds. The products and their sums are
 * float32 (x and the bias widen exactly); y is rounded to nearest even once. On a CPU with
 * AVX-512 BF16, steps of up to dot_rows rows take the dot products (DOT_BF16). Returns as
 * duoserve_block_linear does.
 */
int duoserve_block_linear_bf16(
    const uint16_t *x, int64_t x_stride, const uint8_t *w, int type, const uint16_t *bias, uint16_t *y,
    int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads)
{
    float *xf = thread_scratch(&x_floats, &x_capacity, rows * k);
    float *yf = thread_scratch(&y_floats, &y_capacity, rows * n);
    float *bf = bias == NULL ? NULL : thread_scratch(&bias_floats, &bias_capacity, n);
    if (xf == NULL || yf == NULL || (bias != NULL && bf == NULL)) return -2;
    if (bias != NULL)
        for (int64_t o = 0; o < n; o++) bf[o] = bf16_to_float(bias[o]);
#if DOT_BF16
    if (rows <= dot_rows && built_type(type) && k % weights_per_block(type) == 0) { /* x as it is */
        dot_stream_rows(x, x_stride, w, type, bf, yf, n, rows, n, k, threads);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < n; o++) y[r * y_stride + o] = float_to_bf16(yf[r * n + o]);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k > CONVERT_ALONE)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = bf16_to_float(x[r * x_stride + i]);
    const int status = block_linear(xf, k, w, type, bf, yf, n, rows, n, k, threads);
    if (status != 0) return status;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > CONVERT_ALONE)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < n; o++) y[r * y_stride + o] = float_to_bf16(yf[r * n + o]);
    return 0;
}

/* 1 where this build's streaming path multiplies on bfloat16 dot products (DOT_BF16), else 0. */
int duoserve_block_linear_bf16_dot_products(void)
{
    return DOT_BF16;
}

/* Steps of up to `rows` rows (at most STREAM_ROWS, the default) take the dot products, the others
 * the rounding path; a negative `rows` leaves the limit as it is. Returns the limit now in force
 * (0 where this build has no dot products). */
int duoserve_block_linear_bf16_dot_rows(int rows)
{
#if DOT_BF16
    if (rows >= 0) dot_rows = rows > STREAM_ROWS ? STREAM_ROWS : rows;
    return dot_rows;
#else
    (void)rows;
    return 0;
#endif
}
#endif
#endif /* MAIN_PART */
