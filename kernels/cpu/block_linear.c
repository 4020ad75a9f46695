/*
 * y = x @ w.T (+ bias) in float32 on a weight kept in the GGUF file's own blocks (Q8_0, Q4_0,
 * Q4_1), for decode-sized batches. A decode step streams every weight once and does two flops
 * with each byte-sized piece of it, so its time is the weights' bytes over the memory's speed:
 * SmolLM2-135M's Q4_1 linears and Q8_0 head are 96 MB where their float32 copies are 538 MB.
 *
 * Block layouts, 32 weights each, per output row k / 32 blocks in a row (ggml's):
 *   Q8_0: fp16 d, int8 q[32]                      w[j] = d * q[j]
 *   Q4_0: fp16 d, uint8 q[16]                     w[j] = d * (nibble[j] - 8)
 *   Q4_1: fp16 d, fp16 m, uint8 q[16]             w[j] = d * nibble[j] + m
 * where nibble[j] is the low half of q[j] for j < 16 and the high half of q[j - 16] after.
 *
 * Each block is widened to float32 in registers, to the very values dequantizing it in float32
 * gives (d * q is exact: an fp16 times an integer of at most 8 bits fits float32's mantissa; the
 * additive term joins with one rounding), so the result is x @ dequantize(w).T with the
 * additions in another order: equal to float32 rounding. Each thread takes an equal run of output rows; per
 * output row, rows of x go in passes of up to four, the weight row's blocks read from memory by
 * the first pass and from the first-level cache by the next.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the block linear needs AVX2, FMA and F16C"
#endif

/* ggml's type numbers, as in the GGUF file. */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 };

static inline float half_to_float(const uint8_t *p)
{
    uint16_t bits;
    __builtin_memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

/* Bytes of one block, and where its quants start. */
static inline int64_t block_bytes(int type) { return type == TYPE_Q8_0 ? 34 : type == TYPE_Q4_1 ? 20 : 18; }
static inline int64_t quants_at(int type) { return type == TYPE_Q4_1 ? 4 : 2; }

/* The block's 32 weights as float32 in w[0..3]: each d * q + m (Q4_1), d * q - 8d (Q4_0) or
 * d * q (Q8_0) with one rounding, as dequantizing in float32 gives them (d * q is exact). */
static inline __attribute__((always_inline)) void widen(const uint8_t *block, const int type, __m256 w[4])
{
    const float d = half_to_float(block);
    const __m256 scale = _mm256_set1_ps(d);
    const uint8_t *q = block + quants_at(type);
    if (type == TYPE_Q8_0) {
        for (int j = 0; j < 4; j++) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * j));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
        }
        return;
    }
    const __m256 add = _mm256_set1_ps(type == TYPE_Q4_1 ? half_to_float(block + 2) : -8.0f * d);
    const __m128i packed = _mm_loadu_si128((const __m128i *)q);
    const __m128i low_mask = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(packed, low_mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(w[j], scale, add);
}

static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/*
 * Output `n` for `rows` (1-4) rows of x from `x`, on `type` blocks (both constants once
 * inlined). Chains of additions: four per row for one or two rows, two per row past that, so
 * that the additions' latency hides behind the widening and the loads.
 */
static inline __attribute__((always_inline)) void pass(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t y_stride,
    int64_t n, float bias, const int type, const int rows)
{
    const int chains = rows <= 2 ? 4 : 2;
    __m256 acc[6][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chains; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t size = block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w[4];
        widen(row + b * size, type, w);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + 32 * b;
            for (int j = 0; j < 4; j++)
                acc[r][j % chains] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % chains]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 total = acc[r][0];
        for (int c = 1; c < chains; c++) total = _mm256_add_ps(total, acc[r][c]);
        y[r * y_stride + n] = sum8(total) + bias;
    }
}

/* Output `n` for every row of x, on `type` blocks (a constant once inlined). */
static inline __attribute__((always_inline)) void output(
    const float *x, int64_t x_stride, int64_t blocks, const uint8_t *row, float *y, int64_t rows,
    int64_t n_total, int64_t n, float bias, const int type)
{
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6)
        pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 6);
    switch (rows - r) {
    case 5: pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 5); break;
    case 4: pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 4); break;
    case 3: pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 3); break;
    case 2: pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 2); break;
    case 1: pass(x + r * x_stride, x_stride, blocks, row, y + r * n_total, n_total, n, bias, type, 1); break;
    default: break;
    }
}

/*
 * y [rows, n] (row stride n) = x [rows, k] (row stride x_stride) @ w.T + bias, w [n, k] as
 * `type` blocks, k / 32 per output row; bias may be NULL. Returns 0, or -1 for an unknown type
 * or k not in 32s.
 */
int duoserve_block_linear(
    const float *x, int64_t x_stride, const uint8_t *w, int type, const float *bias, float *y, int64_t rows,
    int64_t n, int64_t k, int threads)
{
    if ((type != TYPE_Q8_0 && type != TYPE_Q4_0 && type != TYPE_Q4_1) || k % 32 != 0) return -1;
    const int64_t blocks = k / 32;
    const int64_t row_bytes = blocks * block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
        const float b = bias == NULL ? 0.0f : bias[o];
        if (type == TYPE_Q8_0)
            output(x, x_stride, blocks, row, y, rows, n, o, b, TYPE_Q8_0);
        else if (type == TYPE_Q4_1)
            output(x, x_stride, blocks, row, y, rows, n, o, b, TYPE_Q4_1);
        else
            output(x, x_stride, blocks, row, y, rows, n, o, b, TYPE_Q4_0);
    }
    return 0;
}
