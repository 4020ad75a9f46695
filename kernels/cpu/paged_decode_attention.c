/*
 * Paged decode attention for the CPU worker: one query token per sequence, keys and values
 * read in place from the paged cache ([num_blocks, BLOCK, num_kv_heads, HEAD_DIM] per layer),
 * so no step copies a sequence's context. Built by kernels/cpu_decode.py with the model's
 * shape fixed at compile time (-DHEAD_DIM, -DGROUP, -DBLOCK, -DELEM_BF16) so the compiler
 * can keep each work item's accumulators in vector registers.
 *
 * One work item is (sequence, kv head): its GROUP query heads walk the sequence's blocks
 * once, with an online softmax in float32 (scores, running max and sum, output accumulator).
 * With at least 4 sequences per thread an item is a whole sequence instead, all its kv heads
 * at once, so each block's rows are read front to back (about 10% faster once the cache no
 * longer fits the CPU's caches). Work items are shared out by OpenMP; the library links the
 * same libgomp as torch, so the kernel and torch's own ops use one thread pool. Scores, the
 * softmax and value sums take an intrinsics path: AVX-512 where the CPU has it (and block sizes
 * in 16s, head_dim in 32s), else AVX2 + FMA (block sizes in 8s), else plain C.
 */
#include <stddef.h>
#include <stdint.h>

#include "elements.h"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(BLOCK) || !defined(ELEM_BF16)
#error "build with -DHEAD_DIM=.. -DGROUP=.. -DBLOCK=.. -DELEM_BF16=0|1"
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
 */
typedef struct {
    const char *base; /* the next block's first row, at the item's first head; NULL: none */
    int64_t row_bytes, lines_per_row, per_call;
    int64_t row, line;
} fetch_cursor;

static inline fetch_cursor fetch_start(const elem_t *next, int64_t row, int64_t heads, int64_t calls)
{
    const int64_t lines_per_row = (heads * HEAD_DIM * (int64_t)sizeof(elem_t) + 63) / 64;
    const fetch_cursor cursor = {(const char *)next, row * (int64_t)sizeof(elem_t), lines_per_row,
                                 (BLOCK * lines_per_row + calls - 1) / calls, 0, 0};
    return cursor;
}

static inline void fetch_some(fetch_cursor *c)
{
    for (int64_t i = 0; i < c->per_call && c->base && c->row < BLOCK; i++) {
        __builtin_prefetch(c->base + c->row * c->row_bytes + c->line * 64, 0, 1);
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
#if ELEM_BF16 && defined(__AVX512BF16__)
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

static inline __m512 load16(const elem_t *p)
{
#if ELEM_BF16
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
static inline __m256 load8(const elem_t *p)
{
#if ELEM_BF16
    return load8_bf16(p);
#else
    return _mm256_loadu_ps(p);
#endif
}

#define VECS_FIT(n) (GROUP * (n) <= 12 && (HEAD_DIM / 8) % (n) == 0)
#define VALUE_VECS (VECS_FIT(8) ? 8 : VECS_FIT(4) ? 4 : VECS_FIT(2) ? 2 : 1)
#endif

/*
 * scores[h * GROUP + g][t] = q·k / sqrt(HEAD_DIM) for the block's slots t (rows `row` elements
 * apart), -1e30 from slot `valid` on (those slots hold stale data). q: the item's query rows;
 * qf: the same, scaled, in float32.
 */
static void block_scores(const elem_t *q, float (*qf)[HEAD_DIM], const elem_t *keys, int64_t row, int64_t heads,
                         int64_t valid, float scale, float (*scores)[BLOCK], fetch_cursor *fetch)
{
#if VECTOR_PATH == 512
    (void)q, (void)qf; /* the bfloat16 dot products read q, the others qf */
    for (int64_t h = 0; h < heads; h++) {
        for (int t0 = 0; t0 < BLOCK; t0 += 16) {
            const int64_t left = valid - t0;
            const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            for (int g = 0; g < GROUP; g++) {
                __m512 dots[16];
                for (int t = 0; t < 16; t++) {
                    const elem_t *key = keys + (t0 + t) * row + h * HEAD_DIM;
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
                }
                fetch_some(fetch);
                __m512 sums = sum16(dots);
                if (DOT_BF16) sums = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
                _mm512_store_ps(scores[h * GROUP + g] + t0, _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), sums));
            }
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
                const elem_t *key = keys + t0 * row + h * HEAD_DIM;
                __m256 dots[8];
                for (int t = 0; t < 8; t++) dots[t] = _mm256_mul_ps(_mm256_load_ps(query), load8(key + t * row));
                for (int c = 8; c < HEAD_DIM; c += 8) {
                    const __m256 qc = _mm256_load_ps(query + c);
                    for (int t = 0; t < 8; t++) dots[t] = _mm256_fmadd_ps(qc, load8(key + t * row + c), dots[t]);
                }
                fetch_some(fetch);
                _mm256_store_ps(scores[h * GROUP + g] + t0, _mm256_blendv_ps(_mm256_set1_ps(-1e30f), sum8x8(dots), live));
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
            for (int i = 0; i < HEAD_DIM; i++) kf[i] = load(keys[t * row + h * HEAD_DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                float dot = 0.0f;
                for (int i = 0; i < HEAD_DIM; i++) dot += qf[h * GROUP + g][i] * kf[i];
                scores[h * GROUP + g][t] = t < valid ? dot : -1e30f;
            }
        }
    }
#endif
}

/* acc[h * GROUP + g] += p[h * GROUP + g][t] * value[t] over the block's first `valid` slots. */
static void accumulate_values(const elem_t *values, int64_t row, int64_t heads, int64_t valid,
                              float (*p)[BLOCK], float (*acc)[HEAD_DIM], fetch_cursor *fetch)
{
#if VECTOR_PATH == 512
    for (int64_t h = 0; h < heads; h++) {
        __m512 sums[GROUP][HEAD_DIM / 16];
        for (int g = 0; g < GROUP; g++)
            for (int c = 0; c < HEAD_DIM / 16; c++) sums[g][c] = _mm512_load_ps(acc[h * GROUP + g] + 16 * c);
        for (int64_t t = 0; t < valid; t++) {
            __m512 value[HEAD_DIM / 16];
            for (int c = 0; c < HEAD_DIM / 16; c++) value[c] = load16(values + t * row + h * HEAD_DIM + 16 * c);
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
                const elem_t *value = values + t * row + h * HEAD_DIM + c0;
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
            for (int i = 0; i < HEAD_DIM; i++) vf[i] = load(values[t * row + h * HEAD_DIM + i]);
            for (int g = 0; g < GROUP; g++) {
                const float weight = p[h * GROUP + g][t];
                for (int i = 0; i < HEAD_DIM; i++) acc[h * GROUP + g][i] += weight * vf[i];
            }
        }
    }
#endif
}

/* How many times block_scores and accumulate_values call fetch_some per block (for full blocks). */
#if VECTOR_PATH == 512
#define SCORE_CALLS(heads) ((heads) * GROUP * (BLOCK / 16))
#define VALUE_CALLS(heads) ((heads) * BLOCK)
#elif VECTOR_PATH == 256
#define SCORE_CALLS(heads) ((heads) * GROUP * (BLOCK / 8))
#define VALUE_CALLS(heads) ((heads) * BLOCK * (HEAD_DIM / (8 * VALUE_VECS)))
#else
#define SCORE_CALLS(heads) BLOCK
#define VALUE_CALLS(heads) BLOCK
#endif

/*
 * `heads` kv heads of one sequence, from the kv head that q, k_cache, v_cache and out point at
 * (1 for a (sequence, kv head) item; all of them, `num_kv_heads`, for a whole sequence, whose
 * blocks are then read row by row front to back). Each head's arithmetic is the same either way.
 */
static void attend(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache, const int32_t *table,
                   int64_t context_len, elem_t *out, int64_t num_kv_heads, int64_t heads, float scale,
                   const int32_t *then_table)
{
    const int64_t rows = heads * GROUP; /* query heads */
    float qf[MAX_HEADS_PER_ITEM * GROUP][HEAD_DIM] __attribute__((aligned(64)));
    float acc[MAX_HEADS_PER_ITEM * GROUP][HEAD_DIM] __attribute__((aligned(64)));
    float scores[MAX_HEADS_PER_ITEM * GROUP][BLOCK] __attribute__((aligned(64)));
    float running_max[MAX_HEADS_PER_ITEM * GROUP], running_sum[MAX_HEADS_PER_ITEM * GROUP];
    for (int64_t g = 0; g < rows; g++) {
        for (int i = 0; i < HEAD_DIM; i++) {
            qf[g][i] = load(q[g * HEAD_DIM + i]) * scale;
            acc[g][i] = 0.0f;
        }
        running_max[g] = -1e30f;
        running_sum[g] = 0.0f;
    }
    for (int64_t start = 0; start < context_len; start += BLOCK) {
        const int64_t block = table[start / BLOCK];
        const int64_t valid = context_len - start < BLOCK ? context_len - start : BLOCK;
        /* The block after this one: the sequence's next, or after its last the first of the
         * sequence this thread takes next (`then_table`, or NULL). */
        const int64_t next = start + BLOCK < context_len ? table[start / BLOCK + 1] : then_table ? then_table[0] : -1;
        fetch_cursor next_keys = fetch_start(next < 0 ? 0 : k_cache + next * BLOCK * ROW, ROW, heads, SCORE_CALLS(heads));
        fetch_cursor next_values = fetch_start(next < 0 ? 0 : v_cache + next * BLOCK * ROW, ROW, heads, VALUE_CALLS(heads));
        block_scores(q, qf, k_cache + block * BLOCK * ROW, ROW, heads, valid, scale, scores, &next_keys);
#if VECTOR_PATH == 512
        for (int64_t g = 0; g < rows; g++) {
            __m512 top = _mm512_set1_ps(running_max[g]);
            for (int t = 0; t < BLOCK; t += 16) top = _mm512_max_ps(top, _mm512_load_ps(scores[g] + t));
            const float block_max = _mm512_reduce_max_ps(top);
            const float rescale = exp_nonpositive(running_max[g] - block_max);
            const __m512 shift = _mm512_set1_ps(block_max);
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < BLOCK; t += 16) {
                const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores[g] + t), shift));
                _mm512_store_ps(scores[g] + t, e);
                sum = _mm512_add_ps(sum, e);
            }
            running_sum[g] = running_sum[g] * rescale + _mm512_reduce_add_ps(sum);
            running_max[g] = block_max;
            const __m512 factor = _mm512_set1_ps(rescale);
            for (int i = 0; i < HEAD_DIM; i += 16) _mm512_store_ps(acc[g] + i, _mm512_mul_ps(_mm512_load_ps(acc[g] + i), factor));
        }
#elif VECTOR_PATH == 256
        for (int64_t g = 0; g < rows; g++) {
            __m256 top = _mm256_set1_ps(running_max[g]);
            for (int t = 0; t < BLOCK; t += 8) top = _mm256_max_ps(top, _mm256_load_ps(scores[g] + t));
            const float block_max = hmax8(top);
            const float rescale = exp_nonpositive(running_max[g] - block_max);
            const __m256 shift = _mm256_set1_ps(block_max);
            __m256 sum = _mm256_setzero_ps();
            for (int t = 0; t < BLOCK; t += 8) {
                const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(scores[g] + t), shift));
                _mm256_store_ps(scores[g] + t, e);
                sum = _mm256_add_ps(sum, e);
            }
            running_sum[g] = running_sum[g] * rescale + hsum8(sum);
            running_max[g] = block_max;
            const __m256 factor = _mm256_set1_ps(rescale);
            for (int i = 0; i < HEAD_DIM; i += 8) _mm256_store_ps(acc[g] + i, _mm256_mul_ps(_mm256_load_ps(acc[g] + i), factor));
        }
#else
        for (int64_t g = 0; g < rows; g++) {
            float block_max = running_max[g];
            for (int t = 0; t < BLOCK; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float rescale = exp_nonpositive(running_max[g] - block_max);
            float block_sum = 0.0f;
            for (int t = 0; t < BLOCK; t++) {
                scores[g][t] = exp_nonpositive(scores[g][t] - block_max);
                block_sum += scores[g][t];
            }
            running_sum[g] = running_sum[g] * rescale + block_sum;
            running_max[g] = block_max;
            for (int i = 0; i < HEAD_DIM; i++) acc[g][i] *= rescale;
        }
#endif
        accumulate_values(v_cache + block * BLOCK * ROW, ROW, heads, valid, scores, acc, &next_values);
    }
    for (int64_t g = 0; g < rows; g++) {
        const float inv = 1.0f / running_sum[g];
        for (int i = 0; i < HEAD_DIM; i++) out[g * HEAD_DIM + i] = store(acc[g][i] * inv);
    }
}

/*
 * q, out: [num_seqs, num_kv_heads * GROUP, HEAD_DIM], contiguous.
 * k_cache, v_cache: [num_blocks, BLOCK, num_kv_heads, HEAD_DIM], contiguous.
 * block_tables: [num_seqs, max_blocks] int32, row n covering context_lens[n] >= 1 tokens.
 */
void duoserve_paged_decode_attention(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache,
                                     const int32_t *block_tables, const int32_t *context_lens, elem_t *out,
                                     int64_t num_seqs, int64_t num_kv_heads, int64_t max_blocks, float scale,
                                     int num_threads)
{
    const int64_t num_heads = num_kv_heads * GROUP;
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
                attend(q + seq * num_heads * HEAD_DIM, k_cache, v_cache, block_tables + seq * max_blocks,
                       context_lens[seq], out + seq * num_heads * HEAD_DIM, num_kv_heads, num_kv_heads, scale,
                       then < num_seqs ? block_tables + then * max_blocks : NULL);
                seq = then;
            }
        }
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t head0 = seq * num_heads + kv_head * GROUP;
        attend(q + head0 * HEAD_DIM, k_cache + kv_head * HEAD_DIM, v_cache + kv_head * HEAD_DIM,
               block_tables + seq * max_blocks, context_lens[seq], out + head0 * HEAD_DIM, num_kv_heads, 1, scale,
               NULL);
    }
}

/* Which intrinsics path this build takes: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (plain C). */
int duoserve_paged_decode_vector_path(void) { return VECTOR_PATH; }
