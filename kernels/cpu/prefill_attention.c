/*
 * Prefill attention in bfloat16, in and out: each chunk's queries attend causally to themselves
 * and to all of their sequence's cached prefix. A prefill step of SmolLM2 spent a fifth of its
 * time in torch's CPU flash kernel, which reaches about 100 GFLOP/s on these shapes (on a
 * 2-core AMD EPYC without AMX: 9.2 ms a layer for 8 prompts of 256 tokens, about 65 GFLOP/s).
 *
 * Per chunk and kv head, keys and values are first packed into bfloat16 pairs (zero past the
 * last key): a whole prompt's from its own rows of k and v, a chunk behind a prefix's from the
 * paged cache through its slots. Then each work item, one query head and 16 query rows, computes
 * its scores against every key it may see in float32, takes an exact softmax row by row (no
 * running rescale: the rows fit in cache), rounds the unnormalised probabilities to bfloat16,
 * multiplies them with the values in float32 and divides by their sum.
 *
 * Two engines multiply, on the same packed layouts, to the same float32 sums of products:
 * - AMX tiles where the CPU has AMX-BF16 (and NO_AMX is not defined to 1). Tiles, all 16 rows x
 *   64 bytes. Scores: t1 (and t7 for head_dim 64) the queries, loaded once per work item, t0 and
 *   t2 in turn a block of keys, t3 .. t6 four blocks' scores. Probabilities x values: t1 the
 *   probabilities, t2 the values, t3.. the output's HEAD_DIM / 16 column blocks.
 * - AVX-512 BF16 dot products elsewhere: sixteen float32 accumulators, one per query row, each
 *   taking a broadcast pair of the row's bfloat16 elements against one packed row of pairs.
 * They may differ in the order they add products within a 16 x 16 block, so not bit for bit.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !NO_AMX
#define USE_AMX 1
#include "amx.h"
#else
#define USE_AMX 0
#if !defined(__AVX512BF16__)
#error "the prefill attention needs AMX-BF16 or AVX-512 BF16"
#endif
#include <immintrin.h>
#endif
#include "avx512.h"

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=32|64"
#endif
#if HEAD_DIM != 32 && HEAD_DIM != 64
#error "HEAD_DIM must be 32 or 64"
#endif
#define D HEAD_DIM
#define DSTEPS (D / 32) /* 32-element steps of a query-key product */
#define OTILES (D / 16) /* 16-column blocks of the output */
#define ALIGN 64

/* 1 when the kernel multiplies on AMX tiles (the caller then requests the tile state). */
int duoserve_prefill_attention_uses_amx(void) { return USE_AMX; }

#if USE_AMX
static void configure(void)
{
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* The calling thread's workspace, kept between calls (a step calls once per layer). */
static __thread void *workspace;
static __thread size_t workspace_bytes;

static void *grow_workspace(size_t bytes)
{
    if (bytes > workspace_bytes) {
        free(workspace);
        workspace = aligned_alloc(ALIGN, (size_t)round_up((int64_t)bytes, ALIGN));
        workspace_bytes = workspace ? bytes : 0;
    }
    return workspace;
}

static inline __mmask16 first(int64_t lanes) { return lanes >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << lanes) - 1u); }

/* One row of scores s[0 .. seen): exp((s - max) * scale) as bfloat16 in prob[0 .. seen), zeros in
 * prob[seen .. end), and the sum of those exps (the caller divides the row's output by it). Both
 * hold at least `end` elements, end in 16s. */
static float softmax_row(const float *s, uint16_t *prob, int64_t seen, int64_t end, float scale)
{
    __m512 top = _mm512_set1_ps(-3.0e38f), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j += 16) {
        const __mmask16 m = first(seen - j);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top)), factor = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < end; j += 16) {
        __m512 e = _mm512_setzero_ps();
        if (j < seen)
            e = _mm512_maskz_mov_ps(first(seen - j), exp16_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift), factor)));
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i *)(prob + j), rounded);
        /* The sum of what the values are multiplied by: the rounded probabilities. */
        sum = _mm512_add_ps(sum, widen16_bf16(rounded));
    }
    return _mm512_reduce_add_ps(sum);
}

/* A 16 x 16 matrix of 32-bit elements, transposed in registers. */
static void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Each 128-bit lane k of r[4a + b] now holds rows 4a..4a+3 at columns 4k + b. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);      /* lanes 0, 2 of each */
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);  /* lanes 1, 3 */
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);       /* column lane 0 */
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);   /* column lane 2 */
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88); /* column lane 1 */
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd); /* column lane 3 */
    }
}

#if USE_AMX
/* One packed block of 16 keys, its step s, into B tile `b`, and C tile `c` += the queries' A tile `a` times it. */
#define SCORE_STEP(c, a, b, block, s)                          \
    do {                                                       \
        _tile_loadd(b, keys + (block) * DSTEPS * 512 + (s) * 512, 64); \
        _tile_dpbf16ps(c, a, b);                               \
    } while (0)

/* scores [16][width], columns 0 .. 16 * blocks = queries [16][D] (rows q_bytes apart) x packed key
 * blocks 0 .. blocks - 1. The queries' tiles (t1, and t7 for D 64) are loaded once; four blocks at
 * a time accumulate in t3 .. t6, their keys loaded into t0 and t2 in turn, so that four products
 * are in flight where one block's two depend on each other. */
static void scores_rows(const uint16_t *queries, int64_t q_bytes, const uint16_t *keys, int64_t blocks, float *scores, int64_t width)
{
    _tile_loadd(1, queries, q_bytes);
#if DSTEPS > 1
    _tile_loadd(7, queries + 32, q_bytes);
#endif
    int64_t jt = 0;
    for (; jt + 4 <= blocks; jt += 4) {
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        SCORE_STEP(3, 1, 0, jt, 0);
        SCORE_STEP(4, 1, 2, jt + 1, 0);
        SCORE_STEP(5, 1, 0, jt + 2, 0);
        SCORE_STEP(6, 1, 2, jt + 3, 0);
#if DSTEPS > 1
        SCORE_STEP(3, 7, 0, jt, 1);
        SCORE_STEP(4, 7, 2, jt + 1, 1);
        SCORE_STEP(5, 7, 0, jt + 2, 1);
        SCORE_STEP(6, 7, 2, jt + 3, 1);
#endif
        _tile_stored(3, scores + jt * 16, width * 4);
        _tile_stored(4, scores + (jt + 1) * 16, width * 4);
        _tile_stored(5, scores + (jt + 2) * 16, width * 4);
        _tile_stored(6, scores + (jt + 3) * 16, width * 4);
    }
    for (; jt < blocks; jt++) {
        _tile_zero(3);
        SCORE_STEP(3, 1, 0, jt, 0);
#if DSTEPS > 1
        SCORE_STEP(3, 7, 2, jt, 1);
#endif
        _tile_stored(3, scores + jt * 16, width * 4);
    }
}
#undef SCORE_STEP

/* outputs [16][D] = probs [16][chunks * 32] (rows `width` apart) x the packed values. */
static void weigh_values(const uint16_t *probs, const uint16_t *values, int64_t chunks, int64_t width, float *outputs)
{
    _tile_zero(3);
    _tile_zero(4);
#if OTILES > 2
    _tile_zero(5);
    _tile_zero(6);
#endif
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = values + c * OTILES * 512;
        _tile_loadd(1, probs + c * 32, width * 2);
        _tile_loadd(2, chunk, 64);
        _tile_dpbf16ps(3, 1, 2);
        _tile_loadd(2, chunk + 512, 64);
        _tile_dpbf16ps(4, 1, 2);
#if OTILES > 2
        _tile_loadd(2, chunk + 1024, 64);
        _tile_dpbf16ps(5, 1, 2);
        _tile_loadd(2, chunk + 1536, 64);
        _tile_dpbf16ps(6, 1, 2);
#endif
    }
    _tile_stored(3, outputs, D * 4);
    _tile_stored(4, outputs + 16, D * 4);
#if OTILES > 2
    _tile_stored(5, outputs + 32, D * 4);
    _tile_stored(6, outputs + 48, D * 4);
#endif
}
#else
/* As the tile version: acc[r] += (row r's pair p) . (packed row p: 16 columns' pairs), for each p. */
static void scores_block(const uint16_t *queries, int64_t q_bytes, const uint16_t *keys, float *scores, int64_t width)
{
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int s = 0; s < DSTEPS; s++)
        for (int p = 0; p < 16; p++) {
            const __m512bh column_pairs = (__m512bh)_mm512_loadu_si512(keys + s * 512 + p * 32);
            for (int r = 0; r < 16; r++) {
                const uint16_t *row = (const uint16_t *)((const char *)queries + r * q_bytes);
                acc[r] = _mm512_dpbf16_ps(acc[r], broadcast_pair_bf16(row + s * 32 + 2 * p), column_pairs);
            }
        }
    for (int r = 0; r < 16; r++) _mm512_storeu_ps(scores + r * width, acc[r]);
}

/* As the tile version: every block's scores, the queries' rows q_bytes apart. */
static void scores_rows(const uint16_t *queries, int64_t q_bytes, const uint16_t *keys, int64_t blocks, float *scores, int64_t width)
{
    for (int64_t jt = 0; jt < blocks; jt++) scores_block(queries, q_bytes, keys + jt * DSTEPS * 512, scores + jt * 16, width);
}

static void weigh_values(const uint16_t *probs, const uint16_t *values, int64_t chunks, int64_t width, float *outputs)
{
    for (int o = 0; o < OTILES; o++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *block = values + (c * OTILES + o) * 512;
            for (int p = 0; p < 16; p++) {
                const __m512bh column_pairs = (__m512bh)_mm512_loadu_si512(block + p * 32);
                for (int r = 0; r < 16; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], broadcast_pair_bf16(probs + r * width + c * 32 + 2 * p), column_pairs);
            }
        }
        for (int r = 0; r < 16; r++) _mm512_storeu_ps(outputs + r * D + o * 16, acc[r]);
    }
}
#endif

/* Row j of a prompt's keys or values: base + j * stride, or base + slots[j] * stride (the cache). */
static inline const uint16_t *row_of(const uint16_t *base, int64_t stride, const int64_t *slots, int64_t j)
{
    return base + (slots ? slots[j] : j) * stride;
}

/* Keys [len, D] -> [len / 16][DSTEPS][16 pairs][16 keys] of (d, d + 1). */
static void pack_keys(const uint16_t *k, int64_t stride, const int64_t *slots, int64_t len, uint32_t *packed)
{
    for (int64_t j0 = 0; j0 < len; j0 += 16)
        for (int s = 0; s < DSTEPS; s++) {
            __m512i rows[16];
            for (int n = 0; n < 16; n++)
                rows[n] = j0 + n < len ? _mm512_loadu_si512(row_of(k, stride, slots, j0 + n) + s * 32)
                                       : _mm512_setzero_si512();
            transpose16(rows);
            uint32_t *tile = packed + ((j0 / 16) * DSTEPS + s) * 256;
            for (int pair = 0; pair < 16; pair++) _mm512_storeu_si512(tile + pair * 16, rows[pair]);
        }
}

/* Values [len, D] -> [len / 32][OTILES][16 key pairs][16 columns][2 keys]. */
static void pack_values(const uint16_t *v, int64_t stride, const int64_t *slots, int64_t len, uint16_t *packed)
{
    /* Interleave two rows' 16-bit columns: (a[d], b[d]) for d in 0..15, then 16..31. */
    __m512i low_index, high_index;
    {
        uint16_t low[32], high[32];
        for (int d = 0; d < 16; d++) {
            low[2 * d] = (uint16_t)d, low[2 * d + 1] = (uint16_t)(32 + d);
            high[2 * d] = (uint16_t)(16 + d), high[2 * d + 1] = (uint16_t)(48 + d);
        }
        low_index = _mm512_loadu_si512(low);
        high_index = _mm512_loadu_si512(high);
    }
    for (int64_t j = 0; j < round_up(len, 32); j += 2) {
        uint16_t *chunk = packed + (j / 32) * OTILES * 512 + ((j % 32) / 2) * 32;
        for (int half = 0; half < D / 32; half++) {
            const __m512i a = j < len ? _mm512_loadu_si512(row_of(v, stride, slots, j) + half * 32) : _mm512_setzero_si512();
            const __m512i b =
                j + 1 < len ? _mm512_loadu_si512(row_of(v, stride, slots, j + 1) + half * 32) : _mm512_setzero_si512();
            _mm512_storeu_si512(chunk + (2 * half) * 512, _mm512_permutex2var_epi16(a, low_index, b));
            _mm512_storeu_si512(chunk + (2 * half + 1) * 512, _mm512_permutex2var_epi16(a, high_index, b));
        }
    }
}

/* Elements of one (prompt, kv head)'s packed keys and values. */
static int64_t packed_size(int64_t keys) { return (round_up(keys, 16) + round_up(keys, 32)) * D; }

/*
 * q: [T, H, D] bf16, rows q_stride elements apart (heads D apart); k, v: [T, Hkv, D], rows
 * k_stride / v_stride apart; out: [T, H, D], rows out_stride apart. Chunk p is query rows
 * [starts[p], starts[p] + lens[p]) at positions prefixes[p] onwards of its sequence: query i sees
 * keys 0 .. prefixes[p] + i. With no prefix its keys and values are its own rows of k and v; with
 * one they are all read from k_cache / v_cache ([slots, Hkv, D], rows cache_stride apart) at
 * slots[slot_starts[p] + j] for position j (the chunk's own already written there). Query head h
 * reads kv head h / (H / Hkv). scale: the scores' factor (1 / sqrt(D)).
 * Returns 0, or -1 when the workspace could not be allocated (nothing written).
 */
int duoserve_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                   const uint16_t *v, int64_t v_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t cache_stride, uint16_t *out, int64_t out_stride,
                                   const int64_t *starts, const int64_t *lens, const int64_t *prefixes,
                                   const int64_t *slot_starts, const int64_t *slots, int64_t num_prompts,
                                   int64_t num_heads, int64_t num_kv_heads, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    int64_t packed_elems = 0, longest = 0, items = 0;
    for (int64_t p = 0; p < num_prompts; p++) {
        const int64_t keys = prefixes[p] + lens[p];
        packed_elems += num_kv_heads * packed_size(keys);
        longest = keys > longest ? keys : longest;
        items += round_up(lens[p], 16) / 16 * num_heads;
    }
    const int64_t width = round_up(longest, 32); /* a score or probability row */
    const size_t per_thread = (size_t)(16 * width * 4 + 16 * width * 2 + 16 * D * 2 + 16 * D * 4);
    const size_t packed_bytes = (size_t)round_up(packed_elems * 2, ALIGN);
    uint8_t *base = grow_workspace(packed_bytes + (size_t)num_threads * round_up((int64_t)per_thread, ALIGN));
    if (!base) return -1;
    uint16_t *packed = (uint16_t *)base;

#pragma omp parallel num_threads(num_threads)
    {
        /* Packing: one (chunk, kv head) at a time. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_prompts * num_kv_heads; item++) {
            const int64_t p = item / num_kv_heads, g = item % num_kv_heads, count = prefixes[p] + lens[p];
            int64_t offset = 0;
            for (int64_t e = 0; e < p; e++) offset += num_kv_heads * packed_size(prefixes[e] + lens[e]);
            uint16_t *keys = packed + offset + g * packed_size(count);
            uint16_t *values = keys + round_up(count, 16) * D;
            if (prefixes[p] == 0) {
                pack_keys(k + starts[p] * k_stride + g * D, k_stride, NULL, count, (uint32_t *)keys);
                pack_values(v + starts[p] * v_stride + g * D, v_stride, NULL, count, values);
            } else {
                const int64_t *at = slots + slot_starts[p];
                pack_keys(k_cache + g * D, cache_stride, at, count, (uint32_t *)keys);
                pack_values(v_cache + g * D, cache_stride, at, count, values);
            }
        }

        uint8_t *mine = base + packed_bytes + (size_t)omp_get_thread_num() * round_up((int64_t)per_thread, ALIGN);
        float *scores = (float *)mine;                       /* [16][width] */
        uint16_t *probs = (uint16_t *)(scores + 16 * width); /* [16][width] */
        uint16_t *queries = probs + 16 * width;              /* [16][D] */
        float *outputs = (float *)(queries + 16 * D);        /* [16][D] */
#if USE_AMX
        configure();
#endif

        /* Attention: one query head and 16 query rows per item, a chunk's last rows first. Items
         * are taken 4 at a time: each take is an atomic add on a line both cores write, about
         * 130 ns here, and one at a time they cost 11% of 8 prompts x 256 (1.14 against 1.29-1.41 ms). */
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < items; item++) {
            int64_t p = 0, rest = item, offset = 0;
            while (rest >= round_up(lens[p], 16) / 16 * num_heads) {
                rest -= round_up(lens[p], 16) / 16 * num_heads;
                offset += num_kv_heads * packed_size(prefixes[p] + lens[p]);
                p++;
            }
            const int64_t len = lens[p], prefix = prefixes[p], blocks = round_up(len, 16) / 16;
            const int64_t i0 = (blocks - 1 - rest / num_heads) * 16, h = rest % num_heads, g = h / group;
            const int64_t rows = len - i0 < 16 ? len - i0 : 16, last = prefix + i0 + rows - 1; /* a key */
            const uint16_t *keys = packed + offset + g * packed_size(prefix + len);
            const uint16_t *values = keys + round_up(prefix + len, 16) * D;

            /* Scores against key blocks 0 .. last / 16: a whole block of query rows read in place,
             * a chunk's last rows (fewer than 16) copied out first, zeros after them. */
            const uint16_t *rows_of_q = q + (starts[p] + i0) * q_stride + h * D;
            int64_t q_bytes = q_stride * 2;
            if (rows < 16) {
                for (int64_t r = 0; r < 16; r++) {
                    if (r < rows) memcpy(queries + r * D, rows_of_q + r * q_stride, D * 2);
                    else memset(queries + r * D, 0, D * 2);
                }
                rows_of_q = queries;
                q_bytes = D * 2;
            }
            scores_rows(rows_of_q, q_bytes, keys, last / 16 + 1, scores, width);
            /* Softmax of row r over keys 0 .. prefix + i0 + r; zeros beyond, up to the last 32-key chunk. */
            const int64_t chunks = last / 32 + 1;
            float sums[16];
            for (int64_t r = 0; r < 16; r++) {
                const int64_t seen = r < rows ? prefix + i0 + r + 1 : 0;
                sums[r] = softmax_row(scores + r * width, probs + r * width, seen, chunks * 32, scale);
            }
            /* Probabilities x values, 32 keys at a time. */
            weigh_values(probs, values, chunks, width, outputs);
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *dst = out + (starts[p] + i0 + r) * out_stride + h * D;
                const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
                for (int c = 0; c < D / 16; c++)
                    _mm256_storeu_si256((__m256i *)(dst + c * 16),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(outputs + r * D + c * 16), inverse)));
            }
        }
#if USE_AMX
        _tile_release();
#endif
    }
    return 0;
}
