/*
 * Paged decode attention for the CPU worker: one query token per sequence, keys and values
 * read in place from the paged cache ([num_blocks, BLOCK, num_kv_heads, HEAD_DIM] per layer),
 * so no step copies a sequence's context. Built by kernels/cpu_decode.py with the model's
 * shape fixed at compile time (-DHEAD_DIM, -DGROUP, -DBLOCK, -DELEM_BF16) so the compiler
 * can keep each work item's accumulators in vector registers.
 *
 * A sequence's context is attended in parts of 128 tokens, each with an online softmax in
 * float32 (scores, running max and sum, output accumulator), and the parts are folded in order.
 * With at least 4 sequences per thread a work item is a whole sequence, all its kv heads at once,
 * so each block's rows are read front to back (about 10% faster once the cache no longer fits
 * the CPU's caches). With fewer, and one longer than SPLIT_ABOVE tokens, each (sequence, part)
 * is an item of its own, so that one long sequence still keeps every thread busy (split-K: on 2
 * cores 1.06-1.21x on one sequence of 4096 tokens, 1.05-1.18x on two of 2048); else each
 * (sequence, kv head). Every way computes the same parts and folds them alike. Work items are shared out by OpenMP; the library links the
 * same libgomp as torch, so the kernel and torch's own ops use one thread pool. Scores, the
 * softmax and value sums take an intrinsics path: AVX-512 where the CPU has it (and block sizes
 * in 16s, head_dim in 32s), else AVX2 + FMA (block sizes in 8s), else plain C.
 *
 * With -DKV_INT8=1 the cache holds int8 rows, each (slot, kv head) with a float32 scale of its own
 * (k_scale / v_scale: [num_blocks, num_kv_heads, BLOCK]): a key's dot product is taken on its int8
 * values and then scaled; a value's scale is folded into its softmax weight. Half the bytes of a
 * bfloat16 cache to read per step, the same float32 arithmetic.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "elements.h"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(BLOCK) || !defined(ELEM_BF16)
#error "build with -DHEAD_DIM=.. -DGROUP=.. -DBLOCK=.. -DELEM_BF16=0|1"
#endif
#ifndef KV_INT8
#define KV_INT8 0
#endif
#if KV_INT8
typedef int8_t cache_t;
#else
typedef elem_t cache_t;
#endif
#ifndef VECTOR_BITS /* the widest path to take, as the CPU allows: 512, 256 or 0 (plain C); the tests build each */
#define VECTOR_BITS 512
#endif

#define ROW (num_kv_heads * HEAD_DIM) /* elements per cache slot */

/* A whole-sequence work item holds at most this many kv heads' state (qf and acc: 16 KB each at most). */
#define MAX_HEADS_PER_ITEM (4096 / (GROUP * HEAD_DIM) < 1 ? 1 : 4096 / (GROUP * HEAD_DIM) > 8 ? 8 : 4096 / (GROUP * HEAD_DIM))

#if defined(__AVX512F__) && BLOCK % 16 == 0 && HEAD_DIM % 32 == 0 && VECTOR_BITS >= 512
#define VECTOR_PATH 512
#elif defined(__AVX2__) && defined(__FMA__) && BLOCK % 8 == 0 && HEAD_DIM % 8 == 0 && VECTOR_BITS >= 256
#define VECTOR_PATH 256
#else
#define VECTOR_PATH 0
#endif

/*
 * The next block's rows (of the work item's heads), prefetched a few cache lines at a time while
 * the current block computes: the KV cache is far larger than the CPU's caches and blocks are
 * scattered. Measured on 64 sequences of 321 tokens over 30 layers: a burst of a whole block's
 * prefetches at once stalls on them (35 ms), spread out they take 30 ms, and hinted to the outer
 * caches, whose queues hold more misses than the first level's, 28 ms.
 *
 * Each call fetches a key line of the next block and the value line at the same place, at a rate
 * (in 1/65536ths of a pair of lines a call) that spreads the block's lines evenly over all the
 * calls the current block makes: its scores call every 4 keys, its value sums every token. So the
 * next block's keys and values arrive side by side throughout the current one. On the AMX Xeon,
 * the kernel alone on 64 sequences x 320 tokens over 30 layers' caches (2 threads) took 19.2-20.6 ms
 * where the keys fetched during the scores and the values during the value sums, one call per 16
 * keys, took 22.8-24.1; the hardware's own prefetching does little for 6 KB blocks read head by
 * head, and a core keeps only so many of its prefetches in flight at once.
 */
typedef struct {
    const char *keys, *values; /* the next block's first row, at the item's first head; NULL: none */
    int64_t row_bytes, lines_per_row;
    int64_t rate, budget; /* pairs of lines a call, and owed, in 1/65536ths */
    int64_t row, line;
} fetch_cursor;

static inline fetch_cursor fetch_start(const cache_t *keys, const cache_t *values, int64_t row, int64_t heads,
                                       int64_t calls)
{
    const int64_t lines_per_row = (heads * HEAD_DIM * (int64_t)sizeof(cache_t) + 63) / 64;
    const fetch_cursor cursor = {(const char *)keys, (const char *)values, row * (int64_t)sizeof(cache_t),
                                 lines_per_row, (BLOCK * lines_per_row * 65536 + calls - 1) / calls, 0, 0, 0};
    return cursor;
}

static inline void fetch_some(fetch_cursor *c)
{
    if (!c->keys) return;
    for (c->budget += c->rate; c->budget >= 65536 && c->row < BLOCK; c->budget -= 65536) {
        const int64_t at = c->row * c->row_bytes + c->line * 64;
        __builtin_prefetch(c->keys + at, 0, 1);
        __builtin_prefetch(c->values + at, 0, 1);
        if (++c->line == c->lines_per_row) {
            c->line = 0;
            c->row++;
        }
    }
}

#if VECTOR_PATH == 512
#include "avx512.h"
/*
 * AVX-512: a query row's dot products with 16 keys leave 16 vectors, which `sum16` adds across in
 * one transposing tree rather than one horizontal sum per key. With AVX-512 BF16 the bfloat16
 * query multiplies bfloat16 keys in pairs (exact products, float32 sums) and the scale is applied
 * to the sums. Values accumulate with each kv head's GROUP output rows held in registers.
 */
#if ELEM_BF16 && !KV_INT8 && defined(__AVX512BF16__)
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

/*
 * A bfloat16 cache's values: 32 of them (one 64-byte load) become two float32 vectors, the even
 * elements shifted into the upper halves of their 32-bit lanes and the odd ones masked in place,
 * where widening 16 at a time takes a load, a cross-lane zero-extension and a shift for each 16.
 * The output accumulators hold each 32 dimensions in that order (the 16 even, then the 16 odd:
 * ACC_INDEX), which the softmax's rescaling and the folding of parts, element by element, do not
 * see; `finish` puts them back in place.
 */
#if ELEM_BF16 && !KV_INT8 && HEAD_DIM % 32 == 0
#define SPLIT_PAIRS 1
#endif

static inline __m512 load16(const cache_t *p)
{
#if KV_INT8
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif ELEM_BF16
    return load16_bf16(p);
#else
    return _mm512_loadu_ps(p);
#endif
}

#elif VECTOR_PATH == 256
#include "avx2.h"
/*
 * AVX2: a query row's dot products with 8 keys leave 8 vectors, which `sum8x8` adds across in one
 * tree. Values accumulate into VALUE_VECS registers of each of the GROUP output rows at a time
 * (AVX2 has 16 registers: at most 12 of them sums), so a block's values are read HEAD_DIM /
 * (8 * VALUE_VECS) times, from the first-level cache after the first.
 */
static inline __m256 load8(const cache_t *p)
{
#if KV_INT8
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif ELEM_BF16
    return load8_bf16(p);
#else
    return _mm256_loadu_ps(p);
#endif
}

#define VECS_FIT(n) (GROUP * (n) <= 12 && (HEAD_DIM / 8) % (n) == 0)
#define VALUE_VECS (VECS_FIT(8) ? 8 : VECS_FIT(4) ? 4 : VECS_FIT(2) ? 2 : 1)
#endif

/* A cache element as float32 (an int8 one before its scale). */
static inline float load_cached(cache_t x)
{
#if KV_INT8
    return (float)x;
#else
    return load(x);
#endif
}

/*
 * scores[h * GROUP + g][t] = q·k / sqrt(HEAD_DIM) for the block's slots t (rows `row` elements
 * apart), -1e30 from slot `valid` on (those slots hold stale data). q: the item's query rows;
 * qf: the same, scaled, in float32. key_scales: with KV_INT8, the block's keys' scales (head h's
 * BLOCK of them at h * BLOCK), else unused.
 */
static void block_scores(const elem_t *q, float (*qf)[HEAD_DIM], const cache_t *keys, const float *key_scales,
                         int64_t row, int64_t heads, int64_t valid, float scale, float (*scores)[BLOCK],
                         fetch_cursor *fetch)
{
    (void)key_scales;
#if VECTOR_PATH == 512
    (void)q, (void)qf; /* the bfloat16 dot products read q, the others qf */
    for (int64_t h = 0; h < heads; h++) {
        for (int t0 = 0; t0 < BLOCK; t0 += 16) {
            const int64_t left = valid - t0;
            const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
#if KV_INT8
            /* Each key widened once for all GROUP query rows (widening int8 costs two instructions
             * a vector, as much as the multiply-adds of two rows). */
            __m512 dots[GROUP][16];
            for (int t = 0; t < 16; t++) {
                const cache_t *key = keys + (t0 + t) * row + h * HEAD_DIM;
                __m512 wide[HEAD_DIM / 16];
                for (int c = 0; c < HEAD_DIM / 16; c++) wide[c] = load16(key + 16 * c);
                for (int g = 0; g < GROUP; g++) {
                    __m512 dot = _mm512_mul_ps(_mm512_load_ps(qf[h * GROUP + g]), wide[0]);
                    for (int c = 1; c < HEAD_DIM / 16; c++)
                        dot = _mm512_fmadd_ps(_mm512_load_ps(qf[h * GROUP + g] + 16 * c), wide[c], dot);
                    dots[g][t] = dot;
                }
                if (t % 4 == 3) fetch_some(fetch);
            }
            const __m512 key_scale = _mm512_loadu_ps(key_scales + h * BLOCK + t0);
            for (int g = 0; g < GROUP; g++) {
                const __m512 sums = _mm512_mul_ps(sum16(dots[g]), key_scale);
                _mm512_store_ps(scores[h * GROUP + g] + t0, _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), sums));
            }
#else
            for (int g = 0; g < GROUP; g++) {
                __m512 dots[16];
                for (int t = 0; t < 16; t++) {
                    const cache_t *key = keys + (t0 + t) * row + h * HEAD_DIM;
                    __m512 dot = _mm512_setzero_ps();
#if DOT_BF16
                    const elem_t *query = q + (h * GROUP + g) * HEAD_DIM;
                    for (int c = 0; c < HEAD_DIM; c += 32)
                        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(query + c),
                                               (__m512bh)_mm512_loadu_si512(key + c));
#else
                    for (int c = 0; c < HEAD_DIM; c += 16)
                        dot = _mm512_fmadd_ps(_mm512_load_ps(qf[h * GROUP + g] + c), load16(key + c), dot);
#endif
                    dots[t] = dot;
                    if (t % 4 == 3) fetch_some(fetch);
                }
                __m512 sums = sum16(dots);
                if (DOT_BF16) sums = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
                _mm512_store_ps(scores[h * GROUP + g] + t0, _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), sums));
            }
#endif
        }
    }
#elif VECTOR_PATH == 256
    (void)q, (void)scale;
    for (int64_t h = 0; h < heads; h++) {
        for (int t0 = 0; t0 < BLOCK; t0 += 8) {
            const __m256 live = lanes_below(valid - t0);
            for (int g = 0; g < GROUP; g++) {
                /* The 8 keys' sums side by side: 8 independent multiply-adds per step, as many as
                 * the two FMA units' latency needs to stay busy. */
                const float *query = qf[h * GROUP + g];
                const cache_t *key = keys + t0 * row + h * HEAD_DIM;
                __m256 dots[8];
                for (int t = 0; t < 8; t++) dots[t] = _mm256_mul_ps(_mm256_load_ps(query), load8(key + t * row));
                for (int c = 8; c < HEAD_DIM; c += 8) {
                    const __m256 qc = _mm256_load_ps(query + c);
                    for (int t = 0; t < 8; t++) dots[t] = _mm256_fmadd_ps(qc, load8(key + t * row + c), dots[t]);
                }
                fetch_some(fetch);
                __m256 sums = sum8x8(dots);
                if (KV_INT8) sums = _mm256_mul_ps(sums, _mm256_loadu_ps(key_scales + h * BLOCK + t0));
                _mm256_store_ps(scores[h * GROUP + g] + t0, _mm256_blendv_ps(_mm256_set1_ps(-1e30f), sums, live));
            }
        }
    }
#else
    (void)q;
    (void)scale;
    for (int t = 0; t < BLOCK; t++) {
        fetch_some(fetch);
        for (int64_t h = 0; h < heads; h++) {
            float kf[HEAD_DIM] __attribute__((aligned(64)));
            for (int i = 0; i < HEAD_DIM; i++) kf[i] = load_cached(keys[t * row + h * HEAD_DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                float dot = 0.0f;
                for (int i = 0; i < HEAD_DIM; i++) dot += qf[h * GROUP + g][i] * kf[i];
                if (KV_INT8) dot *= key_scales[h * BLOCK + t];
                scores[h * GROUP + g][t] = t < valid ? dot : -1e30f;
            }
        }
    }
#endif
}

/* acc[h * GROUP + g] += p[h * GROUP + g][t] * value[t] over the block's first `valid` slots. */
static void accumulate_values(const cache_t *values, int64_t row, int64_t heads, int64_t valid,
                              float (*p)[BLOCK], float (*acc)[HEAD_DIM], fetch_cursor *fetch)
{
#if VECTOR_PATH == 512
    for (int64_t h = 0; h < heads; h++) {
        __m512 sums[GROUP][HEAD_DIM / 16];
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < HEAD_DIM / 16; c++) sums[g][c] = _mm512_load_ps(acc[h * GROUP + g] + 16 * c);
        for (int64_t t = 0; t < valid; t++) {
            __m512 value[HEAD_DIM / 16];
#ifdef SPLIT_PAIRS
            for (int c = 0; c < HEAD_DIM / 32; c++) {
                const __m512i pairs = _mm512_loadu_si512(values + t * row + h * HEAD_DIM + 32 * c);
                value[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                value[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000)));
            }
#else
            for (int c = 0; c < HEAD_DIM / 16; c++) value[c] = load16(values + t * row + h * HEAD_DIM + 16 * c);
#endif
            for (int g = 0; g < GROUP; g++) {
                const __m512 weight = _mm512_set1_ps(p[h * GROUP + g][t]);
                for (int c = 0; c < HEAD_DIM / 16; c++) sums[g][c] = _mm512_fmadd_ps(weight, value[c], sums[g][c]);
            }
            fetch_some(fetch);
        }
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(acc[h * GROUP + g] + 16 * c, sums[g][c]);
    }
#elif VECTOR_PATH == 256
    for (int64_t h = 0; h < heads; h++) {
        for (int c0 = 0; c0 < HEAD_DIM; c0 += 8 * VALUE_VECS) {
            __m256 sums[GROUP][VALUE_VECS];
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < VALUE_VECS; c++) sums[g][c] = _mm256_load_ps(acc[h * GROUP + g] + c0 + 8 * c);
            for (int64_t t = 0; t < valid; t++) {
                const cache_t *value = values + t * row + h * HEAD_DIM + c0;
                for (int c = 0; c < VALUE_VECS; c++) {
                    const __m256 v = load8(value + 8 * c);
                    for (int g = 0; g < GROUP; g++)
                        sums[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&p[h * GROUP + g][t]), v, sums[g][c]);
                }
                fetch_some(fetch);
            }
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < VALUE_VECS; c++) _mm256_store_ps(acc[h * GROUP + g] + c0 + 8 * c, sums[g][c]);
        }
    }
#else
    for (int64_t t = 0; t < valid; t++) {
        fetch_some(fetch);
        for (int64_t h = 0; h < heads; h++) {
            float vf[HEAD_DIM] __attribute__((aligned(64)));
            for (int i = 0; i < HEAD_DIM; i++) vf[i] = load_cached(values[t * row + h * HEAD_DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                const float weight = p[h * GROUP + g][t];
                for (int i = 0; i < HEAD_DIM; i++) acc[h * GROUP + g][i] += weight * vf[i];
            }
        }
    }
#endif
}

/* How many times block_scores and accumulate_values call fetch_some per block (for full blocks). */
#if VECTOR_PATH == 512 && KV_INT8
#define SCORE_CALLS(heads) ((heads) * (BLOCK / 4))
#define VALUE_CALLS(heads) ((heads) * BLOCK)
#elif VECTOR_PATH == 512
#define SCORE_CALLS(heads) ((heads) * GROUP * (BLOCK / 4))
#define VALUE_CALLS(heads) ((heads) * BLOCK)
#elif VECTOR_PATH == 256
#define SCORE_CALLS(heads) ((heads) * GROUP * (BLOCK / 8))
#define VALUE_CALLS(heads) ((heads) * BLOCK * (HEAD_DIM / (8 * VALUE_VECS)))
#else
#define SCORE_CALLS(heads) BLOCK
#define VALUE_CALLS(heads) BLOCK
#endif

/*
 * A sequence's context is attended in parts of PART_TOKENS tokens, each with an online softmax of
 * its own, and the parts' results are folded in order (`merge`). A part is the same arithmetic
 * whoever computes it, so a sequence's output has the same bits whether its parts run one after
 * another in one work item or side by side on several threads (the split below, for steps of too
 * few sequences to fill the threads: one long sequence).
 */
#define PART_TOKENS ((128 + BLOCK - 1) / BLOCK * BLOCK)
#define MAX_ROWS (MAX_HEADS_PER_ITEM * GROUP) /* query heads of a work item */

/* An online softmax's state for a work item's query heads: output so far (unnormalised), max, sum. */
typedef struct {
    float acc[MAX_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    float max[MAX_ROWS], sum[MAX_ROWS];
} state_t;

/* An empty state: merging a part into it gives the part's own bits (its weight is exp(0) = 1, the
 * empty one's multiplies zeros). */
static void empty_state(int64_t rows, state_t *s)
{
    for (int64_t g = 0; g < rows; g++) {
        for (int i = 0; i < HEAD_DIM; i++) s->acc[g][i] = 0.0f;
        s->max[g] = -1e30f;
        s->sum[g] = 0.0f;
    }
}

/* qf = scale * q for the item's `rows` query heads, in float32. */
static void scale_queries(const elem_t *q, int64_t rows, float scale, float (*qf)[HEAD_DIM])
{
    for (int64_t g = 0; g < rows; g++)
        for (int i = 0; i < HEAD_DIM; i++) qf[g][i] = load(q[g * HEAD_DIM + i]) * scale;
}

/* The cache as a work item reads it: keys and values from its first kv head on, and with KV_INT8
 * their scales (from the same head on; a block's are num_kv_heads * BLOCK floats apart). */
typedef struct {
    const cache_t *k, *v;
    const float *k_scale, *v_scale;
} kv_t;

static inline kv_t kv_from_head(kv_t kv, int64_t head)
{
    const kv_t from = {kv.k + head * HEAD_DIM, kv.v + head * HEAD_DIM, kv.k_scale ? kv.k_scale + head * BLOCK : 0,
                       kv.v_scale ? kv.v_scale + head * BLOCK : 0};
    return from;
}

/* With KV_INT8, each softmax weight p[h * GROUP + g][t] times its value's scale. */
static inline void scale_weights(float (*p)[BLOCK], const float *value_scales, int64_t heads)
{
#if KV_INT8
    for (int64_t h = 0; h < heads; h++)
        for (int g = 0; g < GROUP; g++)
            for (int t = 0; t < BLOCK; t++) p[h * GROUP + g][t] *= value_scales[h * BLOCK + t];
#else
    (void)p, (void)value_scales, (void)heads;
#endif
}

#if VECTOR_PATH == 512
/*
 * The online softmax's step over one block for query rows first .. first + n - 1 (n <= 16) at
 * once: each row's new max, the factor exp(old max - new max) for its sum and output so far, and
 * its scores replaced by exp(score - new max). The rows' maxima, factors and sums go 16 to a
 * vector (max16, reduce_add16), not one horizontal reduction and one scalar exp per row: the same
 * values, bit for bit, as row by row.
 */
static void softmax_step16(float (*scores)[BLOCK], int64_t n, state_t *s, int64_t first)
{
    const __mmask16 rows = (__mmask16)((1u << n) - 1u);
    __m512 v[16];
    for (int g = 0; g < 16; g++) {
        __m512 top = _mm512_set1_ps(-1e30f);
        if (g < n)
            for (int t = 0; t < BLOCK; t += 16) top = _mm512_max_ps(top, _mm512_load_ps(scores[g] + t));
        v[g] = top;
    }
    const __m512 old_max = _mm512_maskz_loadu_ps(rows, s->max + first);
    const __m512 new_max = _mm512_max_ps(old_max, max16(v));
    const __m512 rescale = exp16_nonpositive(_mm512_sub_ps(old_max, new_max));
    float shift[16] __attribute__((aligned(64))), factor[16] __attribute__((aligned(64)));
    _mm512_store_ps(shift, new_max);
    _mm512_store_ps(factor, rescale);
    for (int g = 0; g < 16; g++) {
        __m512 sum = _mm512_setzero_ps();
        if (g < n)
            for (int t = 0; t < BLOCK; t += 16) {
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores[g] + t), _mm512_set1_ps(shift[g])));
                _mm512_store_ps(scores[g] + t, e);
                sum = _mm512_add_ps(sum, e);
            }
        v[g] = sum;
    }
    const __m512 old_sum = _mm512_maskz_loadu_ps(rows, s->sum + first);
    _mm512_mask_storeu_ps(s->sum + first, rows, _mm512_fmadd_ps(old_sum, rescale, reduce_add16(v)));
    _mm512_mask_storeu_ps(s->max + first, rows, new_max);
    for (int64_t g = 0; g < n; g++) {
        const __m512 f = _mm512_set1_ps(factor[g]);
        float *acc = s->acc[first + g];
        for (int i = 0; i < HEAD_DIM; i += 16) _mm512_store_ps(acc + i, _mm512_mul_ps(_mm512_load_ps(acc + i), f));
    }
}
#endif

/*
 * The tokens [start, end) of a sequence (start a multiple of BLOCK) for `heads` kv heads, from the
 * kv head that kv points at (1 for a per-head item; all of them, `num_kv_heads`,
 * for a whole sequence, whose blocks are then read row by row front to back; each head's
 * arithmetic is the same either way), into `s`. `after`: the block to prefetch while the last
 * one computes (-1: none).
 */
static void attend_part(const elem_t *q, float (*qf)[HEAD_DIM], kv_t kv, const int32_t *table, int64_t start, int64_t end, int64_t num_kv_heads, int64_t heads,
                        float scale, int64_t after, state_t *s)
{
    const int64_t rows = heads * GROUP; /* query heads */
    float scores[MAX_ROWS][BLOCK] __attribute__((aligned(64)));
    empty_state(rows, s);
    for (int64_t at = start; at < end; at += BLOCK) {
        const int64_t block = table[at / BLOCK];
        const int64_t valid = end - at < BLOCK ? end - at : BLOCK;
        const int64_t next = at + BLOCK < end ? table[at / BLOCK + 1] : after;
        fetch_cursor fetch = fetch_start(next < 0 ? 0 : kv.k + next * BLOCK * ROW, next < 0 ? 0 : kv.v + next * BLOCK * ROW,
                                         ROW, heads, SCORE_CALLS(heads) + VALUE_CALLS(heads));
        const int64_t scales_at = block * num_kv_heads * BLOCK;
#if KV_INT8
        if (next >= 0) /* the next block's scales: a cache line or two per head */
            for (int64_t line = 0; line < (heads * BLOCK * 4 + 63) / 64; line++) {
                __builtin_prefetch((const char *)(kv.k_scale + next * num_kv_heads * BLOCK) + 64 * line, 0, 1);
                __builtin_prefetch((const char *)(kv.v_scale + next * num_kv_heads * BLOCK) + 64 * line, 0, 1);
            }
#endif
        block_scores(q, qf, kv.k + block * BLOCK * ROW, KV_INT8 ? kv.k_scale + scales_at : 0, ROW, heads, valid,
                     scale, scores, &fetch);
#if VECTOR_PATH == 512
        for (int64_t g = 0; g < rows; g += 16) softmax_step16(scores + g, rows - g < 16 ? rows - g : 16, s, g);
#elif VECTOR_PATH == 256
        for (int64_t g = 0; g < rows; g++) {
            __m256 top = _mm256_set1_ps(s->max[g]);
            for (int t = 0; t < BLOCK; t += 8) top = _mm256_max_ps(top, _mm256_load_ps(scores[g] + t));
            const float block_max = hmax8(top);
            const float rescale = exp_nonpositive(s->max[g] - block_max);
            const __m256 shift = _mm256_set1_ps(block_max);
            __m256 sum = _mm256_setzero_ps();
            for (int t = 0; t < BLOCK; t += 8) {
                const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(scores[g] + t), shift));
                _mm256_store_ps(scores[g] + t, e);
                sum = _mm256_add_ps(sum, e);
            }
            s->sum[g] = s->sum[g] * rescale + hsum8(sum);
            s->max[g] = block_max;
            const __m256 factor = _mm256_set1_ps(rescale);
            for (int i = 0; i < HEAD_DIM; i += 8) _mm256_store_ps(s->acc[g] + i, _mm256_mul_ps(_mm256_load_ps(s->acc[g] + i), factor));
        }
#else
        for (int64_t g = 0; g < rows; g++) {
            float block_max = s->max[g];
            for (int t = 0; t < BLOCK; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float rescale = exp_nonpositive(s->max[g] - block_max);
            float block_sum = 0.0f;
            for (int t = 0; t < BLOCK; t++) {
                scores[g][t] = exp_nonpositive(scores[g][t] - block_max);
                block_sum += scores[g][t];
            }
            s->sum[g] = s->sum[g] * rescale + block_sum;
            s->max[g] = block_max;
            for (int i = 0; i < HEAD_DIM; i++) s->acc[g][i] *= rescale;
        }
#endif
        scale_weights(scores, KV_INT8 ? kv.v_scale + scales_at : 0, heads);
        accumulate_values(kv.v + block * BLOCK * ROW, ROW, heads, valid, scores, s->acc, &fetch);
    }
}

/* Fold a later part (p_acc rows HEAD_DIM apart, p_max, p_sum) into the state so far, for `rows` query heads. */
static void merge(int64_t rows, state_t *s, const float *p_acc, const float *p_max, const float *p_sum)
{
    for (int64_t g = 0; g < rows; g++) {
        const float top = s->max[g] > p_max[g] ? s->max[g] : p_max[g];
        const float mine = exp_nonpositive(s->max[g] - top), theirs = exp_nonpositive(p_max[g] - top);
        s->sum[g] = s->sum[g] * mine + p_sum[g] * theirs;
        s->max[g] = top;
        for (int i = 0; i < HEAD_DIM; i++) s->acc[g][i] = s->acc[g][i] * mine + p_acc[g * HEAD_DIM + i] * theirs;
    }
}

#ifdef SPLIT_PAIRS /* where dimension i is held in an accumulator row */
#define ACC_INDEX(i) ((i) / 32 * 32 + (i) % 2 * 16 + (i) % 32 / 2)
#else
#define ACC_INDEX(i) (i)
#endif

static void finish(int64_t rows, const state_t *s, elem_t *out)
{
    for (int64_t g = 0; g < rows; g++) {
        const float inv = 1.0f / s->sum[g];
        for (int i = 0; i < HEAD_DIM; i++) out[g * HEAD_DIM + i] = store(s->acc[g][ACC_INDEX(i)] * inv);
    }
}

/*
 * A work item: `heads` kv heads of one sequence, all its parts in order. `then_table`: the table
 * of the sequence this thread takes next (its first block is prefetched during the last), or NULL.
 */
static void attend(const elem_t *q, kv_t kv, const int32_t *table,
                   int64_t context_len, elem_t *out, int64_t num_kv_heads, int64_t heads, float scale,
                   const int32_t *then_table)
{
    const int64_t rows = heads * GROUP;
    float qf[MAX_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    state_t total, part;
    scale_queries(q, rows, scale, qf);
    empty_state(rows, &total);
    for (int64_t start = 0; start < context_len; start += PART_TOKENS) {
        const int64_t end = context_len - start < PART_TOKENS ? context_len : start + PART_TOKENS;
        const int64_t after = end < context_len ? table[end / BLOCK] : then_table ? then_table[0] : -1;
        attend_part(q, qf, kv, table, start, end, num_kv_heads, heads, scale, after, &part);
        merge(rows, &total, &part.acc[0][0], part.max, part.sum);
    }
    finish(rows, &total, out);
}

/* Parts kept for the fold: one buffer per calling thread (two lanes may decode at once), kept
 * between calls and grown as needed (under 1 KB per part and kv head for most models). */
static _Thread_local float *kept_parts;
static _Thread_local int64_t kept_capacity;

static float *kept_for(int64_t floats)
{
    if (floats > kept_capacity) {
        free(kept_parts);
        kept_capacity = floats > 2 * kept_capacity ? floats : 2 * kept_capacity;
        kept_parts = malloc((size_t)kept_capacity * sizeof(float));
        if (!kept_parts) kept_capacity = 0;
    }
    return kept_parts;
}

static inline int64_t parts_of(int64_t context_len) { return (context_len + PART_TOKENS - 1) / PART_TOKENS; }

/* The sequence and part of the index-th part of the step, counting sequence by sequence. */
static inline void find_part(const int32_t *context_lens, int64_t index, int64_t *seq, int64_t *part)
{
    int64_t n = 0;
    for (int64_t count; index >= (count = parts_of(context_lens[n])); n++) index -= count;
    *seq = n;
    *part = index;
}

/*
 * Steps of too few sequences to give each thread several whole: every (group of kv heads,
 * sequence, part) is a work item of its own, taken in that order. A group is all the kv heads (each block's rows read front
 * to back) when the step has at least SPLIT_BELOW parts per thread, else one kv head, so a short
 * step still has items to share. A sequence of one part is finished by its items; the others'
 * parts are kept and then folded in order. False (nothing done) if the buffer cannot be had.
 */
#define SPLIT_BELOW 4
/* Below this many tokens in its longest sequence a step is not split: on 2 cores a single
 * 320-token sequence took 0.81-1.0x the time split as not (the second pass costs more than the
 * balance gains). */
#define SPLIT_ABOVE (4 * PART_TOKENS)

static int attend_parts(const elem_t *q, kv_t kv, const int32_t *block_tables,
                        const int32_t *context_lens, elem_t *out, int64_t num_seqs, int64_t num_kv_heads,
                        int64_t max_blocks, float scale, int num_threads)
{
    int64_t total_parts = 0;
    for (int64_t n = 0; n < num_seqs; n++) total_parts += parts_of(context_lens[n]);
    const int64_t whole = num_kv_heads < MAX_HEADS_PER_ITEM ? num_kv_heads : MAX_HEADS_PER_ITEM;
    const int64_t group = total_parts >= SPLIT_BELOW * num_threads ? whole : 1;
    const int64_t groups = (num_kv_heads + group - 1) / group, items = total_parts * groups;
    const int64_t stride = group * GROUP * (HEAD_DIM + 2); /* floats per kept part: acc rows, max, sum */
    float *kept = kept_for(items * stride);
    if (!kept) return 0;
    const int64_t num_heads = num_kv_heads * GROUP;
    int64_t taken = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Taken one at a time, as schedule(dynamic, 1) would, but the next before the current
         * starts, so the current one's last block prefetches the next one's first. */
        int64_t item = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
        while (item < items) {
            const int64_t then = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            int64_t seq, part;
            find_part(context_lens, item % total_parts, &seq, &part);
            const int64_t kv0 = item / total_parts * group, heads = num_kv_heads - kv0 < group ? num_kv_heads - kv0 : group;
            const int64_t rows = heads * GROUP, head0 = seq * num_heads + kv0 * GROUP;
            const int64_t len = context_lens[seq], start = part * PART_TOKENS;
            const int64_t end = len - start < PART_TOKENS ? len : start + PART_TOKENS;
            const int32_t *table = block_tables + seq * max_blocks;
            int64_t after = -1; /* the next item's first block, where it reads the same kv heads */
            if (then < items && then / total_parts == item / total_parts) {
                int64_t then_seq, then_part;
                find_part(context_lens, then % total_parts, &then_seq, &then_part);
                after = block_tables[then_seq * max_blocks + then_part * PART_TOKENS / BLOCK];
            }
            float qf[MAX_ROWS][HEAD_DIM] __attribute__((aligned(64)));
            state_t state;
            scale_queries(q + head0 * HEAD_DIM, rows, scale, qf);
            attend_part(q + head0 * HEAD_DIM, qf, kv_from_head(kv, kv0), table, start, end, num_kv_heads, heads, scale,
                        after, &state);
            if (len <= PART_TOKENS) {
                finish(rows, &state, out + head0 * HEAD_DIM);
            } else {
                float *mine = kept + item * stride;
                for (int64_t g = 0; g < rows; g++) {
                    for (int i = 0; i < HEAD_DIM; i++) mine[g * HEAD_DIM + i] = state.acc[g][i];
                    mine[rows * HEAD_DIM + g] = state.max[g];
                    mine[rows * HEAD_DIM + rows + g] = state.sum[g];
                }
            }
            item = then;
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t fold = 0; fold < num_seqs * groups; fold++) {
            const int64_t seq = fold / groups, len = context_lens[seq];
            if (len <= PART_TOKENS) continue;
            int64_t first = 0; /* the sequence's first part */
            for (int64_t n = 0; n < seq; n++) first += parts_of(context_lens[n]);
            const int64_t kv0 = fold % groups * group, heads = num_kv_heads - kv0 < group ? num_kv_heads - kv0 : group;
            const int64_t rows = heads * GROUP;
            state_t total;
            empty_state(rows, &total);
            for (int64_t p = 0; p < parts_of(len); p++) {
                const float *later = kept + (fold % groups * total_parts + first + p) * stride;
                merge(rows, &total, later, later + rows * HEAD_DIM, later + rows * HEAD_DIM + rows);
            }
            finish(rows, &total, out + (seq * num_heads + kv0 * GROUP) * HEAD_DIM);
        }
    }
    return 1;
}

/*
 * q, out: [num_seqs, num_kv_heads * GROUP, HEAD_DIM], contiguous.
 * k_cache, v_cache: [num_blocks, BLOCK, num_kv_heads, HEAD_DIM], contiguous (int8 with KV_INT8).
 * k_scale, v_scale: with KV_INT8, [num_blocks, num_kv_heads, BLOCK] float32, contiguous; else unused.
 * block_tables: [num_seqs, max_blocks] int32, row n covering context_lens[n] >= 1 tokens.
 */
void duoserve_paged_decode_attention(const elem_t *q, const cache_t *k_cache, const cache_t *v_cache,
                                     const float *k_scale, const float *v_scale, const int32_t *block_tables, const int32_t *context_lens, elem_t *out,
                                     int64_t num_seqs, int64_t num_kv_heads, int64_t max_blocks, float scale,
                                     int num_threads)
{
    const int64_t num_heads = num_kv_heads * GROUP;
    const kv_t kv = {k_cache, v_cache, KV_INT8 ? k_scale : 0, KV_INT8 ? v_scale : 0};
    if (num_kv_heads <= MAX_HEADS_PER_ITEM && num_seqs >= 4 * num_threads) {
        /* Enough sequences to share out whole: read each one's rows front to back. */
        /* Shared out one at a time, as schedule(dynamic, 1) would, but each thread takes its next
         * sequence before it starts the current one, so its last block prefetches the next one's first. */
        int64_t taken = 0;
#pragma omp parallel num_threads(num_threads)
        {
            int64_t seq = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            while (seq < num_seqs) {
                const int64_t then = __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
                attend(q + seq * num_heads * HEAD_DIM, kv, block_tables + seq * max_blocks,
                       context_lens[seq], out + seq * num_heads * HEAD_DIM, num_kv_heads, num_kv_heads, scale,
                       then < num_seqs ? block_tables + then * max_blocks : NULL);
                seq = then;
            }
        }
        return;
    }
    int64_t longest = 0;
    for (int64_t n = 0; n < num_seqs; n++) longest = context_lens[n] > longest ? context_lens[n] : longest;
    if (longest > SPLIT_ABOVE && attend_parts(q, kv, block_tables, context_lens, out, num_seqs,
                                              num_kv_heads, max_blocks, scale, num_threads))
        return;
    /* Short contexts (or no buffer for the parts): (sequence, kv head) items, each its parts in turn. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t head0 = seq * num_heads + kv_head * GROUP;
        attend(q + head0 * HEAD_DIM, kv_from_head(kv, kv_head), block_tables + seq * max_blocks, context_lens[seq],
               out + head0 * HEAD_DIM, num_kv_heads, 1, scale, NULL);
    }
}

/* Which intrinsics path this build takes: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (plain C). */
int duoserve_paged_decode_vector_path(void) { return VECTOR_PATH; }
