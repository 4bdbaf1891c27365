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
 * shrink in AVX-512-BF16 pair dot products where the CPU has them) and f32. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode_simd.h"
#include "cpu_template.h"

/* The shape vector's fields, in kernels/cpu_lora.py's LORA_SHAPE_FIELDS order. */
enum {
    L_ROWS,       /* rows of x and out */
    L_IN,         /* in features (columns of x and a) */
    L_OUT,        /* out features (columns of out and b_t) */
    L_X_STRIDE,   /* elements between rows of x */
    L_OUT_STRIDE, /* elements between rows of out */
    L_WIDTH,      /* factor rows a slot holds (rank x parts) */
    L_RANK,       /* factor rows of one part */
    L_PARTS,      /* parts of the merged projection (pairs in `parts`) */
    L_SLOTS,      /* slots of the pool */
    L_THREADS,
    L_FIELDS
};

/* Rows of one slot a work item takes: 8 rows x 2 column vectors of accumulators in the expand
 * (16 registers), each factor vector loaded (and widened from bf16) once for the 8. */
#define LORA_ROWS 8
/* Output columns of one expand block: LORA_COLS_V vectors. */
#define LORA_COLS_V 2

#define SUFFIX bf16
#define T uint16_t
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LORA_DPBF16 1
#endif
#include "cpu_lora.inc.c"
#undef LORA_DPBF16

#define SUFFIX f32
#define T float
#include "cpu_lora.inc.c"

/* Whether the bf16 shrink uses AVX-512-BF16's pair dot products in this build. */
int lora_dpbf16(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
