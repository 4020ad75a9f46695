/*
 * A decode step through a run of decoder layers, in one call.
 *
 * At a few rows every op of a layer is tiny except the weight-streaming linears, so the step's
 * time beyond reading the weights is the cost of calling ops: about 30 microseconds each from
 * Python, eight per layer. This runs the same kernels the per-op path calls, in the same order,
 * on the same buffers: the pair-layout linear (qkv, o, gate_up, down) on weights packed by
 * kernels/cpu_pair_linear.py, rotary, the KV write, paged decode attention, residual add +
 * RMSNorm and SiLU-and-multiply. So its results are those of the per-op path, bit for bit, for
 * batches of up to 64 rows. The linear runs on the per-op path's engine (AMX tiles, or AVX-512
 * BF16 dot products with -DNO_AMX=1). Built by kernels/cpu_stack.py for bfloat16 with the
 * attention shape fixed (-DHEAD_DIM, -DGROUP, -DBLOCK).
 */
#include <stdint.h>
#include <string.h>

#include "fused_ops.c"
#include "paged_decode_attention.c"
#include "pair_linear.c"

#if !ELEM_BF16
#error "the decode stack runs in bfloat16 (build with -DELEM_BF16=1)"
#endif

/* One decoder layer's weights (bfloat16) and KV cache. The four linears' weights are packed in
 * pairs (kernels/cpu_pair_linear.py); their shapes are those of the plain [out, in] weight. */
typedef struct {
    const uint16_t *qkv_pair;     /* [q_size + 2 kv_size, hidden] */
    const uint16_t *qkv_bias;     /* [q_size + 2 kv_size] or NULL */
    const uint16_t *o_pair;       /* [hidden, q_size] */
    const uint16_t *post_norm;    /* [hidden] */
    const uint16_t *gate_up_pair; /* [2 ffn, hidden] */
    const uint16_t *down_pair;    /* [hidden, ffn] */
    const uint16_t *next_norm;    /* [hidden]: the next layer's input norm, or the final norm */
    uint16_t *k_cache, *v_cache;  /* [num_blocks, BLOCK, num_kv_heads, HEAD_DIM] */
} duoserve_layer;

/* The shape of the model and of the step. */
typedef struct {
    int64_t rows, hidden, num_kv_heads, ffn, max_blocks;
    float eps, scale;
    const float *cos_table, *sin_table; /* [rows, HEAD_DIM / 2], rounded to bfloat16 */
    const int64_t *slots;               /* [rows]: each row's cache slot */
    const int32_t *block_tables;        /* [rows, max_blocks] */
    const int32_t *context_lens;        /* [rows], the new token included */
    uint16_t *scratch; /* rows * (q_size + 2 kv_size + 2 q_size + 3 ffn + hidden) elements */
} duoserve_step;

/*
 * x [rows, hidden]: the first layer's normed input; residual [rows, hidden]: updated in place.
 * On return x holds next_norm(residual) of the last layer run, as the per-op path leaves it.
 * `stop` (or NULL): after each layer, a non-zero value ends the call early (another thread
 * sets it when the caller has work to do between layers). Returns the number of layers run.
 */
int64_t duoserve_decode_stack(const duoserve_layer *layers, int64_t num_layers, const duoserve_step *step,
                              uint16_t *x, uint16_t *residual, int num_threads, const volatile int32_t *stop)
{
    const int64_t rows = step->rows, hidden = step->hidden, ffn = step->ffn;
    const int64_t kv_size = step->num_kv_heads * HEAD_DIM, q_size = kv_size * GROUP;
    const int64_t qkv_size = q_size + 2 * kv_size;
    uint16_t *qkv = step->scratch;         /* [rows, qkv_size] */
    uint16_t *q = qkv + rows * qkv_size;   /* [rows, q_size], contiguous for the attention */
    uint16_t *attn = q + rows * q_size;    /* [rows, q_size] */
    uint16_t *gate_up = attn + rows * q_size; /* [rows, 2 ffn] */
    uint16_t *act = gate_up + rows * 2 * ffn; /* [rows, ffn] */
    uint16_t *out = act + rows * ffn;      /* [rows, hidden] */
    for (int64_t l = 0; l < num_layers; l++) {
        const duoserve_layer *layer = layers + l;
        duoserve_pair_linear(x, hidden, layer->qkv_pair, layer->qkv_bias, qkv, rows, qkv_size, hidden,
                             num_threads);
        duoserve_rotary(qkv, qkv_size, q_size / HEAD_DIM, qkv + q_size, qkv_size, step->num_kv_heads,
                        step->cos_table, step->sin_table, rows, HEAD_DIM / 2, num_threads);
        duoserve_write_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, layer->k_cache, layer->v_cache,
                          step->slots, rows, kv_size);
        for (int64_t r = 0; r < rows; r++) memcpy(q + r * q_size, qkv + r * qkv_size, q_size * sizeof(uint16_t));
        duoserve_paged_decode_attention(q, layer->k_cache, layer->v_cache, step->block_tables, step->context_lens,
                                        attn, rows, step->num_kv_heads, step->max_blocks, step->scale,
                                        num_threads);
        duoserve_pair_linear(attn, q_size, layer->o_pair, NULL, out, rows, hidden, q_size, num_threads);
        duoserve_add_rms_norm(out, residual, layer->post_norm, x, rows, hidden, step->eps, num_threads);
        duoserve_pair_linear(x, hidden, layer->gate_up_pair, NULL, gate_up, rows, 2 * ffn, hidden, num_threads);
        duoserve_silu_and_mul(gate_up, act, rows, ffn, num_threads);
        duoserve_pair_linear(act, ffn, layer->down_pair, NULL, out, rows, hidden, ffn, num_threads);
        duoserve_add_rms_norm(out, residual, layer->next_norm, x, rows, hidden, step->eps, num_threads);
        if (stop && *stop) return l + 1;
    }
    return num_layers;
}
