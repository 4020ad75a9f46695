/*
 * A decode step through a run of decoder layers, in one call.
 *
 * At a few rows every op of a layer is tiny except the weight-streaming linears, so the step's
 * time beyond reading the weights is the cost of calling ops: about 30 microseconds each from
 * Python, eight per layer. This runs the same kernels the per-op path calls, in the same order,
 * on the same buffers: the pair-layout linear (qkv, o, gate_up, down) on weights packed by
 * kernels/cpu_pair_linear.py, rotary, the KV write, paged decode attention, residual add +
 * RMSNorm and SiLU-and-multiply (on the pair kernel's dot products, in gate_up's epilogue, as the
 * per-op path runs it there). So its results are those of the per-op path, bit for bit. Two kinds of
 * build, by kernels/cpu_stack.py, with the attention shape fixed (-DHEAD_DIM, -DGROUP, -DBLOCK):
 *   bfloat16 (-DELEM_BF16=1): the pair-layout linear on weights packed by
 *     kernels/cpu_pair_linear.py, on the per-op path's engine (AMX tiles, or AVX-512 BF16 dot
 *     products with -DNO_AMX=1), for batches of up to 64 rows;
 *   GGUF blocks (-DBLOCK_LINEAR=1): the block linear (kernels/cpu/block_linear.c) on the file's
 *     blocks (any type the block linear takes), up to 64 rows, in float32 (-DELEM_BF16=0) or, on CPUs that cannot
 *     multiply bfloat16, in bfloat16 (-DELEM_BF16=1: the linears' inputs widened, their outputs
 *     rounded).
 * Either kind with -DKV_INT8=1 keeps the KV cache in int8 rows with a scale each (kernels/kv_int8.py):
 * the write quantizes, the attention reads the int8 rows.
 */
#include <stdint.h>
#include <string.h>

#include "fused_ops.c"
#include "paged_decode_attention.c"

#if BLOCK_LINEAR
/* y = x @ w.T (+ bias), w the `which` linear's blocks of the layer: the block linear
 * (kernels/cpu/block_linear.c), built and loaded as a library of its own, whose entry for this
 * element type (duoserve_block_linear, or duoserve_block_linear_bf16: x and the bias widened to
 * float32, y rounded back) kernels/cpu_stack.py hands to duoserve_decode_stack_use_block_linear
 * when it loads this one. So the block linear is compiled once, not again for every attention
 * shape's stack. */
typedef int (*block_linear_entry)(const elem_t *x, int64_t x_stride, const uint8_t *w, int type, const elem_t *bias,
                                  elem_t *y, int64_t y_stride, int64_t rows, int64_t n, int64_t k, int threads);
static block_linear_entry block_linear = NULL;
void duoserve_decode_stack_use_block_linear(block_linear_entry entry)
{
    block_linear = entry;
}
#define BLOCK_LINEAR_CALL block_linear
#define LINEAR(layer, which, x, in, bias, y, rows, out, threads)                                                   \
    BLOCK_LINEAR_CALL(x, in, (const uint8_t *)(layer)->which, (layer)->which##_type, bias, y, out, rows, out, in, \
                      threads)
/* Rows first .. first + out - 1 of a fused linear whose parts' blocks differ in type, into those
 * columns of y (row stride y_stride). */
#define PART(w, type, x, in, bias, y, y_stride, first, rows, out, threads)                                       \
    BLOCK_LINEAR_CALL(x, in, (const uint8_t *)(w), type, (bias) == NULL ? NULL : (bias) + (first), (y) + (first), \
                      y_stride, rows, out, in, threads)
#else
#if !ELEM_BF16
#error "the pair-linear decode stack runs in bfloat16 (build with -DELEM_BF16=1)"
#endif
#include "pair_linear.c"
#define LINEAR(layer, which, x, in, bias, y, rows, out, threads)                                               \
    duoserve_pair_linear(x, in, (const uint16_t *)(layer)->which, bias, y, rows, out, in, threads)
#endif

/* One decoder layer's weights and KV cache. The four linears' weights are packed in pairs
 * (kernels/cpu_pair_linear.py) or GGUF blocks of the `_type`s (ggml's type numbers; unused by
 * the pair build); their shapes are those of the plain [out, in] weight. */
typedef struct {
    const void *qkv;              /* [q_size + 2 kv_size, hidden] */
    const elem_t *qkv_bias;       /* [q_size + 2 kv_size] or NULL */
    const void *o;                /* [hidden, q_size] */
    const elem_t *post_norm;      /* [hidden] */
    const void *gate_up;          /* [2 ffn, hidden] */
    const void *down;             /* [hidden, ffn] */
    const elem_t *next_norm;      /* [hidden]: the next layer's input norm, or the final norm */
    cache_t *k_cache, *v_cache;   /* [num_blocks, BLOCK, num_kv_heads, HEAD_DIM] (int8 with KV_INT8) */
    int32_t qkv_type, o_type, gate_up_type, down_type;
    /* Block build, where a fused linear's parts have blocks of different types (a K-quant file's
     * attn_v often has more bits than attn_q and attn_k): k's and v's blocks, qkv then holding q's
     * alone; up's, gate_up then holding gate's. NULL where the fused blocks are one type. */
    const void *k_part, *v_part, *up_part;
    int32_t k_type, v_type, up_type;
    float *k_scale, *v_scale; /* KV_INT8: [num_blocks, num_kv_heads, BLOCK]; else NULL */
} duoserve_layer;

/* The shape of the model and of the step. */
typedef struct {
    int64_t rows, hidden, num_kv_heads, ffn, max_blocks;
    float eps, scale;
    const float *cos_table, *sin_table; /* [rows, HEAD_DIM / 2], rounded to the element type */
    const int64_t *slots;               /* [rows]: each row's cache slot */
    const int32_t *block_tables;        /* [rows, max_blocks] */
    const int32_t *context_lens;        /* [rows], the new token included */
    elem_t *scratch; /* rows * (q_size + 2 kv_size + 2 q_size + 3 ffn + hidden) elements */
} duoserve_step;

/*
 * x [rows, hidden]: the first layer's normed input; residual [rows, hidden]: updated in place.
 * On return x holds next_norm(residual) of the last layer run, as the per-op path leaves it.
 * `stop` (or NULL): after each layer, a non-zero value ends the call early (another thread
 * sets it when the caller has work to do between layers). Returns the number of layers run.
 */
int64_t duoserve_decode_stack(const duoserve_layer *layers, int64_t num_layers, const duoserve_step *step,
                              elem_t *x, elem_t *residual, int num_threads, const volatile int32_t *stop)
{
    const int64_t rows = step->rows, hidden = step->hidden, ffn = step->ffn;
    const int64_t kv_size = step->num_kv_heads * HEAD_DIM, q_size = kv_size * GROUP;
    const int64_t qkv_size = q_size + 2 * kv_size;
    elem_t *qkv = step->scratch;             /* [rows, qkv_size] */
    elem_t *q = qkv + rows * qkv_size;       /* [rows, q_size], contiguous for the attention */
    elem_t *attn = q + rows * q_size;        /* [rows, q_size] */
    elem_t *gate_up = attn + rows * q_size;  /* [rows, 2 ffn] */
    elem_t *act = gate_up + rows * 2 * ffn;  /* [rows, ffn] */
    elem_t *out = act + rows * ffn;          /* [rows, hidden] */
    for (int64_t l = 0; l < num_layers; l++) {
        const duoserve_layer *layer = layers + l;
#if BLOCK_LINEAR
        if (layer->k_part != NULL) {
            PART(layer->qkv, layer->qkv_type, x, hidden, layer->qkv_bias, qkv, qkv_size, 0, rows, q_size, num_threads);
            PART(layer->k_part, layer->k_type, x, hidden, layer->qkv_bias, qkv, qkv_size, q_size, rows, kv_size,
                 num_threads);
            PART(layer->v_part, layer->v_type, x, hidden, layer->qkv_bias, qkv, qkv_size, q_size + kv_size, rows,
                 kv_size, num_threads);
        } else
#endif
            LINEAR(layer, qkv, x, hidden, layer->qkv_bias, qkv, rows, qkv_size, num_threads);
        duoserve_rotary(qkv, qkv_size, q_size / HEAD_DIM, qkv + q_size, qkv_size, step->num_kv_heads,
                        step->cos_table, step->sin_table, rows, HEAD_DIM / 2, num_threads);
#if KV_INT8
        duoserve_write_kv_int8(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, layer->k_cache,
                               layer->v_cache, layer->k_scale, layer->v_scale, step->slots, rows, step->num_kv_heads,
                               HEAD_DIM, BLOCK, num_threads);
#else
        duoserve_write_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, layer->k_cache, layer->v_cache,
                          step->slots, rows, kv_size, num_threads);
#endif
        for (int64_t r = 0; r < rows; r++) memcpy(q + r * q_size, qkv + r * qkv_size, q_size * sizeof(elem_t));
        duoserve_paged_decode_attention(q, layer->k_cache, layer->v_cache, layer->k_scale, layer->v_scale,
                                        step->block_tables, step->context_lens,
                                        attn, rows, step->num_kv_heads, step->max_blocks, step->scale,
                                        num_threads);
        LINEAR(layer, o, attn, q_size, NULL, out, rows, hidden, num_threads);
        duoserve_add_rms_norm(out, residual, layer->post_norm, x, rows, hidden, step->eps, num_threads);
#if !BLOCK_LINEAR && !USE_AMX /* the dot products end gate_up in the SiLU and multiply: the same bits */
        duoserve_pair_linear_silu(x, hidden, (const uint16_t *)layer->gate_up, act, rows, ffn, hidden, num_threads);
#else
#if BLOCK_LINEAR
        if (layer->up_part != NULL) {
            PART(layer->gate_up, layer->gate_up_type, x, hidden, (const elem_t *)NULL, gate_up, 2 * ffn, 0, rows, ffn,
                 num_threads);
            PART(layer->up_part, layer->up_type, x, hidden, (const elem_t *)NULL, gate_up, 2 * ffn, ffn, rows, ffn,
                 num_threads);
        } else
#endif
            LINEAR(layer, gate_up, x, hidden, NULL, gate_up, rows, 2 * ffn, num_threads);
        duoserve_silu_and_mul(gate_up, act, rows, ffn, num_threads);
#endif
        LINEAR(layer, down, act, ffn, NULL, out, rows, hidden, num_threads);
        duoserve_add_rms_norm(out, residual, layer->next_norm, x, rows, hidden, step->eps, num_threads);
        if (stop && *stop) return l + 1;
    }
    return num_layers;
}
