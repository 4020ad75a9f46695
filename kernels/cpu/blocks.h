/*
 * The GGUF weight blocks the block linear reads (block_linear.c): their layouts, their sizes, and
 * each group of 32 weights widened to float32 in vector registers. Include only where __AVX2__,
 * __FMA__ and __F16C__ are defined; it declares the codebook tables' pointers, which block_linear.c
 * defines.
 *
 * Block layouts, 32 weights each, per output row k / 32 blocks in a row (ggml's):
 *   Q8_0: fp16 d, int8 q[32]                      w[j] = d * q[j]
 *   Q4_0: fp16 d, uint8 q[16]                     w[j] = d * (nibble[j] - 8)
 *   Q4_1: fp16 d, fp16 m, uint8 q[16]             w[j] = d * nibble[j] + m
 *   Q5_0: fp16 d, uint32 h, uint8 q[16]           w[j] = d * (five[j] - 16)
 *   Q5_1: fp16 d, fp16 m, uint32 h, uint8 q[16]   w[j] = d * five[j] + m
 *   IQ4_NL: fp16 d, uint8 q[16]                   w[j] = d * NL[nibble[j]]
 *   MXFP4: uint8 e, uint8 q[16]                   w[j] = 2^(e - 128) * FP4[nibble[j]]
 *   F16:  fp16 h[32]                              w[j] = h[j]
 *   BF16: bf16 h[32]                              w[j] = h[j]
 * where nibble[j] is the low half of q[j] for j < 16 and the high half of q[j - 16] after, and
 * five[j] is nibble[j] + 16 * (bit j of h, little-endian). NL is ggml's table of 16 non-linear
 * levels, -127 to 113. FP4 is the sixteen values of a 4-bit float (E2M1) doubled, 0 to 6 and -0
 * to -6 in steps of 0.5, 1 and 2: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives; 2^(e - 128) for e
 * = 0 and 1 is the subnormal 2^-128 and 2^-127 (ggml's e8m0 half).
 *
 * NVFP4 keeps 64 weights in 36 bytes: uint8 s[4], one unsigned E4M3 scale per 16 weights, then
 * uint8 q[32], 8 for each 16: weight 16i + j is half(s[i]) * FP4[q[8i + j] & 15] for j < 8 and
 * half(s[i]) * FP4[q[8i + j - 8] >> 4] after, half(s) the E4M3 value of s halved (the bits 3-6
 * its exponent, 7 biased; s = 0 and 0x7f are 0). The kernel takes a block's two halves as groups of
 * 32, each with two scales.
 *
 * The K-quants and IQ4_XS keep 256 weights in a super-block of 8 groups of 32 (ggml's layouts):
 *   Q2_K: uint8 scales[16], uint8 qs[64], fp16 d, fp16 dmin                  (84 bytes)
 *   Q3_K: uint8 hmask[32], uint8 qs[64], uint8 scales[12], fp16 d            (110 bytes)
 *   Q4_K: fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]                 (144 bytes)
 *   Q5_K: fp16 d, fp16 dmin, uint8 scales[12], uint8 qh[32], uint8 qs[128]   (176 bytes)
 *   Q6_K: uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d               (210 bytes)
 *   IQ4_XS: fp16 d, uint16 scales_h, uint8 scales_l[4], uint8 qs[128]        (136 bytes)
 * Q4_K/Q5_K: group g's weight j is d * sc[g] * q - dmin * m[g], with sc and m 6-bit numbers packed
 * in `scales` (prepare_super), q the low (g even) or high (g odd) nibble of qs[32 * (g / 2) + j],
 * plus 16 for bit g of qh[j] in Q5_K. Q6_K: group g = 4h + t's weight j is d * scales[8h + 2t +
 * j / 16] * (q - 32), q the nibble of ql[64h + 32 * (t % 2) + j] (low for t < 2) and two more bits
 * from qh[32h + j] >> 2t. Q2_K/Q3_K: group g = 4h + t's weight j takes q from two bits of qs[32h
 * + j] >> 2t and the scale of its 16 (g * 2 + j / 16): Q2_K d * (scale & 15) * q - dmin * (scale >>
 * 4), Q3_K d * (s - 32) * (q - 4 + 4 * (bit g of hmask[j])), s a 6-bit number packed in `scales`.
 * IQ4_XS: group g's weight j is d * (s - 32) * NL[q], q the low (j < 16) or high nibble of qs[16g
 * + j % 16], s a 6-bit number from scales_l and scales_h. The kernel takes such weights group by
 * group, like the 32-weight blocks.
 *
 * The ternary types keep 256 weights of d * (q - 1), q 0, 1 or 2, in a super-block too:
 *   TQ2_0: uint8 qs[64], fp16 d                                              (66 bytes)
 *   TQ1_0: uint8 qs[48], uint8 qh[4], fp16 d                                 (54 bytes)
 * TQ2_0's group g = 4h + t takes q from two bits of qs[32h + j] >> 2t, as Q2_K does. TQ1_0 packs
 * five q in a byte (four in qh's) as the fraction b / 256 of a base-3 number: the p-th digit is
 * ((b * 3^p mod 256) * 3) >> 8. Weight 32p + j is digit p of qs[j] (p < 5), weight 160 + 16p + j
 * digit p of qs[32 + j] (p < 5, j < 16), and weight 240 + 4p + j digit p of qh[j] (p < 4, j < 4).
 *
 * The codebook types keep 256 weights in a super-block too, each group of 32 as rows of ggml's
 * codebooks (grids of 8 or 4 unsigned values) with a sign for each weight:
 *   IQ2_XXS: fp16 d, then per group uint8 row[4] and uint32 a                   (66 bytes)
 *   IQ2_XS:  fp16 d, uint16 qs[32], uint8 scales[8]                             (74 bytes)
 *   IQ2_S:   fp16 d, uint8 qs[32], uint8 signs[32], uint8 qh[8], uint8 scales[8] (82 bytes)
 *   IQ3_XXS: fp16 d, uint8 qs[64], uint32 a[8]                                  (98 bytes)
 *   IQ3_S:   fp16 d, uint8 qs[64], uint8 qh[8], uint8 signs[32], uint8 scales[4] (110 bytes)
 * Group g's eight weights 8l .. 8l + 7 are db * grid[row] with the signs of a byte of sign bits:
 * IQ2_XXS row[l] of the 256-row grid, signs KSIGNS[(a >> 7l) & 127], db = d * (0.5 + (a >> 28)) /
 * 4; IQ2_XS q = qs[4g + l], row q & 511 of 512, signs KSIGNS[q >> 9], db = d * (0.5 + scale) / 4
 * with the nibble of scales[g] of weights 16 * (l / 2) on; IQ2_S row qs[4g + l] + 256 * (two
 * bits 2l of qh[g]) of 1024, signs[4g + l], db as IQ2_XS's. IQ3's rows are 4 wide, two to 8
 * weights: IQ3_XXS rows qs[8g + 2l], qs[8g + 2l + 1] of 256, signs KSIGNS[(a[g] >> 7l) & 127], db
 * = d * (0.5 + (a[g] >> 28)) / 2; IQ3_S rows qs[i] + 256 * (bit i % 8 of qh[g]) of 512 for i =
 * 8g + 2l and the next, signs[4g + l], db = d * (1 + 2 * (nibble g of scales)). KSIGNS[i] is i
 * with an eighth bit that makes its bits' count even.
 *
 * IQ1_S and IQ1_M take their rows from one 2048-row grid of values -1, 0 and 1, and shift each
 * row by a delta of +-1/8 instead of signing it:
 *   IQ1_S: fp16 d, uint8 qs[32], uint16 qh[8]                                   (50 bytes)
 *   IQ1_M: uint8 qs[32], uint8 qh[16], uint16 scales[4]                         (56 bytes)
 * IQ1_S group g's weights 8l .. 8l + 7 are dl * (grid[qs[4g + l] + 256 * ((qh[g] >> 3l) & 7)] +
 * delta), dl = d * (1 + 2 * ((qh[g] >> 12) & 7)), delta -1/8 where bit 15 of qh[g] is set, else
 * 1/8. IQ1_M's row l of group g takes the nibble (qh[2g + l / 2] >> 4 (l % 2)): its low three bits
 * are the row's ninth to eleventh, and bit 3 makes its delta -1/8. Its dl is one per 16 weights,
 * d * (1 + 2 * three bits 3 (i % 4) of scales[i / 4]) for the 16th i, and its fp16 d is the top
 * nibbles of scales[0..3], scales[0]'s lowest. The kernel widens 8 * grid + 8 * delta (-9 to 9,
 * bytes) and multiplies by dl / 8: the same values, exactly. The tables are the gguf package's,
 * handed over once by duoserve_block_linear_use_codebooks.
 *
 * Each block is widened to float32 in registers, to the very values dequantizing it in float32
 * gives (d * q is exact: an fp16 times an integer of at most 8 bits, or d times a scale of at most 8
 * bits times q, fits float32's mantissa, and so does a codebook's db * grid value, at most 11 + 5 +
 * 6 bits, and a 4-bit float's 3 bits times its scale's 1 or 4; an additive term joins with one
 * rounding; 16-bit floats widen exactly).
 */
#ifndef DUOSERVE_BLOCKS_H
#define DUOSERVE_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>

/* ggml's type numbers, as in the GGUF file. */
enum {
    TYPE_F16 = 1,
    TYPE_Q4_0 = 2,
    TYPE_Q4_1 = 3,
    TYPE_Q5_0 = 6,
    TYPE_Q5_1 = 7,
    TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10,
    TYPE_Q3_K = 11,
    TYPE_Q4_K = 12,
    TYPE_Q5_K = 13,
    TYPE_Q6_K = 14,
    TYPE_IQ2_XXS = 16,
    TYPE_IQ2_XS = 17,
    TYPE_IQ3_XXS = 18,
    TYPE_IQ1_S = 19,
    TYPE_IQ4_NL = 20,
    TYPE_IQ3_S = 21,
    TYPE_IQ2_S = 22,
    TYPE_IQ4_XS = 23,
    TYPE_IQ1_M = 29,
    TYPE_BF16 = 30,
    TYPE_TQ1_0 = 34,
    TYPE_TQ2_0 = 35,
    TYPE_MXFP4 = 39,
    TYPE_NVFP4 = 40
};

static inline float half_to_float(const uint8_t *p)
{
    uint16_t bits;
    __builtin_memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

static inline int codebook(int type)
{
    return type == TYPE_IQ2_XXS || type == TYPE_IQ2_XS || type == TYPE_IQ2_S || type == TYPE_IQ3_XXS ||
           type == TYPE_IQ3_S || type == TYPE_IQ1_S || type == TYPE_IQ1_M;
}

static inline int super_blocks(int type)
{
    return type == TYPE_Q2_K || type == TYPE_Q3_K || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ||
           type == TYPE_IQ4_XS || type == TYPE_TQ1_0 || type == TYPE_TQ2_0 || codebook(type);
}

/* ggml's codebooks as bytes, rows of 8 (IQ2, IQ1) or 4 (IQ3), and its sign patterns: set once by
 * duoserve_block_linear_use_codebooks (block_linear.c) before any codebook type is multiplied.
 * One copy for the library, read by every part of it. */
extern __attribute__((visibility("hidden"))) const uint8_t *grid_iq2_xxs, *grid_iq2_xs, *grid_iq2_s,
    *grid_iq3_xxs, *grid_iq3_s, *grid_iq1, *ksigns;

static inline int known_type(int type)
{
    return type == TYPE_Q8_0 || type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 ||
           type == TYPE_IQ4_NL || type == TYPE_F16 || type == TYPE_BF16 || type == TYPE_MXFP4 || type == TYPE_NVFP4 ||
           (super_blocks(type) && (!codebook(type) || ksigns != NULL));
}

/* Weights in one block (256 in a super-block, 64 in NVFP4's, else 32), the block's bytes, and where
 * a 32-weight block's quants start. */
static inline int64_t weights_per_block(int type)
{
    return super_blocks(type) ? 256 : type == TYPE_NVFP4 ? 64 : 32;
}
static inline int64_t block_bytes(int type)
{
    return type == TYPE_Q8_0   ? 34
           : type == TYPE_Q4_1 ? 20
           : type == TYPE_Q4_0 ? 18
           : type == TYPE_Q5_1 ? 24
           : type == TYPE_Q5_0 ? 22
           : type == TYPE_IQ4_NL ? 18
           : type == TYPE_Q2_K ? 84
           : type == TYPE_Q3_K ? 110
           : type == TYPE_Q4_K ? 144
           : type == TYPE_Q5_K ? 176
           : type == TYPE_Q6_K ? 210
           : type == TYPE_IQ4_XS ? 136
           : type == TYPE_IQ2_XXS ? 66
           : type == TYPE_IQ2_XS ? 74
           : type == TYPE_IQ2_S ? 82
           : type == TYPE_IQ3_XXS ? 98
           : type == TYPE_IQ3_S ? 110
           : type == TYPE_IQ1_S ? 50
           : type == TYPE_IQ1_M ? 56
           : type == TYPE_TQ1_0 ? 54
           : type == TYPE_TQ2_0 ? 66
           : type == TYPE_MXFP4 ? 17
           : type == TYPE_NVFP4 ? 36
                               : 64;
}
static inline int64_t quants_at(int type)
{
    return type == TYPE_Q5_1 ? 8 : type == TYPE_Q5_0 ? 6 : type == TYPE_Q4_1 ? 4 : type == TYPE_MXFP4 ? 1 : 2;
}

/* The fifth bits of a Q5 block's 32 weights, each as 16 or 0 in byte j of the result: bit j of the
 * little-endian 32-bit `h` (byte j / 8 of it, bit j % 8). */
static inline __m256i fifth_bits(const uint8_t *h)
{
    int32_t bits;
    __builtin_memcpy(&bits, h, 4);
    const __m256i byte_of = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit_of = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), byte_of);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit_of), bit_of);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* ggml's non-linear 4-bit levels (IQ4_NL, IQ4_XS) for the nibbles in the low halves of `nibbles`'
 * bytes, as signed bytes. */
static inline __m128i nl_levels(__m128i nibbles)
{
    const __m128i levels = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return _mm_shuffle_epi8(levels, nibbles);
}

/* The 16 bytes of `low`, then the 16 of `high`, as float32, unsigned (or signed: `is_signed`), in
 * w[0..3]. */
static inline __attribute__((always_inline)) void halves_to_floats(
    __m128i low, __m128i high, const int is_signed, __m256 w[4])
{
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(parts[j]) : _mm256_cvtepu8_epi32(parts[j]));
}

/* The 32 bytes of v as float32, unsigned (or signed: `is_signed`), in w[0..3]. */
static inline __attribute__((always_inline)) void bytes_to_floats(__m256i v, const int is_signed, __m256 w[4])
{
    halves_to_floats(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1), is_signed, w);
}

/* The 32 nibbles of the 16 bytes at q (low halves first, then high) as their IQ4 levels, float32
 * in w[0..3]. */
static inline __attribute__((always_inline)) void nl_to_floats(const uint8_t *q, __m256 w[4])
{
    const __m128i packed = _mm_loadu_si128((const __m128i *)q), nibble = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    halves_to_floats(nl_levels(low), nl_levels(high), 1, w);
}

/* The FP4 values (E2M1, doubled) of the nibbles in the low halves of `nibbles`' bytes, as signed
 * bytes. */
static inline __m128i fp4_levels(__m128i nibbles)
{
    const __m128i levels = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm_shuffle_epi8(levels, nibbles);
}

/* MXFP4's scale: 2^(e - 128), its e8m0 exponent halved (subnormal for e = 0 and 1). */
static inline float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float value;
    __builtin_memcpy(&value, &bits, 4);
    return value;
}

/* NVFP4's scales: the unsigned E4M3 number s halved, for each byte s (bit 7 is not read; s = 0 and
 * 0x7f are 0), filled when the library is loaded. */
static float e4m3_halves[256];

__attribute__((constructor)) static void fill_e4m3_halves(void)
{
    for (int s = 0; s < 256; s++) {
        const uint32_t exponent = (s >> 3) & 15, mantissa = s & 7;
        uint32_t bits = (exponent + 119) << 23 | mantissa << 20; /* (1 + m / 8) * 2^(e - 8) */
        __builtin_memcpy(&e4m3_halves[s], &bits, 4);
        if (exponent == 0) e4m3_halves[s] = (float)mantissa * 0x1p-10f;
        if (s == 0 || s == 0x7f) e4m3_halves[s] = 0.0f;
    }
}

/* A super-block's factors, worked out once for its 8 groups: TQ1_0/TQ2_0 d and -d, Q4_K/Q5_K
 * d * sc and -(dmin * m) per group, IQ4_XS d * (s - 32) per group, Q6_K d * scale, Q3_K d * (s - 32)
 * and Q2_K d * (scale & 15) and -(dmin * (scale >> 4)) per 16 weights, and the codebook types' db
 * per group (IQ2_XXS, IQ3_XXS, IQ3_S; IQ1_S's dl / 8) or per 16 weights (IQ2_XS, IQ2_S; IQ1_M's
 * dl / 8). */
typedef struct {
    float times[16];
    float minus[16];
} super_scales;

/* The first `count` (8 or 16) bytes of v, unsigned (or signed: `is_signed`), as float32 times `by`
 * in out[0..count - 1]. */
static inline __attribute__((always_inline)) void scaled_bytes(
    __m128i v, const int is_signed, const int count, float by, float *out)
{
    for (int half = 0; half < count / 8; half++) {
        const __m128i part = half ? _mm_srli_si128(v, 8) : v;
        const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
        _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(_mm256_set1_ps(by), _mm256_cvtepi32_ps(ints)));
    }
}

static inline __attribute__((always_inline)) void prepare_super(const uint8_t *block, const int type, super_scales *s)
{
    if (type == TYPE_TQ1_0 || type == TYPE_TQ2_0) { /* d * q - d, one d for all */
        const float d = half_to_float(block + (type == TYPE_TQ1_0 ? 52 : 64));
        for (int i = 0; i < 16; i++) s->times[i] = d, s->minus[i] = -d;
        return;
    }
    if (type == TYPE_IQ1_M) { /* dl / 8 per 16 weights; d from the scales' top nibbles */
        uint64_t scales;
        __builtin_memcpy(&scales, block + 48, 8);
        const uint16_t bits = (uint16_t)((scales >> 12 & 0x000f) | (scales >> 24 & 0x00f0) | (scales >> 36 & 0x0f00) |
                                         (scales >> 48 & 0xf000));
        const float d = _cvtsh_ss(bits) * 0.125f;
        for (int i = 0; i < 16; i++) s->times[i] = d * (float)(1 + 2 * ((scales >> (16 * (i / 4) + 3 * (i % 4))) & 7));
        return;
    }
    if (codebook(type)) { /* db per group (IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S) or per 16 (IQ2_XS, IQ2_S) */
        const float d = half_to_float(block);
        if (type == TYPE_IQ1_S) { /* dl / 8: the scale in bits 12-14 of qh[g] */
            for (int g = 0; g < 8; g++) {
                uint16_t qh;
                __builtin_memcpy(&qh, block + 34 + 2 * g, 2);
                s->times[g] = d * 0.125f * (float)(1 + 2 * ((qh >> 12) & 7));
            }
        } else if (type == TYPE_IQ2_XS || type == TYPE_IQ2_S) {
            const uint8_t *scales = block + (type == TYPE_IQ2_XS ? 66 : 74);
            for (int i = 0; i < 16; i++) s->times[i] = d * (0.5f + (float)((scales[i / 2] >> (4 * (i % 2))) & 15)) * 0.25f;
        } else if (type == TYPE_IQ3_S) {
            for (int g = 0; g < 8; g++) s->times[g] = d * (float)(1 + 2 * ((block[106 + g / 2] >> (4 * (g % 2))) & 15));
        } else { /* the top four bits of each group's a */
            const uint8_t *a = block + (type == TYPE_IQ2_XXS ? 6 : 66);
            const int64_t stride = type == TYPE_IQ2_XXS ? 8 : 4;
            for (int g = 0; g < 8; g++) {
                uint32_t bits;
                __builtin_memcpy(&bits, a + stride * g, 4);
                s->times[g] = d * (0.5f + (float)(bits >> 28)) * (type == TYPE_IQ2_XXS ? 0.25f : 0.5f);
            }
        }
        return;
    }
    if (type == TYPE_Q2_K) { /* scale in the low nibble of scales[i], minimum in the high one */
        const __m128i scales = _mm_loadu_si128((const __m128i *)block);
        const __m128i nibble = _mm_set1_epi8(0x0f);
        scaled_bytes(_mm_and_si128(scales, nibble), 0, 16, half_to_float(block + 80), s->times);
        scaled_bytes(_mm_and_si128(_mm_srli_epi16(scales, 4), nibble), 0, 16, -half_to_float(block + 82), s->minus);
        return;
    }
    if (type == TYPE_Q3_K) {
        /* s_i - 32 for the 16 6-bit s_i: the low four bits in the low nibbles of scales[0..7] (i <
         * 8) and then their high nibbles; the top two in bits 2 * (i / 4) of scales[8 + i % 4]. */
        uint64_t low;
        uint32_t high;
        __builtin_memcpy(&low, block + 96, 8);
        __builtin_memcpy(&high, block + 104, 4);
        const uint64_t two = 0x0303030303030303ull, four = 0x0f0f0f0f0f0f0f0full;
        const uint64_t first = (low & four) | (((high & two) | ((uint64_t)(high >> 2) & two) << 32) << 4);
        const uint64_t second = ((low >> 4) & four) | ((((high >> 4) & two) | ((uint64_t)(high >> 6) & two) << 32) << 4);
        const __m128i s6 = _mm_sub_epi8(_mm_set_epi64x((int64_t)second, (int64_t)first), _mm_set1_epi8(32));
        scaled_bytes(s6, 1, 16, half_to_float(block + 108), s->times);
        return;
    }
    if (type == TYPE_IQ4_XS) {
        /* group g's s: the nibble g % 2 of scales_l[g / 2], and bits 2g, 2g + 1 of scales_h on top */
        uint16_t high;
        uint32_t low;
        __builtin_memcpy(&high, block + 2, 2);
        __builtin_memcpy(&low, block + 4, 4);
        int64_t packed = 0;
        for (int g = 0; g < 8; g++)
            packed |= (int64_t)(((low >> (4 * g)) & 15) | (((uint32_t)high >> (2 * g)) & 3) << 4) << (8 * g);
        scaled_bytes(_mm_sub_epi8(_mm_cvtsi64_si128(packed), _mm_set1_epi8(32)), 1, 8, half_to_float(block), s->times);
        return;
    }
    if (type == TYPE_Q6_K) {
        scaled_bytes(_mm_loadu_si128((const __m128i *)(block + 192)), 1, 16, half_to_float(block + 208), s->times);
        return;
    }
    /* The 12 `scales` bytes: groups 0-3's scales and mins in the low six bits of bytes 0-3 and
     * 4-7; groups 4-7's in the nibbles of bytes 8-11 (scale low), with their top two bits in the
     * top bits of bytes 0-3 (scales) and 4-7 (mins). Unpacked four groups at a time. */
    uint32_t u0, u1, u2;
    __builtin_memcpy(&u0, block + 4, 4);
    __builtin_memcpy(&u1, block + 8, 4);
    __builtin_memcpy(&u2, block + 12, 4);
    const uint32_t high_scales = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    const uint32_t high_mins = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
    const int64_t scales = (int64_t)((uint64_t)(u0 & 0x3f3f3f3fu) | (uint64_t)high_scales << 32);
    const int64_t mins = (int64_t)((uint64_t)(u1 & 0x3f3f3f3fu) | (uint64_t)high_mins << 32);
    scaled_bytes(_mm_cvtsi64_si128(scales), 0, 8, half_to_float(block), s->times);
    scaled_bytes(_mm_cvtsi64_si128(mins), 0, 8, -half_to_float(block + 2), s->minus);
}

/* Row `row` of a codebook of 8-byte rows. */
static inline int64_t row8(const uint8_t *grid, uint32_t row)
{
    int64_t values;
    __builtin_memcpy(&values, grid + 8 * row, 8);
    return values;
}

/* Row `row` of a codebook of 4-byte rows. */
static inline int32_t row4(const uint8_t *grid, uint32_t row)
{
    int32_t values;
    __builtin_memcpy(&values, grid + 4 * row, 4);
    return values;
}

/* A group's 32 codebook values (unsigned, at most 62) negated where bit j of `signs` is set, as
 * float32 in w[0..3]. The signs go on the bytes (as +1 or -1 bytes), before the conversion. */
static inline __attribute__((always_inline)) void signed_values(__m256i values, uint32_t signs, __m256 w[4])
{
    const __m256i byte_of = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit_of = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)signs), byte_of);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit_of), bit_of);
    bytes_to_floats(_mm256_sign_epi8(values, _mm256_or_si256(set, _mm256_set1_epi8(1))), 1, w);
}

/* The 8-bit sign patterns of four 7-bit indices packed in `a` (bits 7l), one byte each. */
static inline uint32_t four_ksigns(uint32_t a)
{
    return (uint32_t)ksigns[a & 127] | (uint32_t)ksigns[(a >> 7) & 127] << 8 | (uint32_t)ksigns[(a >> 14) & 127] << 16 |
           (uint32_t)ksigns[(a >> 21) & 127] << 24;
}

/* Group g of a codebook super-block as float32 in w[0..3] (see the layouts at the top). */
static inline __attribute__((always_inline)) void widen_codebook_group(
    const uint8_t *block, const int64_t g, const int type, const super_scales *s, __m256 w[4])
{
    const uint8_t *rows = block + 2 + 8 * g; /* IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S */
    __m256i values;
    uint32_t signs = 0;
    if (type == TYPE_IQ1_S) { /* 8 * grid values, shifted by one delta */
        const uint8_t *low = block + 2 + 4 * g;
        uint16_t high;
        __builtin_memcpy(&high, block + 34 + 2 * g, 2);
        values = _mm256_add_epi8(
            _mm256_setr_epi64x(row8(grid_iq1, low[0] | (high & 7) << 8), row8(grid_iq1, low[1] | (high & 56) << 5),
                               row8(grid_iq1, low[2] | (high & 448) << 2), row8(grid_iq1, low[3] | (high & 3584) >> 1)),
            _mm256_set1_epi8(high & 0x8000 ? -1 : 1));
    } else if (type == TYPE_IQ1_M) { /* each row with its own delta */
        const uint8_t *low = block + 4 * g;
        const uint32_t high = block[32 + 2 * g] | (uint32_t)block[33 + 2 * g] << 8;
        const __m256i bit = _mm256_setr_epi64x(0x8, 0x80, 0x800, 0x8000); /* row l's delta bit */
        const __m256i down = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(high), bit), bit);
        values = _mm256_add_epi8(
            _mm256_setr_epi64x(row8(grid_iq1, low[0] | (high & 7) << 8), row8(grid_iq1, low[1] | (high & 0x70) << 4),
                               row8(grid_iq1, low[2] | (high & 0x700)), row8(grid_iq1, low[3] | (high & 0x7000) >> 4)),
            _mm256_or_si256(down, _mm256_set1_epi8(1))); /* -1 bytes where the bit is set, else 1 */
    } else if (type == TYPE_IQ2_XXS) {
        uint32_t a;
        __builtin_memcpy(&a, rows + 4, 4);
        values = _mm256_setr_epi64x(row8(grid_iq2_xxs, rows[0]), row8(grid_iq2_xxs, rows[1]),
                                    row8(grid_iq2_xxs, rows[2]), row8(grid_iq2_xxs, rows[3]));
        signs = four_ksigns(a);
    } else if (type == TYPE_IQ2_XS) {
        uint16_t q[4];
        __builtin_memcpy(q, rows, 8);
        values = _mm256_setr_epi64x(row8(grid_iq2_xs, q[0] & 511), row8(grid_iq2_xs, q[1] & 511),
                                    row8(grid_iq2_xs, q[2] & 511), row8(grid_iq2_xs, q[3] & 511));
        signs = (uint32_t)ksigns[q[0] >> 9] | (uint32_t)ksigns[q[1] >> 9] << 8 | (uint32_t)ksigns[q[2] >> 9] << 16 |
                (uint32_t)ksigns[q[3] >> 9] << 24;
    } else if (type == TYPE_IQ2_S) {
        const uint8_t *low = block + 2 + 4 * g;
        const uint32_t high = block[66 + g];
        values = _mm256_setr_epi64x(row8(grid_iq2_s, low[0] | (high & 3) << 8),
                                    row8(grid_iq2_s, low[1] | (high & 12) << 6),
                                    row8(grid_iq2_s, low[2] | (high & 48) << 4),
                                    row8(grid_iq2_s, low[3] | (high & 192) << 2));
        __builtin_memcpy(&signs, block + 34 + 4 * g, 4);
    } else if (type == TYPE_IQ3_XXS) {
        uint32_t a;
        __builtin_memcpy(&a, block + 66 + 4 * g, 4);
        values = _mm256_setr_epi32(row4(grid_iq3_xxs, rows[0]), row4(grid_iq3_xxs, rows[1]), row4(grid_iq3_xxs, rows[2]),
                                   row4(grid_iq3_xxs, rows[3]), row4(grid_iq3_xxs, rows[4]), row4(grid_iq3_xxs, rows[5]),
                                   row4(grid_iq3_xxs, rows[6]), row4(grid_iq3_xxs, rows[7]));
        signs = four_ksigns(a);
    } else { /* IQ3_S: bit i of qh[g] is the ninth bit of row i */
        const uint32_t high = block[66 + g];
        values = _mm256_setr_epi32(
            row4(grid_iq3_s, rows[0] | (high & 1) << 8), row4(grid_iq3_s, rows[1] | (high & 2) << 7),
            row4(grid_iq3_s, rows[2] | (high & 4) << 6), row4(grid_iq3_s, rows[3] | (high & 8) << 5),
            row4(grid_iq3_s, rows[4] | (high & 16) << 4), row4(grid_iq3_s, rows[5] | (high & 32) << 3),
            row4(grid_iq3_s, rows[6] | (high & 64) << 2), row4(grid_iq3_s, rows[7] | (high & 128) << 1));
        __builtin_memcpy(&signs, block + 74 + 4 * g, 4);
    }
    if (type == TYPE_IQ1_S || type == TYPE_IQ1_M)
        bytes_to_floats(values, 1, w);
    else
        signed_values(values, signs, w);
    if (type == TYPE_IQ2_XS || type == TYPE_IQ2_S || type == TYPE_IQ1_M) { /* a scale for each 16 */
        const __m256 first = _mm256_broadcast_ss(s->times + 2 * g), second = _mm256_broadcast_ss(s->times + 2 * g + 1);
        w[0] = _mm256_mul_ps(w[0], first);
        w[1] = _mm256_mul_ps(w[1], first);
        w[2] = _mm256_mul_ps(w[2], second);
        w[3] = _mm256_mul_ps(w[3], second);
    } else {
        const __m256 db = _mm256_broadcast_ss(s->times + g);
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(w[j], db);
    }
}

/* Group g of a TQ1_0 super-block as float32 in w[0..3]: d * (q - 1), exact (q - 1 is -1, 0 or 1),
 * q the digits of the group's bytes (see the layout at the top), 16 at a time in 16-bit lanes:
 * m = b * 3^p mod 256, then (3m) >> 8 as the high half of m * 768. */
static inline __attribute__((always_inline)) void widen_tq1_group(
    const uint8_t *block, const int64_t g, const super_scales *s, __m256 w[4])
{
    static const int16_t powers[5] = {1, 3, 9, 27, 81};
    __m256i bytes; /* the bytes of weights 0-15 in the low lane, 16-31 in the high one */
    __m256i times[2];
    if (g < 5) { /* qs[0..31], digit g */
        bytes = _mm256_loadu_si256((const __m256i *)block);
        times[0] = times[1] = _mm256_set1_epi16(powers[g]);
    } else { /* qs[32..47], digits 2 (g - 5) and the next; group 7: digit 4, then qh's */
        const __m128i high = _mm_loadu_si128((const __m128i *)(block + 32));
        if (g < 7) {
            bytes = _mm256_broadcastsi128_si256(high);
            times[0] = _mm256_set1_epi16(powers[2 * (g - 5)]);
            times[1] = _mm256_set1_epi16(powers[2 * (g - 5) + 1]);
        } else { /* weight 240 + 4p + j is digit p of qh[j] */
            uint32_t qh;
            __builtin_memcpy(&qh, block + 48, 4);
            bytes = _mm256_setr_m128i(high, _mm_set1_epi32((int)qh));
            times[0] = _mm256_set1_epi16(81);
            times[1] = _mm256_setr_epi16(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
        }
    }
    const __m256 d = _mm256_broadcast_ss(s->times), minus = _mm256_broadcast_ss(s->minus);
    for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_cvtepu8_epi16(h ? _mm256_extracti128_si256(bytes, 1) : _mm256_castsi256_si128(bytes));
        const __m256i m = _mm256_and_si256(_mm256_mullo_epi16(b, times[h]), _mm256_set1_epi16(255));
        const __m256i q = _mm256_mulhi_epu16(m, _mm256_set1_epi16(768)); /* the digit, 0 to 2 */
        for (int j = 0; j < 2; j++) {
            const __m128i part = j ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
            w[2 * h + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(part)), d, minus);
        }
    }
}

/* Group g of a super-block as float32 in w[0..3], to the values the gguf package's float32
 * dequantization gives: TQ2_0 d * (q - 1), exact (q - 1 is -1, 0 or 1); Q4_K/Q5_K q * (d * sc) -
 * dmin * m with one rounding (d * sc and q * (d * sc) are exact: 11 + 6 + 5 bits), Q2_K likewise
 * (11 + 4 + 2 bits), Q6_K (d * scale) * (q - 32), Q3_K (d * (s - 32)) * q and IQ4_XS
 * (d * (s - 32)) * NL[q], exact (at most 11 + 8 + 6 bits).
 * g is 2 * index + part (Q4_K, Q5_K: the pair of groups sharing their quants' bytes, low nibbles
 * then high; IQ4_XS likewise), 4 * index + part (Q6_K, Q3_K, Q2_K, TQ2_0: the half of the
 * super-block, then the group in it); part is a constant, so that every shift is. */
static inline __attribute__((always_inline)) void widen_group(
    const uint8_t *block, const int64_t index, const int part, const int type, const super_scales *s, __m256 w[4])
{
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    if (type == TYPE_Q2_K || type == TYPE_Q3_K || type == TYPE_TQ2_0) { /* group 4 * index + part, */
        /* two bits at 2 * part */
        const int64_t g = 4 * index + part;
        const int64_t at = type == TYPE_Q3_K ? 32 : type == TYPE_Q2_K ? 16 : 0;
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(block + at + 32 * index));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * part), _mm256_set1_epi8(3));
        if (type == TYPE_Q3_K) { /* q - 4, but q where bit g of hmask[j] is set */
            const __m256i bit = _mm256_set1_epi8((char)(1 << g));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)block), bit), bit);
            q = _mm256_sub_epi8(q, _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
        }
        bytes_to_floats(q, type == TYPE_Q3_K, w);
        for (int j = 0; j < 4; j++) {
            const __m256 times = _mm256_broadcast_ss(s->times + 2 * g + j / 2);
            w[j] = type == TYPE_Q3_K ? _mm256_mul_ps(w[j], times)
                                     : _mm256_fmadd_ps(w[j], times, _mm256_broadcast_ss(s->minus + 2 * g + j / 2));
        }
        return;
    }
    if (type == TYPE_IQ4_XS) { /* group 2 * index + part: 16 bytes, low nibbles then high */
        const int64_t g = 2 * index + part;
        nl_to_floats(block + 8 + 16 * g, w);
        const __m256 times = _mm256_broadcast_ss(s->times + g);
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(w[j], times);
        return;
    }
    if (type == TYPE_Q6_K) {
        const int64_t h = index, g = 4 * index + part;
        const int t = part;
        __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * (t & 1)));
        low = _mm256_and_si256(t >> 1 ? _mm256_srli_epi16(low, 4) : low, nibble);
        __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h));
        high = _mm256_and_si256(_mm256_srli_epi16(high, 2 * t), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
        bytes_to_floats(q, 1, w);
        const __m256 first = _mm256_broadcast_ss(s->times + 2 * g), second = _mm256_broadcast_ss(s->times + 2 * g + 1);
        w[0] = _mm256_mul_ps(w[0], first);
        w[1] = _mm256_mul_ps(w[1], first);
        w[2] = _mm256_mul_ps(w[2], second);
        w[3] = _mm256_mul_ps(w[3], second);
        return;
    }
    const int64_t g = 2 * index + part;
    __m256i q = _mm256_loadu_si256((const __m256i *)(block + (type == TYPE_Q5_K ? 48 : 16) + 32 * index));
    q = _mm256_and_si256(part ? _mm256_srli_epi16(q, 4) : q, nibble);
    if (type == TYPE_Q5_K) { /* bit g of qh[j]: 16 on weight j */
        const __m256i bit = _mm256_set1_epi8((char)(1 << g));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    bytes_to_floats(q, 0, w);
    const __m256 times = _mm256_broadcast_ss(s->times + g), minus = _mm256_broadcast_ss(s->minus + g);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(w[j], times, minus);
}

/* v rounded to the nearest bfloat16, ties to even, as float32 (v finite). */
static inline __m256 round_bf16(__m256 v)
{
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The block's 32 weights as float32 in w[0..3]: each d * q + m (Q4_1, Q5_1), d * q - 8d (Q4_0),
 * d * q - 16d (Q5_0), d * q (Q8_0), d * NL[q] (IQ4_NL) or d * FP4[q] (MXFP4) with one rounding, as
 * dequantizing in float32 gives them (d * q is exact), or the 16-bit floats (F16, BF16) widened
 * exactly; with `bf16`, rounded on to bfloat16, as a bfloat16 copy of the dequantized weight holds
 * them. NVFP4: `block` is its 64-weight block and `half` says which 32. (Super-blocks: widen_group.) */
static inline __attribute__((always_inline)) void widen(
    const uint8_t *block, const int64_t half, const int type, const int bf16, __m256 w[4])
{
    if (type == TYPE_MXFP4 || type == TYPE_NVFP4) {
        const uint8_t *q = block + (type == TYPE_MXFP4 ? 1 : 4 + 16 * half);
        const __m128i packed = _mm_loadu_si128((const __m128i *)q), nibble = _mm_set1_epi8(0x0f);
        const __m128i low = fp4_levels(_mm_and_si128(packed, nibble));
        const __m128i high = fp4_levels(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
        __m256 scale[4];
        if (type == TYPE_MXFP4) { /* the low nibbles are weights 0-15, the high ones 16-31 */
            halves_to_floats(low, high, 1, w);
            scale[0] = scale[1] = scale[2] = scale[3] = _mm256_set1_ps(e8m0_half(block[0]));
        } else { /* 8 bytes a 16: their low nibbles, then their high ones */
            halves_to_floats(_mm_unpacklo_epi64(low, high), _mm_unpackhi_epi64(low, high), 1, w);
            scale[0] = scale[1] = _mm256_broadcast_ss(e4m3_halves + block[2 * half]);
            scale[2] = scale[3] = _mm256_broadcast_ss(e4m3_halves + block[2 * half + 1]);
        }
        for (int j = 0; j < 4; j++) {
            w[j] = _mm256_mul_ps(w[j], scale[j]);
            if (bf16) w[j] = round_bf16(w[j]);
        }
        return;
    }
    if (type == TYPE_BF16) { /* the high halves of float32s */
        for (int j = 0; j < 4; j++) {
            const __m128i halves = _mm_loadu_si128((const __m128i *)(block + 16 * j));
            w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
        }
        return;
    }
    if (type == TYPE_F16) {
        for (int j = 0; j < 4; j++) {
            w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * j)));
            if (bf16) w[j] = round_bf16(w[j]);
        }
        return;
    }
    const int with_min = type == TYPE_Q4_1 || type == TYPE_Q5_1;
    __m256 scale, add;
    if (with_min) { /* d and m side by side: one load, one conversion, each broadcast from its lane */
        const __m128 both = _mm_cvtph_ps(_mm_loadu_si32(block));
        scale = _mm256_broadcastss_ps(both);
        add = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
    } else { /* d broadcast as a half, then converted: no trip through a general register */
        uint16_t bits;
        __builtin_memcpy(&bits, block, 2);
        scale = _mm256_cvtph_ps(_mm_set1_epi16((short)bits));
        add = _mm256_mul_ps(scale, _mm256_set1_ps(type == TYPE_Q5_0 ? -16.0f : -8.0f)); /* exact */
    }
    const uint8_t *q = block + quants_at(type);
    if (type == TYPE_Q4_0 || type == TYPE_Q4_1) { /* each 8 bytes widened from memory, then split: */
        /* fewer shuffles than splitting the 16 bytes first (SmolLM2's Q4_1 at one row 1.09x, Zen 4) */
        const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        const __m256i nibble = _mm256_set1_epi32(0x0f);
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
        for (int j = 0; j < 4; j++) {
            w[j] = _mm256_fmadd_ps(w[j], scale, add);
            if (bf16) w[j] = round_bf16(w[j]);
        }
        return;
    }
    if (type == TYPE_Q8_0) {
        for (int j = 0; j < 4; j++) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * j));
            w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
            if (bf16) w[j] = round_bf16(w[j]);
        }
        return;
    }
    if (type == TYPE_IQ4_NL) {
        nl_to_floats(q, w);
        for (int j = 0; j < 4; j++) {
            w[j] = _mm256_mul_ps(w[j], scale);
            if (bf16) w[j] = round_bf16(w[j]);
        }
        return;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)q);
    const __m128i low_mask = _mm_set1_epi8(0x0f);
    __m128i low = _mm_and_si128(packed, low_mask);
    __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
    if (type == TYPE_Q5_0 || type == TYPE_Q5_1) { /* h sits just before the quants */
        const __m256i fifth = fifth_bits(q - 4);
        low = _mm_or_si128(low, _mm256_castsi256_si128(fifth));
        high = _mm_or_si128(high, _mm256_extracti128_si256(fifth, 1));
    }
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(w[j], scale, add);
    if (bf16)
        for (int j = 0; j < 4; j++) w[j] = round_bf16(w[j]);
}

/* Runs BODY with `b` the index of each 32-weight group of a row of `blocks` groups and `w` its
 * weights widened (with `bf16`, rounded to bfloat16). A super-block's scales are worked out once
 * for its 8 groups, which come in runs that share their shifts' constants (GROUP): fours in Q6_K,
 * Q3_K, Q2_K and TQ2_0, pairs in Q4_K, Q5_K and IQ4_XS; the codebook types' and TQ1_0's groups one
 * at a time. */
#define FOR_EACH_GROUP(row, blocks, type, bf16, ...)                                                 \
    do {                                                                                             \
        if (super_blocks(type)) {                                                                    \
            for (int64_t first = 0; first < (blocks); first += 8) {                                  \
                const uint8_t *block = (row) + (first >> 3) * block_bytes(type);                     \
                super_scales scales;                                                                 \
                prepare_super(block, type, &scales);                                                 \
                if (codebook(type) || type == TYPE_TQ1_0) { /* one copy of the loop: no shifts */  \
                    /* to share, and each unrolled copy of such a group would lengthen the build */  \
                    _Pragma("GCC unroll 1") for (int64_t g = 0; g < 8; g++) {                        \
                        const int64_t b = first + g;                                                 \
                        __m256 w[4];                                                                 \
                        if (type == TYPE_TQ1_0)                                                      \
                            widen_tq1_group(block, g, &scales, w);                                   \
                        else                                                                         \
                            widen_codebook_group(block, g, type, &scales, w);                        \
                        if (bf16)                                                                    \
                            for (int j = 0; j < 4; j++) w[j] = round_bf16(w[j]);                     \
                        __VA_ARGS__                                                                  \
                    }                                                                                \
                } else if (type == TYPE_Q6_K || type == TYPE_Q3_K || type == TYPE_Q2_K || type == TYPE_TQ2_0) { \
                    for (int64_t index = 0; index < 2; index++) {                                    \
                        GROUP(4, 0, __VA_ARGS__)                                                     \
                        GROUP(4, 1, __VA_ARGS__)                                                     \
                        GROUP(4, 2, __VA_ARGS__)                                                     \
                        GROUP(4, 3, __VA_ARGS__)                                                     \
                    }                                                                                \
                } else {                                                                             \
                    for (int64_t index = 0; index < 4; index++) {                                    \
                        GROUP(2, 0, __VA_ARGS__)                                                     \
                        GROUP(2, 1, __VA_ARGS__)                                                     \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        } else {                                                                                     \
            for (int64_t b = 0; b < (blocks); b++) {                                                 \
                __m256 w[4];                                                                         \
                if (type == TYPE_NVFP4) /* two groups of 32 a block */                                \
                    widen((row) + (b >> 1) * block_bytes(type), b & 1, type, bf16, w);              \
                else                                                                                 \
                    widen((row) + b * block_bytes(type), 0, type, bf16, w);                          \
                __VA_ARGS__                                                                          \
            }                                                                                        \
        }                                                                                            \
    } while (0)
/* Group `per` * index + part of the super-block at `block`, in FOR_EACH_GROUP. */
#define GROUP(per, part, ...)                                                                        \
    {                                                                                                \
        const int64_t b = first + (per) * index + (part);                                            \
        __m256 w[4];                                                                                 \
        widen_group(block, index, part, type, &scales, w);                                           \
        if (bf16)                                                                                    \
            for (int j = 0; j < 4; j++) w[j] = round_bf16(w[j]);                                     \
        __VA_ARGS__                                                                                  \
    }

#endif
