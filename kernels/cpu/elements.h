/*
 * What the CPU kernels share: the element type (-DELEM_BF16=0|1: float32 or bfloat16 stored as
 * its upper 16 bits, see bf16.h), its conversions to and from float32, and a vectorisable exp.
 */
#ifndef DUOSERVE_ELEMENTS_H
#define DUOSERVE_ELEMENTS_H

#include <stdint.h>

#include "bf16.h"

#ifndef ELEM_BF16
#error "build with -DELEM_BF16=0|1"
#endif

#if ELEM_BF16
typedef uint16_t elem_t;
static inline float load(elem_t x) { return bf16_to_float(x); }
static inline elem_t store(float x) { return float_to_bf16(x); }
#else
typedef float elem_t;
static inline float load(elem_t x) { return x; }
static inline elem_t store(float x) { return x; }
#endif

/* x rounded to the element type, as float32 (what a torch op in that dtype leaves behind). */
static inline float round_elem(float x) { return load(store(x)); }

/* exp(x) for x <= 0 by 2^n * p(f), |f| <= 1/2; relative error about 2e-7. Written in plain
 * arithmetic so that the loops around it vectorise (libm's expf is a scalar call). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float y = x * 1.44269504088896341f;
    const float n = __builtin_floorf(y + 0.5f);
    const float f = y - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } two_n;
    two_n.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * two_n.f;
}

#endif
