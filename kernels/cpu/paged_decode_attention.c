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
 * same libgomp as torch, so the kernel and torch's own ops use one thread pool.
 */
#include <stdint.h>

#include "elements.h"

#if !defined(HEAD_DIM) || !defined(GROUP) || !defined(BLOCK) || !defined(ELEM_BF16)
#error "build with -DHEAD_DIM=.. -DGROUP=.. -DBLOCK=.. -DELEM_BF16=0|1"
#endif

#define ROW (num_kv_heads * HEAD_DIM) /* elements per cache slot */

/* A whole-sequence work item holds at most this many kv heads' state (qf and acc: 16 KB each at most). */
#define MAX_HEADS_PER_ITEM (4096 / (GROUP * HEAD_DIM) < 1 ? 1 : 4096 / (GROUP * HEAD_DIM) > 8 ? 8 : 4096 / (GROUP * HEAD_DIM))

/*
 * `heads` kv heads of one sequence, from the kv head that q, k_cache, v_cache and out point at
 * (1 for a (sequence, kv head) item; all of them, `num_kv_heads`, for a whole sequence, whose
 * blocks are then read row by row front to back). Each head's arithmetic is the same either way.
 */
static void attend(const elem_t *q, const elem_t *k_cache, const elem_t *v_cache, const int32_t *table,
                   int64_t context_len, elem_t *out, int64_t num_kv_heads, int64_t heads, float scale)
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
        const elem_t *keys = k_cache + block * BLOCK * ROW;
        const elem_t *values = v_cache + block * BLOCK * ROW;
        /* The cache is far larger than the CPU's caches and blocks are scattered: the next
         * block's rows (of these heads) are fetched a row per token of this block, spread over
         * its compute (a burst of the whole block's fetches at once stalls on them; measured). */
        const int64_t next = start + BLOCK < context_len ? table[start / BLOCK + 1] : -1;
        /* Scores for the whole block (slots past the context hold stale data and are masked). */
        for (int t = 0; t < BLOCK; t++) {
            if (next >= 0) {
                for (int64_t line = 0; line < heads * HEAD_DIM * (int64_t)sizeof(elem_t); line += 64) {
                    __builtin_prefetch((const char *)(k_cache + (next * BLOCK + t) * ROW) + line);
                    __builtin_prefetch((const char *)(v_cache + (next * BLOCK + t) * ROW) + line);
                }
            }
            for (int64_t h = 0; h < heads; h++) {
                float kf[HEAD_DIM] __attribute__((aligned(64)));
                for (int i = 0; i < HEAD_DIM; i++) kf[i] = load(keys[t * ROW + h * HEAD_DIM + i]);
                for (int g = 0; g < GROUP; g++) {
                    float dot = 0.0f;
                    for (int i = 0; i < HEAD_DIM; i++) dot += qf[h * GROUP + g][i] * kf[i];
                    scores[h * GROUP + g][t] = t < valid ? dot : -1e30f;
                }
            }
        }
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
        for (int64_t t = 0; t < valid; t++) {
            for (int64_t h = 0; h < heads; h++) {
                float vf[HEAD_DIM] __attribute__((aligned(64)));
                for (int i = 0; i < HEAD_DIM; i++) vf[i] = load(values[t * ROW + h * HEAD_DIM + i]);
                for (int g = 0; g < GROUP; g++) {
                    const float p = scores[h * GROUP + g][t];
                    for (int i = 0; i < HEAD_DIM; i++) acc[h * GROUP + g][i] += p * vf[i];
                }
            }
        }
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
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (int64_t seq = 0; seq < num_seqs; seq++)
            attend(q + seq * num_heads * HEAD_DIM, k_cache, v_cache, block_tables + seq * max_blocks,
                   context_lens[seq], out + seq * num_heads * HEAD_DIM, num_kv_heads, num_kv_heads, scale);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t head0 = seq * num_heads + kv_head * GROUP;
        attend(q + head0 * HEAD_DIM, k_cache + kv_head * HEAD_DIM, v_cache + kv_head * HEAD_DIM,
               block_tables + seq * max_blocks, context_lens[seq], out + head0 * HEAD_DIM, num_kv_heads, 1, scale);
    }
}
