/*
 * bfloat16, stored as the upper 16 bits of a float32, and its conversions: widening is exact;
 * narrowing rounds to nearest even, as torch's .to(torch.bfloat16) does, and a NaN stays a NaN.
 * Both are branch-free, so loops over them vectorise.
 */
#ifndef DUOSERVE_BF16_H
#define DUOSERVE_BF16_H

#include <stdint.h>

static inline float bf16_to_float(uint16_t x)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float x)
{
    union { uint32_t u; float f; } v;
    v.f = x;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#endif
