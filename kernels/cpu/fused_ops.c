/*
 * The decoder layer's small ops for the CPU worker, one pass each instead of a chain of torch
 * ops (each of which costs a dispatch and a trip through memory): residual add + RMSNorm,
 * rotary embedding in place, SiLU-and-multiply, and the KV write into the paged cache.
 * Rounding follows the torch path step by step (float32 math, rounded to the element type
 * where torch's ops round), as the Triton versions in kernels/fused_ops.py do. Built by
 * kernels/cpu_fused.py with -DELEM_BF16=0|1; OpenMP shares the rows out.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "elements.h"

/* x * sigmoid(x), with exp taken only of non-positive arguments. */
static inline float silu(float x)
{
    const float e = exp_nonpositive(x < 0.0f ? x : -x); /* exp(-|x|) */
    const float sigmoid = (x < 0.0f ? e : 1.0f) / (1.0f + e); /* one division, either side */
    return x * sigmoid;
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
        for (int64_t c = 0; c < cols; c++) {
            const float h = round_elem(load(xr[c]) + load(res[c]));
            res[c] = store(h);
            squares += h * h;
        }
        const float scale = 1.0f / sqrtf(squares / (float)cols + eps);
        for (int64_t c = 0; c < cols; c++) o[c] = store(round_elem(load(res[c]) * scale) * load(weight[c]));
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
        const float scale = 1.0f / sqrtf(squares / (float)cols + eps);
        for (int64_t c = 0; c < cols; c++) o[c] = store(round_elem(load(xr[c]) * scale) * load(weight[c]));
    }
}

/* out[t] = round(round(silu(gate[t])) * up[t]) for gate_up[t] = [gate | up], each ffn wide. */
void duoserve_silu_and_mul(const elem_t *gate_up, elem_t *out, int64_t rows, int64_t ffn, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * ffn > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *gate = gate_up + r * 2 * ffn, *up = gate + ffn;
        elem_t *o = out + r * ffn;
        for (int64_t c = 0; c < ffn; c++) {
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
                for (int64_t j = 0; j < half; j++) {
                    const float a = load(x1[j]), b = load(x2[j]);
                    x1[j] = store(round_elem(a * cos_[j]) - round_elem(b * sin_[j]));
                    x2[j] = store(round_elem(b * cos_[j]) + round_elem(a * sin_[j]));
                }
            }
        }
    }
}

/* Copy each token's K and V rows (row elements, rows k_stride / v_stride apart) to their cache slot. */
void duoserve_write_kv(const elem_t *k, int64_t k_stride, const elem_t *v, int64_t v_stride, elem_t *k_cache,
                       elem_t *v_cache, const int64_t *slots, int64_t tokens, int64_t row)
{
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, (size_t)row * sizeof(elem_t));
        memcpy(v_cache + slots[t] * row, v + t * v_stride, (size_t)row * sizeof(elem_t));
    }
}
