/*
 * Prefill attention in float32, in and out, on AVX2 and FMA: the contract of prefill_attention.c
 * (its bfloat16 sibling, which needs AVX-512 BF16 or AMX) for the CPUs that serve float32. Each
 * chunk's queries attend causally to themselves and to all of their sequence's cached prefix.
 * torch's CPU flash kernel reaches 46-76 GFLOP/s on SmolLM2's shapes on a 2-core AVX2 EPYC, and a
 * chunk behind a prefix first gathers that prefix out of the paged cache for every layer.
 *
 * Keys and values are read in place: a whole prompt's from its own rows of k and v, a chunk behind
 * a prefix's from the paged cache through its slots. Each work item is one query head and ROWS
 * query rows of one chunk, its queries scaled and transposed once ([D][ROWS]). It passes over the
 * keys it may see in blocks of KEY_BLOCK, keeping an online softmax per query row (the 16 rows
 * side by side in two registers):
 * - scores s[j][r] = (scale q_r) . k_j, in register tiles of TILE keys x 16 rows: per element of
 *   the head, two loads of the transposed queries and TILE broadcast key elements feed 2 * TILE
 *   multiply-adds into as many independent sums;
 * - each row's running max and sum; the block's exps (exactly 0 past the causal limit); the output
 *   so far rescaled where the max rose;
 * - the output, kept transposed ([D][ROWS]), gains probabilities x values, in tiles of TILE head
 *   elements x 16 rows: per key, two loads of its probabilities and TILE broadcast value elements.
 * Each sum runs over its keys (or head elements) in order, so a prompt's rows give the same bits
 * alone and among other chunks.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the float32 prefill attention needs AVX2 and FMA"
#endif

#include "avx2.h"
#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=32|64|128"
#endif
#if HEAD_DIM != 32 && HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 32, 64 or 128"
#endif
#define D HEAD_DIM
#define ROWS 16      /* query rows of a work item: two registers of float32 */
#define TILE 6       /* keys, or head elements, of a register tile */
#define KEY_BLOCK 96 /* keys per softmax block: its scores stay in the first-level cache */

/* A work item's scratch, on its thread's stack. */
typedef struct {
    float queries[D][ROWS]; /* scale * q, transposed; rows past the item's are zero */
    float scores[KEY_BLOCK][ROWS];
    float output[D][ROWS]; /* transposed, unnormalised */
    const float *keys[KEY_BLOCK];
    const float *values[KEY_BLOCK];
} scratch_t;

/* scores[j][0..ROWS) = keys[j] . queries[.][0..ROWS) for j < n (n a constant at each call). */
static inline __attribute__((always_inline)) void score_tile(const scratch_t *s, const float *const *keys, const int n,
                                                             float (*scores)[ROWS])
{
    __m256 lo[TILE], hi[TILE];
    for (int j = 0; j < n; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 a = _mm256_load_ps(s->queries[d]), b = _mm256_load_ps(s->queries[d] + 8);
#pragma GCC unroll 6
        for (int j = 0; j < n; j++) {
            const __m256 w = _mm256_broadcast_ss(keys[j] + d);
            lo[j] = _mm256_fmadd_ps(w, a, lo[j]);
            hi[j] = _mm256_fmadd_ps(w, b, hi[j]);
        }
    }
    for (int j = 0; j < n; j++) {
        _mm256_store_ps(scores[j], lo[j]);
        _mm256_store_ps(scores[j] + 8, hi[j]);
    }
}

/* output[c + i][0..ROWS) += sum over keys j of values[j][c + i] * probs[j][0..ROWS), for i < n. */
static inline __attribute__((always_inline)) void weigh_tile(scratch_t *s, int64_t count, const int c, const int n)
{
    __m256 lo[TILE], hi[TILE];
    for (int i = 0; i < n; i++) {
        lo[i] = _mm256_load_ps(s->output[c + i]);
        hi[i] = _mm256_load_ps(s->output[c + i] + 8);
    }
    for (int64_t j = 0; j < count; j++) {
        const __m256 a = _mm256_load_ps(s->scores[j]), b = _mm256_load_ps(s->scores[j] + 8);
        const float *value = s->values[j] + c;
#pragma GCC unroll 6
        for (int i = 0; i < n; i++) {
            const __m256 w = _mm256_broadcast_ss(value + i);
            lo[i] = _mm256_fmadd_ps(w, a, lo[i]);
            hi[i] = _mm256_fmadd_ps(w, b, hi[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        _mm256_store_ps(s->output[c + i], lo[i]);
        _mm256_store_ps(s->output[c + i] + 8, hi[i]);
    }
}

/* One work item: rows i0 .. i0 + rows - 1 of a chunk behind `prefix` cached keys, for one query
 * head whose keys and values are row j of (k, k_stride) / (v, v_stride), or at slots[j] of them. */
static void attend(scratch_t *s, const float *q, int64_t q_stride, const float *k, const float *v, int64_t k_stride,
                   int64_t v_stride, const int64_t *slots, int64_t prefix, int64_t i0, int64_t rows, float scale,
                   float *out, int64_t out_stride)
{
    for (int d = 0; d < D; d++)
        for (int r = 0; r < ROWS; r++) s->queries[d][r] = r < rows ? scale * q[r * q_stride + d] : 0.0f;
    for (int d = 0; d < D; d++) _mm256_store_ps(s->output[d], _mm256_setzero_ps()), _mm256_store_ps(s->output[d] + 8, _mm256_setzero_ps());
    /* Row r sees keys 0 .. prefix + i0 + r; a padding row sees what the last real row sees. */
    float limit[ROWS] __attribute__((aligned(32)));
    for (int r = 0; r < ROWS; r++) limit[r] = (float)(prefix + i0 + (r < rows ? r : rows - 1));
    const __m256 limit_lo = _mm256_load_ps(limit), limit_hi = _mm256_load_ps(limit + 8);
    const int64_t seen = prefix + i0 + rows; /* keys any row sees */
    const __m256 none = _mm256_set1_ps(-__builtin_inff());
    __m256 max_lo = none, max_hi = none, sum_lo = _mm256_setzero_ps(), sum_hi = sum_lo;

    for (int64_t j0 = 0; j0 < seen; j0 += KEY_BLOCK) {
        const int64_t count = seen - j0 < KEY_BLOCK ? seen - j0 : KEY_BLOCK;
        for (int64_t j = 0; j < count; j++) {
            const int64_t row = slots ? slots[j0 + j] : j0 + j;
            s->keys[j] = k + row * k_stride;
            s->values[j] = v + row * v_stride;
        }
        int64_t j = 0;
        for (; j + TILE <= count; j += TILE) score_tile(s, s->keys + j, TILE, s->scores + j);
        switch (count - j) { /* the last keys in one narrower tile */
        case 5: score_tile(s, s->keys + j, 5, s->scores + j); break;
        case 4: score_tile(s, s->keys + j, 4, s->scores + j); break;
        case 3: score_tile(s, s->keys + j, 3, s->scores + j); break;
        case 2: score_tile(s, s->keys + j, 2, s->scores + j); break;
        case 1: score_tile(s, s->keys + j, 1, s->scores + j); break;
        }

        /* Past the first row's limit, scores of keys a row may not see become -inf. */
        const int masked = j0 + count - 1 > prefix + i0;
        __m256 top_lo = none, top_hi = none;
        for (j = 0; j < count; j++) {
            __m256 a = _mm256_load_ps(s->scores[j]), b = _mm256_load_ps(s->scores[j] + 8);
            if (masked) {
                const __m256 key = _mm256_set1_ps((float)(j0 + j));
                a = _mm256_blendv_ps(none, a, _mm256_cmp_ps(key, limit_lo, _CMP_LE_OQ));
                b = _mm256_blendv_ps(none, b, _mm256_cmp_ps(key, limit_hi, _CMP_LE_OQ));
                _mm256_store_ps(s->scores[j], a);
                _mm256_store_ps(s->scores[j] + 8, b);
            }
            top_lo = _mm256_max_ps(top_lo, a);
            top_hi = _mm256_max_ps(top_hi, b);
        }
        /* Key 0 is every row's, so the running max is finite from the first block on. */
        const __m256 new_lo = _mm256_max_ps(max_lo, top_lo), new_hi = _mm256_max_ps(max_hi, top_hi);
        const __m256 rescale_lo = exp8_nonpositive(_mm256_sub_ps(max_lo, new_lo));
        const __m256 rescale_hi = exp8_nonpositive(_mm256_sub_ps(max_hi, new_hi));
        max_lo = new_lo, max_hi = new_hi;
        __m256 block_lo = _mm256_setzero_ps(), block_hi = block_lo;
        for (j = 0; j < count; j++) {
            const __m256 a = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(s->scores[j]), new_lo));
            const __m256 b = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(s->scores[j] + 8), new_hi));
            _mm256_store_ps(s->scores[j], a);
            _mm256_store_ps(s->scores[j] + 8, b);
            block_lo = _mm256_add_ps(block_lo, a);
            block_hi = _mm256_add_ps(block_hi, b);
        }
        sum_lo = _mm256_fmadd_ps(sum_lo, rescale_lo, block_lo);
        sum_hi = _mm256_fmadd_ps(sum_hi, rescale_hi, block_hi);
        if (j0 > 0)
            for (int d = 0; d < D; d++) {
                _mm256_store_ps(s->output[d], _mm256_mul_ps(_mm256_load_ps(s->output[d]), rescale_lo));
                _mm256_store_ps(s->output[d] + 8, _mm256_mul_ps(_mm256_load_ps(s->output[d] + 8), rescale_hi));
            }
        int c = 0;
        for (; c + TILE <= D; c += TILE) weigh_tile(s, count, c, TILE);
#if D % TILE
        weigh_tile(s, count, c, D % TILE);
#endif
    }

    float inverse[ROWS] __attribute__((aligned(32)));
    _mm256_store_ps(inverse, _mm256_div_ps(_mm256_set1_ps(1.0f), sum_lo));
    _mm256_store_ps(inverse + 8, _mm256_div_ps(_mm256_set1_ps(1.0f), sum_hi));
    for (int64_t r = 0; r < rows; r++)
        for (int d = 0; d < D; d++) out[r * out_stride + d] = s->output[d][r] * inverse[r];
}

/* prefill_attention.c's duoserve_prefill_attention on float32 tensors and caches: the same
 * arguments, strides in elements. Returns 0 (its scratch is on the stack). */
int duoserve_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                               int64_t v_stride, const float *k_cache, const float *v_cache, int64_t cache_stride,
                               float *out, int64_t out_stride, const int64_t *starts, const int64_t *lens,
                               const int64_t *prefixes, const int64_t *slot_starts, const int64_t *slots,
                               int64_t num_prompts, int64_t num_heads, int64_t num_kv_heads, float scale,
                               int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    int64_t items = 0;
    for (int64_t p = 0; p < num_prompts; p++) items += (lens[p] + ROWS - 1) / ROWS * num_heads;

    /* One query head and ROWS query rows per item, a chunk's last rows (the most keys) first,
     * taken 4 at a time (each take is an atomic add on a line both cores write). */
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        scratch_t s __attribute__((aligned(32)));
        int64_t p = 0, rest = item;
        while (rest >= (lens[p] + ROWS - 1) / ROWS * num_heads) rest -= (lens[p++] + ROWS - 1) / ROWS * num_heads;
        const int64_t blocks = (lens[p] + ROWS - 1) / ROWS, h = rest % num_heads, g = h / group;
        const int64_t i0 = (blocks - 1 - rest / num_heads) * ROWS;
        const int64_t rows = lens[p] - i0 < ROWS ? lens[p] - i0 : ROWS;
        const float *queries = q + (starts[p] + i0) * q_stride + h * D;
        float *dst = out + (starts[p] + i0) * out_stride + h * D;
        if (prefixes[p] == 0)
            attend(&s, queries, q_stride, k + starts[p] * k_stride + g * D, v + starts[p] * v_stride + g * D, k_stride,
                   v_stride, NULL, 0, i0, rows, scale, dst, out_stride);
        else
            attend(&s, queries, q_stride, k_cache + g * D, v_cache + g * D, cache_stride, cache_stride,
                   slots + slot_starts[p], prefixes[p], i0, rows, scale, dst, out_stride);
    }
    return 0;
}
