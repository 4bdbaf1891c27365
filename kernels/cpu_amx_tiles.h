/* AMX tile configuration shared by the kernels that use tiles (cpu_decode_tiles.inc.c, the bf16
 * decode forward; cpu_lora_amx.inc.c, the LoRA update): included only where the compiler
 * targets AMX. Each thread that runs tile instructions loads the configuration first; the
 * process must have asked Linux for the tile state once (amx_request_tiles, cpu_decode.c). */
#ifndef CPU_AMX_TILES_H
#define CPU_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Tile configuration, palette 1: every tile 16 rows x 64 bytes (C: 16 x 16 float32; A: 16
 * rows x 32 bf16; B: 16 K pairs x 16 columns x 2 bf16). Layout fixed by the ISA: 64 bytes. */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#endif
