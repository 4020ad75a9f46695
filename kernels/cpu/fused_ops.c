/*
 * The decoder layer's small ops for the CPU worker, one pass each instead of a chain of torch
 * ops (each of which costs a dispatch and a trip through memory): residual add + RMSNorm,
 * rotary embedding in place, SiLU-and-multiply, and the KV write into the paged cache.
 * Rounding follows the torch path step by step (float32 math, rounded to the element type
 * where torch's ops round), as the Triton versions in kernels/fused_ops.py do. Built by
 * kernels/cpu_fused.py with -DELEM_BF16=0|1; OpenMP shares the rows out.
 *
 * In bfloat16 on a CPU with AVX-512 BF16, the norms, SiLU-and-multiply and rotary run 16 elements
 * at a time with the CPU's own rounding instruction (vcvtneps2bf16: round to nearest even, as
 * store() rounds), up to twice as fast as the compiler's vectorisation of store()'s bit
 * arithmetic. Their results are store()'s bit for bit but for two cases: a NaN's payload bits,
 * and values below bfloat16's smallest normal number (about 1.2e-38), which the instruction
 * flushes to zero as the AMX kernels' outputs already are.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elements.h"
#ifdef __AVX512F__
#include "avx512.h"
#endif

/* x * sigmoid(x), with exp taken only of non-positive arguments. */
static inline float silu(float x)
{
    const float e = exp_nonpositive(x < 0.0f ? x : -x); /* exp(-|x|) */
    const float sigmoid = (x < 0.0f ? e : 1.0f) / (1.0f + e); /* one division, either side */
    return x * sigmoid;
}

#if ELEM_BF16 && defined(__AVX512BF16__)
#define NATIVE_BF16 1
/* 16 float32 values rounded to bfloat16, nearest even, in one instruction (avx512.h widens back). */
static inline __m256i round16_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
#define NATIVE_BF16 0
#endif

/* out = round(round(h * scale) * w) for one row h of `cols` elements (both norms' last pass). */
static inline void write_normed(const elem_t *h, const elem_t *weight, elem_t *out, int64_t cols, float scale)
{
    int64_t c = 0;
#if NATIVE_BF16
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (; c + 16 <= cols; c += 16) {
        const __m512 normed = widen16_bf16(round16_bf16(_mm512_mul_ps(load16_bf16(h + c), scale16)));
        _mm256_storeu_si256((__m256i *)(out + c), round16_bf16(_mm512_mul_ps(normed, load16_bf16(weight + c))));
    }
#endif
    for (; c < cols; c++) out[c] = store(round_elem(load(h[c]) * scale) * load(weight[c]));
}

/* residual[t] = x[t] + residual[t] (rounded); out[t] = round(round(h * rsqrt(mean(h^2) + eps)) * w). */
void duoserve_add_rms_norm(const elem_t *x, elem_t *residual, const elem_t *weight, elem_t *out, int64_t rows,
                           int64_t cols, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *xr = x + r * cols;
        elem_t *res = residual + r * cols;
        elem_t *o = out + r * cols;
        float squares = 0.0f;
        int64_t c = 0;
#if NATIVE_BF16
        __m512 sum = _mm512_setzero_ps();
        for (; c + 16 <= cols; c += 16) {
            const __m256i h = round16_bf16(_mm512_add_ps(load16_bf16(xr + c), load16_bf16(res + c)));
            _mm256_storeu_si256((__m256i *)(res + c), h);
            const __m512 hf = widen16_bf16(h);
            sum = _mm512_fmadd_ps(hf, hf, sum);
        }
        squares = _mm512_reduce_add_ps(sum);
#endif
        for (; c < cols; c++) {
            const float h = round_elem(load(xr[c]) + load(res[c]));
            res[c] = store(h);
            squares += h * h;
        }
        write_normed(res, weight, o, cols, 1.0f / sqrtf(squares / (float)cols + eps));
    }
}

/* RMSNorm alone (the first layer's input norm): out = round(round(h * rsqrt(mean(h^2) + eps)) * w). */
void duoserve_rms_norm(const elem_t *x, const elem_t *weight, elem_t *out, int64_t rows, int64_t cols, float eps,
                       int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *xr = x + r * cols;
        elem_t *o = out + r * cols;
        float squares = 0.0f;
        for (int64_t c = 0; c < cols; c++) squares += load(xr[c]) * load(xr[c]);
        write_normed(xr, weight, o, cols, 1.0f / sqrtf(squares / (float)cols + eps));
    }
}

/* out[t] = round(round(silu(gate[t])) * up[t]) for gate_up[t] = [gate | up], each ffn wide. */
void duoserve_silu_and_mul(const elem_t *gate_up, elem_t *out, int64_t rows, int64_t ffn, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * ffn > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *gate = gate_up + r * 2 * ffn, *up = gate + ffn;
        elem_t *o = out + r * ffn;
        int64_t c = 0;
#if NATIVE_BF16
        for (; c + 16 <= ffn; c += 16) {
            const __m512 activated = widen16_bf16(round16_bf16(silu16(load16_bf16(gate + c))));
            _mm256_storeu_si256((__m256i *)(o + c), round16_bf16(_mm512_mul_ps(activated, load16_bf16(up + c))));
        }
#endif
        for (; c < ffn; c++) {
            o[c] = store(round_elem(silu(load(gate[c]))) * load(up[c]));
        }
    }
}

/* Rotate the half-split pairs of every head of q [T, q_heads, D] and k [T, k_heads, D] in place
 * (rows q_stride / k_stride elements apart) by the angles whose cos and sin (already rounded to
 * the element type, [T, D / 2] float32) are given; each product is rounded before the sum, as
 * torch computes them. */
void duoserve_rotary(elem_t *q, int64_t q_stride, int64_t q_heads, elem_t *k, int64_t k_stride, int64_t k_heads,
                     const float *cos_table, const float *sin_table, int64_t tokens, int64_t half, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos_ = cos_table + t * half, *sin_ = sin_table + t * half;
        for (int pass = 0; pass < 2; pass++) {
            elem_t *row = pass == 0 ? q + t * q_stride : k + t * k_stride;
            const int64_t heads = pass == 0 ? q_heads : k_heads;
            for (int64_t h = 0; h < heads; h++) {
                elem_t *x1 = row + h * 2 * half, *x2 = x1 + half;
                int64_t j = 0;
#if NATIVE_BF16
                for (; j + 16 <= half; j += 16) {
                    const __m512 a = load16_bf16(x1 + j), b = load16_bf16(x2 + j);
                    const __m512 c16 = _mm512_loadu_ps(cos_ + j), s16 = _mm512_loadu_ps(sin_ + j);
                    const __m512 a_cos = widen16_bf16(round16_bf16(_mm512_mul_ps(a, c16)));
                    const __m512 b_sin = widen16_bf16(round16_bf16(_mm512_mul_ps(b, s16)));
                    const __m512 b_cos = widen16_bf16(round16_bf16(_mm512_mul_ps(b, c16)));
                    const __m512 a_sin = widen16_bf16(round16_bf16(_mm512_mul_ps(a, s16)));
                    _mm256_storeu_si256((__m256i *)(x1 + j), round16_bf16(_mm512_sub_ps(a_cos, b_sin)));
                    _mm256_storeu_si256((__m256i *)(x2 + j), round16_bf16(_mm512_add_ps(b_cos, a_sin)));
                }
#endif
                for (; j < half; j++) {
                    const float a = load(x1[j]), b = load(x2[j]);
                    x1[j] = store(round_elem(a * cos_[j]) - round_elem(b * sin_[j]));
                    x2[j] = store(round_elem(b * cos_[j]) + round_elem(a * sin_[j]));
                }
            }
        }
    }
}

/* Copy each token's K and V rows (row elements, rows k_stride / v_stride apart) to their cache slot.
 * Prompt-sized writes are shared out over the threads: a thread's stores into cache lines that
 * are not in its caches wait on memory, so one thread took 0.25-0.28 ms a layer for 2048 tokens
 * of SmolLM2 (1.5 MB). */
void duoserve_write_kv(const elem_t *k, int64_t k_stride, const elem_t *v, int64_t v_stride, elem_t *k_cache,
                       elem_t *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 128)
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, (size_t)row * sizeof(elem_t));
        memcpy(v_cache + slots[t] * row, v + t * v_stride, (size_t)row * sizeof(elem_t));
    }
}

/* One row of `dim` elements as int8 with its scale: scale = max|x| / 127, q = round(x * 127 / max|x|)
 * (to nearest, ties to even, as torch.round); an all-zero row is zeros with scale 0. */
static void quantize_row(const elem_t *x, int64_t dim, int8_t *q, float *scale)
{
#ifdef __AVX512F__
    if (dim % 16 == 0 && dim <= 256) { /* the same arithmetic, 16 lanes at a time: the scalar loop below does not vectorise */
        __m512 wide[16];
        __m512 top16 = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim / 16; c++) {
#if ELEM_BF16
            wide[c] = load16_bf16(x + 16 * c);
#else
            wide[c] = _mm512_loadu_ps(x + 16 * c);
#endif
            top16 = _mm512_max_ps(top16, _mm512_abs_ps(wide[c]));
        }
        const float top = _mm512_reduce_max_ps(top16);
        const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        for (int64_t c = 0; c < dim / 16; c++) { /* rounded to nearest even (the default mode), saturated */
            const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(wide[c], inverse));
            const __m512i clamped = _mm512_max_epi32(_mm512_min_epi32(rounded, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            _mm_storeu_si128((__m128i *)(q + 16 * c), _mm512_cvtepi32_epi8(clamped));
        }
        *scale = top * (1.0f / 127.0f);
        return;
    }
#endif
    float top = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        const float a = __builtin_fabsf(load(x[i]));
        top = a > top ? a : top;
    }
    const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        const float r = __builtin_rintf(load(x[i]) * inverse);
        q[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    *scale = top * (1.0f / 127.0f);
}

/* The int8 cache's write (kernels/kv_int8.py): each token's K and V rows (heads * dim elements,
 * rows k_stride / v_stride apart), head by head, quantized into their slot; the scales go to
 * [num_blocks, heads, block_size]. Prompt-sized writes are shared out over the threads (a
 * 2048-token step's 30 layers took 26 ms on one, 9 for the dense copy). */
void duoserve_write_kv_int8(const elem_t *k, int64_t k_stride, const elem_t *v, int64_t v_stride, int8_t *k_cache,
                            int8_t *v_cache, float *k_scale, float *v_scale, const int64_t *slots, int64_t tokens,
                            int64_t heads, int64_t dim, int64_t block_size, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (tokens >= 128)
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = (block * heads + h) * block_size + offset;
            quantize_row(k + t * k_stride + h * dim, dim, k_cache + (slots[t] * heads + h) * dim, k_scale + at);
            quantize_row(v + t * v_stride + h * dim, dim, v_cache + (slots[t] * heads + h) * dim, v_scale + at);
        }
    }
}

/* The int8 cache's rows at `slots` (count of them) times their scales, rounded to the element type,
 * into out [count, heads, dim]: what a chunk behind a cached prefix attends to. */
void duoserve_dequantize_kv_int8(const int8_t *cache, const float *scales, const int64_t *slots, int64_t count,
                                 int64_t heads, int64_t dim, int64_t block_size, elem_t *out, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (count * heads * dim > 65536)
    for (int64_t j = 0; j < count; j++) {
        const int64_t block = slots[j] / block_size, offset = slots[j] % block_size;
        for (int64_t h = 0; h < heads; h++) {
            const float scale = scales[(block * heads + h) * block_size + offset];
            const int8_t *row = cache + (slots[j] * heads + h) * dim;
            elem_t *dst = out + (j * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) dst[i] = store((float)row[i] * scale);
        }
    }
}

/*
 * out[r] = the index of row r's largest element (rows `cols` elements long, contiguous), the first
 * one on ties, as torch's max(dim=-1).indices picks it; a NaN counts as larger than any number
 * (the first NaN wins), and -0 equals +0. Greedy sampling reads the logits once, in their own
 * element type, instead of converting them to float32 first.
 */
#if ELEM_BF16 && defined(__AVX512BW__)
#include <immintrin.h>

/* 32 bfloat16 values as unsigned keys in the same order: negatives flipped whole, positives above
 * them, -0 as +0, every NaN at the top (0xffff). Lanes outside `live` are 0, below every key. */
static inline __m512i order_keys(const elem_t *p, __mmask32 live)
{
    const __m512i bits = _mm512_maskz_loadu_epi16(live, p);
    const __m512i flip = _mm512_or_si512(_mm512_srai_epi16(bits, 15), _mm512_set1_epi16((short)0x8000));
    __m512i key = _mm512_maskz_mov_epi16(live, _mm512_xor_si512(bits, flip));
    key = _mm512_mask_mov_epi16(key, _mm512_cmpeq_epi16_mask(bits, _mm512_set1_epi16((short)0x8000)),
                                _mm512_set1_epi16((short)0x8000));
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi16(0x7fff));
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(magnitude, _mm512_set1_epi16(0x7f80)) & live;
    return _mm512_mask_mov_epi16(key, nan, _mm512_set1_epi16((short)0xffff));
}

/* The first `lanes` of 32 (all of them from 32 on). */
static inline __mmask32 first_lanes(int64_t lanes) { return lanes >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << lanes) - 1u); }

static int64_t row_argmax(const elem_t *x, int64_t cols)
{
    __m512i top = _mm512_setzero_si512();
    for (int64_t c = 0; c < cols; c += 32) {
        const __mmask32 live = first_lanes(cols - c);
        top = _mm512_max_epu16(top, order_keys(x + c, live));
    }
    /* The row's largest key, in every lane: fold the 32 lanes in halves. */
    __m256i half = _mm256_max_epu16(_mm512_castsi512_si256(top), _mm512_extracti64x4_epi64(top, 1));
    __m128i quarter = _mm_max_epu16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
    quarter = _mm_max_epu16(quarter, _mm_shuffle_epi32(quarter, _MM_SHUFFLE(1, 0, 3, 2)));
    quarter = _mm_max_epu16(quarter, _mm_shuffle_epi32(quarter, _MM_SHUFFLE(2, 3, 0, 1)));
    quarter = _mm_max_epu16(quarter, _mm_srli_epi32(quarter, 16));
    const __m512i best = _mm512_set1_epi16((short)_mm_extract_epi16(quarter, 0));
    for (int64_t c = 0; c < cols; c += 32) {
        const __mmask32 live = first_lanes(cols - c);
        const __mmask32 hit = _mm512_cmpeq_epi16_mask(order_keys(x + c, live), best) & live;
        if (hit) return c + __builtin_ctz(hit);
    }
    return 0; /* not reached: some lane holds the largest key */
}
#else
static int64_t row_argmax(const elem_t *x, int64_t cols)
{
    int64_t index = 0;
    float best = load(x[0]);
    for (int64_t c = 1; c < cols && !__builtin_isnan(best); c++) {
        const float v = load(x[c]);
        if (__builtin_isnan(v) || v > best) {
            best = v;
            index = c;
        }
    }
    return index;
}
#endif

void duoserve_argmax_rows(const elem_t *x, int64_t rows, int64_t cols, int64_t *out, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * cols, cols);
}

/*
 * Log-probabilities of the raw logits without writing the row's out: chosen_lp[r] = (x - best) -
 * log(sum of exp(x - best)) at x[r][chosen[r]], the sum in float64 (closer to the exact value than
 * torch's float32 log_softmax: on SmolLM2's logits 1e-7 from float64 against its 1e-5), and the
 * row's n best tokens (n >= 0; by value, ties in token-id order) with theirs. The best n are kept
 * in a small sorted list; 16 values at a time are first compared with its last, which after the
 * first few hundred tokens lets almost every group by.
 */
static void row_logprobs(const elem_t *x, int64_t cols, int64_t chosen, int64_t n, float *chosen_lp, float *top_lp,
                         int64_t *top_ids)
{
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = load(x[0]);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16)
        for (int j = 0; j < 16; j++) lane[j] = load(x[c + j]) > lane[j] ? load(x[c + j]) : lane[j];
    float best = lane[0];
    for (int j = 1; j < 16; j++) best = lane[j] > best ? lane[j] : best;
    for (; c < cols; c++) best = load(x[c]) > best ? load(x[c]) : best;
    double sum = 0.0;
    for (c = 0; c < cols; c++) sum += exp_nonpositive(load(x[c]) - best);
    const float log_sum = (float)log(sum); /* log_softmax = (x - best) - log_sum, as torch's */
    *chosen_lp = (load(x[chosen]) - best) - log_sum;
    int64_t have = 0;
    for (int64_t c0 = 0; c0 < cols && n > 0; c0 += 16) {
        const int64_t end = c0 + 16 < cols ? c0 + 16 : cols;
        if (have == n) {
            int any = 0;
            for (int64_t i = c0; i < end; i++) any |= load(x[i]) > top_lp[n - 1];
            if (!any) continue;
        }
        for (int64_t i = c0; i < end; i++) {
            const float v = load(x[i]);
            if (v != v || (have == n && !(v > top_lp[n - 1]))) continue; /* NaN, or not among the n */
            int64_t j = have < n ? have++ : n - 1; /* it enters at the end, and moves up past smaller */
            for (; j > 0 && top_lp[j - 1] < v; j--) {
                top_lp[j] = top_lp[j - 1];
                top_ids[j] = top_ids[j - 1];
            }
            top_lp[j] = v;
            top_ids[j] = i;
        }
    }
    for (int64_t j = 0; j < n; j++) top_lp[j] = (top_lp[j] - best) - log_sum;
}

void duoserve_logprobs(const elem_t *x, int64_t rows, int64_t cols, const int64_t *chosen, int64_t n,
                       float *chosen_lp, float *top_lp, int64_t *top_ids, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        row_logprobs(x + r * cols, cols, chosen[r], n, chosen_lp + r, top_lp + r * n, top_ids + r * n);
}

/*
 * Sampling's filters without sorting a row (duoserve_draw, below, uses them).
 *
 * Top-p's cut is the score of the last token a row's nucleus keeps: the smallest set of its best
 * tokens that holds top_p of its mass (a token is kept when the tokens strictly better than it
 * hold less than top_p; every token tied with the last kept one is kept too). A row's weights
 * exp((score - best) / temperature) are bucketed by their float32 bits' top 16 (sign, exponent and 7 bits of
 * mantissa: buckets under 1% wide, in the weights' order), each bucket's mass summed; the buckets
 * from the top hold the nucleus up to one of them, whose tokens alone are sorted. Flat rows, whose
 * nucleus spans thousands of tokens, otherwise rank most of the vocabulary.
 *
 * Only the tokens of weight >= floor = (1 - top_p) * total / (2 * cols) are bucketed: the others
 * hold at most half of the 1 - top_p of the mass the nucleus leaves out, so its last token is
 * among the first, and the buckets it counts are the few exponents above the floor's, which
 * stay in the L1 cache. The total is summed in float64, whose rounding is far inside that margin
 * for any top_p below 1 that float32 holds (1 - top_p >= 6e-8). The cut is the one the whole row's
 * buckets give: the buckets above the floor's hold the same tokens either way.
 */
#define WEIGHT_BUCKETS (0x3f80 + 1) /* the top 16 bits of floats in [0, 1] */

typedef struct {
    float score, weight;
} scored_t;

#define DRAW_BLOCK 1024 /* tokens per block of a draw's running total */

/* Each thread's scratch for draws: a row's weights; for top-k and top-p, the buckets' masses (or
 * counts) and room for the row's candidates (their columns and weights) and for one bucket's
 * tokens; the kept mass of each of the row's blocks. */
typedef struct {
    float *w;
    double *mass;
    int32_t *column;
    float *weight;
    scored_t *tied;
    double *block_mass;
} draw_scratch_t;

static int alloc_scratch(draw_scratch_t *scratch, int64_t cols)
{
    scratch->w = malloc((size_t)cols * sizeof(float));
    scratch->mass = malloc(WEIGHT_BUCKETS * sizeof(double));
    scratch->column = malloc((size_t)cols * sizeof(int32_t));
    scratch->weight = malloc((size_t)cols * sizeof(float));
    scratch->tied = malloc((size_t)cols * sizeof(scored_t));
    scratch->block_mass = malloc((size_t)((cols + DRAW_BLOCK - 1) / DRAW_BLOCK) * sizeof(double));
    return scratch->w && scratch->mass && scratch->column && scratch->weight && scratch->tied && scratch->block_mass;
}

static void free_scratch(draw_scratch_t *scratch)
{
    free(scratch->w);
    free(scratch->mass);
    free(scratch->column);
    free(scratch->weight);
    free(scratch->tied);
    free(scratch->block_mass);
}

static int by_score_descending(const void *a, const void *b)
{
    const float x = ((const scored_t *)a)->score, y = ((const scored_t *)b)->score;
    return (x < y) - (x > y);
}

static inline uint32_t weight_bucket(float w)
{
    uint32_t bits;
    memcpy(&bits, &w, sizeof(bits));
    return bits >> 16;
}

/* The row's largest score (s[0] where that is NaN; other NaNs are passed over), over 16
 * independent running maxima so that the loop vectorises without reordering a reduction. */
static float row_max(const float *s, int64_t cols)
{
    float lane[16];
    for (int j = 0; j < 16; j++) lane[j] = s[0];
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16)
        for (int j = 0; j < 16; j++) lane[j] = s[c + j] > lane[j] ? s[c + j] : lane[j];
    float best = lane[0];
    for (int j = 1; j < 16; j++) best = lane[j] > best ? lane[j] : best;
    for (; c < cols; c++) best = s[c] > best ? s[c] : best;
    return best;
}

/* Where block b of a row of `cols` ends: DRAW_BLOCK tokens on, or at the row's end. */
static inline int64_t block_end(int64_t b, int64_t cols)
{
    return (b + 1) * DRAW_BLOCK < cols ? (b + 1) * DRAW_BLOCK : cols;
}

/* The first of the row's largest entries. */
static int64_t first_best(const float *x, int64_t cols)
{
    const float best = row_max(x, cols);
    int64_t c = 0;
    while (c + 1 < cols && x[c] != best) c++;
    return c;
}

/* The columns of the row's tokens of weight >= floor and score >= least, and their weights, in
 * column order, into the scratch; returns how many. */
static int64_t gather_candidates(const float *s, const float *w, int64_t cols, float floor, float least,
                                 draw_scratch_t *scratch)
{
    int32_t *column = scratch->column;
    float *weight = scratch->weight;
    int64_t n = 0, c = 0;
#ifdef __AVX512F__
    /* In registers, then whole-vector stores: a compressing store to memory is slow on some CPUs. */
    const __m512 bound = _mm512_set1_ps(floor), lower = _mm512_set1_ps(least);
    __m512i columns = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; c + 16 <= cols; c += 16) {
        const __m512 v = _mm512_loadu_ps(w + c);
        const __mmask16 kept = _mm512_cmp_ps_mask(v, bound, _CMP_GE_OQ) &
                               _mm512_cmp_ps_mask(_mm512_loadu_ps(s + c), lower, _CMP_GE_OQ);
        _mm512_storeu_si512(column + n, _mm512_maskz_compress_epi32(kept, columns));
        _mm512_storeu_ps(weight + n, _mm512_maskz_compress_ps(kept, v));
        n += __builtin_popcount(kept);
        columns = _mm512_add_epi32(columns, _mm512_set1_epi32(16));
    }
#endif
    for (; c < cols; c++) { /* branch-free: each token is written, and kept by moving on */
        column[n] = (int32_t)c;
        weight[n] = w[c];
        n += w[c] >= floor && s[c] >= least;
    }
    return n;
}

/* The scratch's n candidates narrowed, in place and in order, to those in bucket b; returns how many. */
static int64_t keep_bucket(draw_scratch_t *scratch, int64_t n, uint32_t b)
{
    int32_t *column = scratch->column;
    float *weight = scratch->weight;
    int64_t m = 0, i = 0;
#ifdef __AVX512F__
    /* Each vector is read before the (whole-vector) store that may overwrite it: m <= i. */
    const __m512i bucket = _mm512_set1_epi32((int32_t)b);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(weight + i);
        const __mmask16 kept = _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(_mm512_castps_si512(v), 16), bucket);
        const __m512i columns = _mm512_loadu_si512(column + i);
        _mm512_storeu_si512(column + m, _mm512_maskz_compress_epi32(kept, columns));
        _mm512_storeu_ps(weight + m, _mm512_maskz_compress_ps(kept, v));
        m += __builtin_popcount(kept);
    }
#endif
    for (; i < n; i++) {
        column[m] = column[i];
        weight[m] = weight[i];
        m += weight_bucket(weight[i]) == b;
    }
    return m;
}

/* The row's weights exp((score - best) * scale) into w (scale: 1 / temperature); returns their
 * total, in float64: a cut near top_p = 0.999 can sit a millionth of the mass from the next token,
 * and the floor's margin must outlast the total's rounding. */
static double row_weights(const float *s, int64_t cols, float scale, float *w)
{
    const float best = row_max(s, cols);
    double total = 0.0;
    for (int64_t c = 0; c < cols; c++) {
        w[c] = exp_nonpositive((s[c] - best) * scale);
        total += w[c];
    }
    return total;
}

/* The row's cut among its tokens of score >= least (-INFINITY for all of them), from its weights
 * w and those tokens' total weight. */
static float row_nucleus_cut(const float *s, const float *w, int64_t cols, float top_p, double total, float least,
                             draw_scratch_t *scratch)
{
    const float floor = (float)((1.0 - top_p) * total / (2.0 * (double)cols));
    const int64_t n = gather_candidates(s, w, cols, floor, least, scratch);
    const float *weight = scratch->weight;
    const int64_t lowest = weight_bucket(floor);
    double *mass = scratch->mass;
    memset(mass + lowest, 0, (WEIGHT_BUCKETS - lowest) * sizeof(double));
    for (int64_t i = 0; i < n; i++) mass[weight_bucket(weight[i])] += weight[i];
    const double target = top_p * total;
    double before = 0.0; /* the mass of the buckets above `b` */
    int64_t b = WEIGHT_BUCKETS - 1;
    for (; b > lowest && before + mass[b] < target; b--) before += mass[b];
    const int64_t m = keep_bucket(scratch, n, (uint32_t)b);
    scored_t *tied = scratch->tied;
    for (int64_t i = 0; i < m; i++) tied[i] = (scored_t){s[scratch->column[i]], weight[i]};
    if (m == 0) return -INFINITY; /* rounding left the target above the whole mass: keep every token */
    qsort(tied, (size_t)m, sizeof(scored_t), by_score_descending);
    float cut = tied[0].score;
    for (int64_t i = 0; i < m && before < target; i++) {
        cut = tied[i].score;
        before += tied[i].weight;
    }
    return cut;
}

/*
 * The score of the row's k-th best token (0 < k < cols; w its weights): its top k are the tokens
 * of score >= it, every token tied with the k-th kept too. The candidates are the tokens of weight
 * >= a floor, lowered 256-fold at a time from 2^-12 until they number k or more (a gather costs a
 * few microseconds a row; on SmolLM2's logits at temperature 0.8 to 1.3, top-k 20 to 200 took 1.1
 * to 2.2 gathers a row on average, of a few hundred to a few thousand candidates); their buckets
 * are counted from the top down to the one that holds the k-th, whose tokens alone are sorted.
 */
static float row_top_k_cut(const float *s, const float *w, int64_t cols, int64_t k, draw_scratch_t *scratch)
{
    float floor = 1.0f / 4096.0f;
    int64_t n = gather_candidates(s, w, cols, floor, -INFINITY, scratch);
    while (n < k && floor > 0.0f) { /* at 0 (after the subnormals) every weight but a NaN is >= it */
        floor /= 256.0f;
        n = gather_candidates(s, w, cols, floor, -INFINITY, scratch);
    }
    if (n < k) return -INFINITY; /* NaN weights: keep every token */
    const int64_t lowest = weight_bucket(floor);
    double *count = scratch->mass; /* the scratch's masses, as counts */
    memset(count + lowest, 0, (WEIGHT_BUCKETS - lowest) * sizeof(double));
    for (int64_t i = 0; i < n; i++) count[weight_bucket(scratch->weight[i])] += 1.0;
    int64_t above = 0; /* the candidates in the buckets above `b` */
    int64_t b = WEIGHT_BUCKETS - 1;
    for (; b > lowest && above + (int64_t)count[b] < k; b--) above += (int64_t)count[b];
    const int64_t m = keep_bucket(scratch, n, (uint32_t)b);
    scored_t *tied = scratch->tied;
    for (int64_t i = 0; i < m; i++) tied[i] = (scored_t){s[scratch->column[i]], scratch->weight[i]};
    qsort(tied, (size_t)m, sizeof(scored_t), by_score_descending);
    return tied[k - above - 1].score; /* above < k <= above + m */
}

/* The total weight of the row's tokens of score >= least. */
static double mass_at_least(const float *s, const float *w, int64_t cols, float least)
{
    double mass = 0.0;
    for (int64_t c = 0; c < cols; c++) mass += s[c] >= least ? w[c] : 0.0f;
    return mass;
}

/*
 * One token per row drawn from softmax(scores / temperature) after top-k, top-p and min-p: the
 * first token, in token-id order, whose running total of kept weights passes uniform[r] times
 * their total (the draw gpu_worker/sampler.py defines). A token's weight is
 * exp((score - best) / temperature); it is kept when its score is among the top_k[r] best (0: all;
 * ties with the k-th kept), then within the nucleus of those tokens' mass (none where top_p >= 1),
 * and its weight is >= min_p. Temperature scales the weights alone: the cuts are raw scores, in
 * the same order.
 *
 * The kept weights are summed a block of DRAW_BLOCK tokens at a time, in float64; the target's
 * block is found from the blocks' sums and the token within it by summing that block again.
 * Where rounding lets the target pass the last kept token of its block, that token is taken; where
 * it passes the row's whole total, the row's best token.
 */
static int64_t row_draw(const float *s, int64_t cols, float temperature, int64_t top_k, float top_p, float min_p,
                        float uniform, draw_scratch_t *scratch)
{
    float *w = scratch->w;
    double total = row_weights(s, cols, 1.0f / temperature, w);
    float cut = -INFINITY; /* the least score kept */
    if (top_k > 0 && top_k < cols) {
        cut = row_top_k_cut(s, w, cols, top_k, scratch);
        total = mass_at_least(s, w, cols, cut);
    }
    if (top_p < 1.0f) {
        const float nucleus = row_nucleus_cut(s, w, cols, top_p, total, cut, scratch);
        cut = nucleus > cut ? nucleus : cut;
    }
    const int64_t blocks = (cols + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double kept_total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t end = block_end(b, cols);
        double sum = 0.0;
        for (int64_t c = b * DRAW_BLOCK; c < end; c++) sum += s[c] >= cut && w[c] >= min_p ? w[c] : 0.0f;
        scratch->block_mass[b] = sum;
        kept_total += sum;
    }
    const double target = uniform * kept_total;
    double before = 0.0; /* the kept mass of the blocks before `b` */
    int64_t b = 0;
    for (; b < blocks && before + scratch->block_mass[b] <= target; b++) before += scratch->block_mass[b];
    int64_t last_kept = -1;
    if (b < blocks) {
        const int64_t end = block_end(b, cols);
        for (int64_t c = b * DRAW_BLOCK; c < end; c++) {
            if (!(s[c] >= cut && w[c] >= min_p && w[c] > 0.0f)) continue;
            last_kept = c;
            before += w[c];
            if (before > target) return c;
        }
    }
    return last_kept >= 0 ? last_kept : first_best(s, cols);
}

/* Returns 0, or 1 where a thread's scratch could not be allocated (its rows are then unset). */
int duoserve_draw(const float *scores, int64_t rows, int64_t cols, const float *temperature, const int64_t *top_k,
                  const float *top_p, const float *min_p, const float *uniform, int64_t *token, int num_threads)
{
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows > 1) reduction(| : failed)
    {
        draw_scratch_t scratch;
        failed = !alloc_scratch(&scratch, cols);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (failed) continue;
            token[r] = row_draw(scores + r * cols, cols, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],
                                &scratch);
        }
        free_scratch(&scratch);
    }
    return failed;
}
