/*
 * What the AMX kernels share: the tile state request and the tile configuration's layout.
 * Include once per library (it defines the exported duoserve_amx_init).
 */
#ifndef DUOSERVE_AMX_H
#define DUOSERVE_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "the AMX kernels need AMX-TILE, AMX-BF16 and AVX-512 BF16"
#endif
#include <immintrin.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask the kernel for the AMX tile state (once per process; 0 when granted). */
int duoserve_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* The operand of _tile_loadconfig: palette 1, then each tile's bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

#endif
