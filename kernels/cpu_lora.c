/* LoRA's low-rank update of one linear over a whole batch, in one call (kernels/cpu_lora.py
 * builds and calls it; appliance.cpu.lora_update wires it into each LoRA linear).
 *
 * Row i of slot s >= 0 gets out_i += (x_i A_s^T) B_s^T, where A_s is the slot's `width` rows
 * of `a` [slots * width, in] and B_s^T its `width` rows of `b_t` [slots * width, out] (the
 * adapter's scaling already folded in); rows of slot -1 (the base model) are skipped. A merged
 * projection (q|k|v, gate|up) stacks its parts' A along the width and lays their B
 * block-diagonally: part p owns factor columns [p * rank, (p + 1) * rank) and output columns
 * [offset_p, offset_p + rows_p) (`parts`), so the expand reads only its own block.
 *
 * Why native: on two cores torch spends ~100 us a linear in op calls and thread wake-ups
 * (shrink, mask, expand) for ~1.5 M multiply-adds. Here the rows are grouped by slot (at most
 * LORA_ROWS a work item, so each factor load feeds every row of the item), each item is one
 * shrink into float32 and one expand straight into the base output, and the items are shared
 * over the OpenMP team; when there are fewer items than threads, each item's output columns
 * are split between threads instead. Sums in float32; the output rounds once, at the add.
 *
 * Both dtypes from one template (cpu_template.h): bf16 (x, factors and out bfloat16; the
 * shrink in AVX-512-BF16 pair dot products where the CPU has them) and f32; and on AMX the
 * bf16 update on tiles (lora_update_tiles_bf16, cpu_lora_amx.inc.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode_simd.h"
#include "cpu_template.h"

#include "cpu_lora.h"

#define SUFFIX bf16
#define T uint16_t
#if LORA_BF16_PAIR_DOTS
#define LORA_DPBF16 1
#endif
#include "cpu_lora.inc.c"
#undef LORA_DPBF16

#define SUFFIX f32
#define T float
#include "cpu_lora.inc.c"

/* Whether the bf16 shrink uses AVX-512-BF16's pair dot products in this build. */
int lora_dpbf16(void) { return LORA_BF16_PAIR_DOTS; }

/* The bf16 update on AMX tiles from the factors' tile-packed copies (cpu_lora_amx.inc.c),
 * where the build targets AMX; lora_tiles_compiled says whether it does. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define LORA_TILES_ENTRY
#include "cpu_lora_amx.inc.c"
int lora_tiles_compiled(void) { return 1; }
#else
int lora_tiles_compiled(void) { return 0; }
int lora_update_tiles_bf16(const int64_t *shape, const uint16_t *x, uint16_t *out,
                           const uint16_t *a_tiles, const uint16_t *b_tiles,
                           const int32_t *slot_of_row, const int64_t *parts) {
    (void)shape, (void)x, (void)out, (void)a_tiles, (void)b_tiles, (void)slot_of_row;
    (void)parts;
    return -2; /* not built for AMX: the Python side never calls it then */
}
#endif
