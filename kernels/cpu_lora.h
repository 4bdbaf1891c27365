/* The batched LoRA update's shared pieces (cpu_lora.inc.c): the shape vector's fields, the
 * rows' grouping by slot (LoraPlan: once per forward, shared by every linear of the step), and
 * the descriptor the fused decode forwards (cpu_decode_forward.inc.c, cpu_decode_tiles.inc.c)
 * read each layer's four LoRA linears from. Included by cpu_lora.c (its own library) and by
 * cpu_decode.c (the fused forwards call the same update inside their parallel region). */
#ifndef CPU_LORA_H
#define CPU_LORA_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Whether this build's bf16 shrink can use AVX-512-BF16's pair dot products: the instances
 * with bf16 x (cpu_lora.c's bf16 update, the AMX forward's) define LORA_DPBF16 from it. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LORA_BF16_PAIR_DOTS 1
#else
#define LORA_BF16_PAIR_DOTS 0
#endif

/* Rows of one slot a work item takes: 8 rows x 2 column vectors of accumulators in the expand
 * (16 registers), each factor vector loaded (and widened from bf16) once for the 8. */
#define LORA_ROWS 8
/* Output columns of one expand block: LORA_COLS_V vectors. */
#define LORA_COLS_V 2
/* Rows of one slot a work item of the tile update takes (cpu_lora_amx.inc.c): one A tile. */
#define LORA_TILE_ROWS 16

/* The rows of a batch grouped by slot: `order` the rows in slot order (each slot's rows in
 * their order), slot s's at [start[s], start[s + 1]); `items` work items of at most
 * `per_item` rows of one slot (LORA_ROWS, or LORA_TILE_ROWS for the tile update), item i =
 * (slot item_first[2i], first position item_first[2i + 1]). */
typedef struct {
    int64_t *start, *item_first;
    int32_t *order;
    int64_t items;
} LoraPlan;

static inline void lora_plan_free(LoraPlan *plan) {
    free(plan->start);
    free(plan->order);
    free(plan->item_first);
    memset(plan, 0, sizeof *plan);
}

/* Group `rows` rows by their slot (-1: none) over `slots` slots, at most `per_item` rows an
 * item. Returns 0, or -1 when out of memory (nothing left allocated). */
static inline int lora_plan_build(LoraPlan *plan, const int32_t *slot_of_row, int64_t rows,
                                  int64_t slots, int64_t per_item) {
    memset(plan, 0, sizeof *plan);
    plan->start = calloc((size_t)slots + 1, sizeof *plan->start);
    plan->order = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *plan->order);
    int64_t *fill = malloc((size_t)(slots > 0 ? slots : 1) * sizeof *fill);
    if (!plan->start || !plan->order || !fill) {
        free(fill);
        lora_plan_free(plan);
        return -1;
    }
    int64_t *start = plan->start;
    for (int64_t r = 0; r < rows; r++)
        if (slot_of_row[r] >= 0) start[slot_of_row[r] + 1]++;
    int64_t items = 0;
    for (int64_t s = 0; s < slots; s++) {
        items += (start[s + 1] + per_item - 1) / per_item;
        start[s + 1] += start[s];
    }
    memcpy(fill, start, (size_t)slots * sizeof *fill);
    for (int64_t r = 0; r < rows; r++)
        if (slot_of_row[r] >= 0) plan->order[fill[slot_of_row[r]]++] = (int32_t)r;
    free(fill);
    plan->item_first = malloc((size_t)(items > 0 ? items : 1) * 2 * sizeof *plan->item_first);
    if (!plan->item_first) {
        lora_plan_free(plan);
        return -1;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < slots; s++)
        for (int64_t i = start[s]; i < start[s + 1]; i += per_item) {
            plan->item_first[2 * n] = s;
            plan->item_first[2 * n + 1] = i;
            n++;
        }
    plan->items = items;
    return 0;
}

/* The team's threads from a shape vector (at least 1). */
static inline int64_t lora_threads(const int64_t *shape) {
    return shape[L_THREADS] > 0 ? shape[L_THREADS] : 1;
}

/* Ways each work item is split: with fewer items than threads, each item's `units` (vectors
 * or column blocks of its output) are split between the threads, each part recomputing the
 * item's shrink (the smaller half of the work); at most `units` ways. */
static inline int64_t lora_splits(int64_t items, int64_t threads, int64_t units) {
    int64_t splits = items < threads ? threads : 1;
    if (splits > units) splits = units > 0 ? units : 1;
    return splits;
}

/* Work item `item` of `plan`: its slot and first position in the row order (`*slot`, `*at`);
 * returns its rows (at most `per_item`). */
static inline int lora_item(const LoraPlan *plan, int64_t item, int64_t per_item, int64_t *slot,
                            int64_t *at) {
    *slot = plan->item_first[2 * item];
    *at = plan->item_first[2 * item + 1];
    const int64_t left = plan->start[*slot + 1] - *at;
    return (int)(left < per_item ? left : per_item);
}

/* The fused decode's LoRA descriptor (appliance.cpu.fused_lora builds it), int64 throughout:
 * for each kind of linear (LK_*) LORA_KIND_FIELDS values: its shape vector (L_FIELDS; rows and
 * threads are the forward's own) and its parts' (first output column, columns) pairs, padded
 * to LORA_MAX_PARTS; then for every layer and kind LORA_POINTERS addresses: its slot factors a
 * and b_t, and their tile-packed copies for the AMX forward (cpu_lora_amx.inc.c; 0 where the
 * decode keeps none). A kind's x and out rows are contiguous (its strides are its in and out features); the
 * gate|up kind's out is the pre-activation [gate | up] of every row. */
enum { LK_QKV, LK_O, LK_GATE_UP, LK_DOWN, LK_COUNT };
#define LORA_MAX_PARTS 3
#define LORA_KIND_FIELDS (L_FIELDS + 2 * LORA_MAX_PARTS)
#define LORA_HEADER (LK_COUNT * LORA_KIND_FIELDS)
#define LORA_POINTERS 4
enum { LP_A, LP_B_T, LP_A_TILES, LP_B_TILES };

/* Layer `layer`'s addresses of kind `kind` in descriptor `lora` (LP_* order). */
static inline const int64_t *lora_factors(const int64_t *lora, int64_t layer, int kind) {
    return lora + LORA_HEADER + (layer * LK_COUNT + kind) * LORA_POINTERS;
}

/* Before a fused forward over `batch` rows of slots `slot_of_row` with descriptor `lora`: each
 * kind's shape vector for this batch into `shapes` (LK_COUNT x L_FIELDS) and the rows' plan
 * (`per_item` rows an item).
 * Returns 1 when some row runs an adapter, 0 when none does or there is no descriptor (nothing
 * to free), -1 when out of memory. */
static inline int lora_fused_begin(const int64_t *lora, const int32_t *slot_of_row,
                                   int64_t batch, int64_t threads, int64_t *shapes,
                                   LoraPlan *plan, int64_t per_item) {
    if (!lora || !slot_of_row) return 0;
    for (int k = 0; k < LK_COUNT; k++) {
        memcpy(shapes + k * L_FIELDS, lora + k * LORA_KIND_FIELDS, L_FIELDS * sizeof *shapes);
        shapes[k * L_FIELDS + L_ROWS] = batch;
        shapes[k * L_FIELDS + L_THREADS] = threads;
    }
    if (lora_plan_build(plan, slot_of_row, batch, lora[L_SLOTS], per_item) != 0) return -1;
    if (plan->items == 0) {
        lora_plan_free(plan);
        return 0;
    }
    return 1;
}

/* act[b, i] = silu(gate_up[b, i]) * gate_up[b, inter + i] (float32, split across the team). */
static inline void lora_silu_mul(const float *gate_up, float *act, int64_t batch,
                                 int64_t inter) {
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate_up[b * 2 * inter + i];
            act[b * inter + i] = g / (1.0f + expf(-g)) * gate_up[b * 2 * inter + inter + i];
        }
}

#endif
