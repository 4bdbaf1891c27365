/* The LoRA update on AMX tiles: inside the AMX decode forward (cpu_decode_tiles.inc.c calls
 * lora_run_tiles in its parallel region, float32 out) and per linear for the torch forward
 * (cpu_lora.c defines LORA_TILES_ENTRY for lora_update_tiles_bf16: its own parallel region,
 * bf16 x and out). Included only where the compiler targets AMX.
 *
 * Why: the vector update (cpu_lora.inc.c) runs at ~32 G multiply-adds/s on two cores, ~11 ms
 * of a 64-row step of SmolLM2-135M with rank-16 adapters on 51 of the rows (a fifth of the
 * base step). On tiles the multiply-adds are nearly free and the update costs about reading
 * its slots' factors once per 16 rows.
 *
 * Factors: a tile-packed copy per slot, kept up to date by appliance.cpu.lora_tiles whenever
 * the pool fills a slot: A [width, in] packed as the base weights are ([width/16][in/32] B
 * tiles: the shrink's columns are the factor rows), and each part's B block [rows_p, rank] as
 * [rows_p/16][rank/2 K pairs][16][2] (K padded to 16, not 32). A rank of 16 fills half a
 * tile's K: the expand's A tile (the shrink, in bf16) is zero past the rank, so the B tile's
 * second half, the next block's first, adds nothing (the copy ends in 512 zero bytes for the
 * last block's).
 *
 * Work items (the plan's, LORA_TILE_ROWS rows of one slot): gather the item's rows of x (bf16,
 * shape[L_X_STRIDE] apart) into 16 contiguous rows zero-padded to 32 K, shrink ([16, in] x [in, width]) into float32, round to bf16 per part,
 * expand each 16-column block ([16, rank] x [rank, 16]) and add its rows into out. Fewer
 * items than threads: each item's column blocks are split between threads (each recomputing
 * the shrink, the smaller half). Tiles: 0-1 C, 4 A, 6-7 B. */
#ifndef CPU_LORA_AMX_INC
#define CPU_LORA_AMX_INC

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx_tiles.h"
#include "cpu_decode_simd.h"
#include "cpu_lora.h"

/* Per thread: x rows [16][in_pad] bf16, shrink [16][width] f32, one C tile [16][16] f32, the
 * shrink per part [parts][16][rank_pad] bf16 (zero past the rank: never written there). */
typedef struct {
    uint16_t *x;
    float *t;
    float *c;
    uint16_t *t_bf;
} LoraTileScratch;

/* Where one thread's scratch puts each of those, sized for the widest of some shape vectors
 * (computed once per call by the caller), and its bytes (threads' scratch `bytes` apart). */
typedef struct {
    size_t t_at, c_at, t_bf_at, bytes;
} LoraTileLayout;

static inline int64_t lora_tile_round(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* The layout for the widest of `n_shapes` shape vectors (L_FIELDS apart). */
static LoraTileLayout lora_tile_layout(const int64_t *shapes, int64_t n_shapes) {
    int64_t in_pad = 0, width = 0, rank_pad = 0, parts = 0;
    for (int64_t k = 0; k < n_shapes; k++) {
        const int64_t *sh = shapes + k * L_FIELDS;
        const int64_t i = lora_tile_round(sh[L_IN], 32), r = lora_tile_round(sh[L_RANK], 32);
        in_pad = i > in_pad ? i : in_pad;
        width = sh[L_WIDTH] > width ? sh[L_WIDTH] : width;
        rank_pad = r > rank_pad ? r : rank_pad;
        parts = sh[L_PARTS] > parts ? sh[L_PARTS] : parts;
    }
    LoraTileLayout l;
    l.t_at = (size_t)lora_tile_round(16 * in_pad * 2, 64);
    l.c_at = l.t_at + (size_t)lora_tile_round(16 * width * 4, 64);
    l.t_bf_at = l.c_at + 16 * 16 * 4;
    l.bytes = (size_t)lora_tile_round((int64_t)l.t_bf_at + parts * 16 * rank_pad * 2, 64);
    return l;
}

static inline LoraTileScratch lora_tile_scratch(char *base, const LoraTileLayout *l) {
    LoraTileScratch s;
    s.x = (uint16_t *)base;
    s.t = (float *)(base + l->t_at);
    s.c = (float *)(base + l->c_at);
    s.t_bf = (uint16_t *)(base + l->t_bf_at);
    return s;
}

/* t[16][width] = x rows . A^T over k_blocks K blocks, two column blocks at a time. */
static void lora_tile_shrink(const uint16_t *x, int64_t x_stride_bytes, const uint16_t *a,
                             int64_t k_blocks, int64_t col_blocks, float *t, int64_t width) {
    for (int64_t cb = 0; cb < col_blocks; cb += 2) {
        const int two = cb + 1 < col_blocks;
        const uint16_t *a0 = a + cb * k_blocks * 512, *a1 = a0 + k_blocks * 512;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(4, (const char *)x + kb * 64, x_stride_bytes);
            _tile_loadd(6, a0 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, a1 + kb * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, t + cb * 16, width * 4);
        if (two) _tile_stored(1, t + (cb + 1) * 16, width * 4);
    }
}

/* out rows `rows` (nb of them), columns [col, col + valid) += c rows; out float32, or bf16
 * (rounded once, at the add) with `out_bf16`. */
static inline void lora_tile_add(const float *c, void *out, int out_bf16, int64_t out_stride,
                                 const int32_t *rows, int nb, int64_t col, int valid) {
    const __mmask16 m = (__mmask16)((1u << valid) - 1);
    for (int b = 0; b < nb; b++) {
        const __m512 add = _mm512_loadu_ps(c + b * 16);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + rows[b] * out_stride + col;
            const __m512 old = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, o)), 16));
            _mm256_mask_storeu_epi16(o, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(old, add)));
        } else {
            float *o = (float *)out + rows[b] * out_stride + col;
            _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), add));
        }
    }
}

/* The update of one kind of linear for every row of the plan (x: bf16 rows shape[L_X_STRIDE]
 * apart; out float32, or bf16 with `out_bf16`), over the calling team: an orphaned
 * worksharing loop, whose closing barrier ends it. `parts`: the kind's (first column,
 * columns) pairs; `scratch`: every thread's, laid out by `layout`. */
static void lora_run_tiles(const int64_t *shape, const int64_t *parts, const uint16_t *x,
                           void *out, int out_bf16, const uint16_t *a_tiles,
                           const uint16_t *b_tiles, const LoraPlan *plan, char *scratch,
                           const LoraTileLayout *layout) {
    const int64_t in = shape[L_IN], in_pad = lora_tile_round(in, 32);
    const int64_t x_stride = shape[L_X_STRIDE], width = shape[L_WIDTH], rank = shape[L_RANK];
    const int64_t n_parts = shape[L_PARTS], out_stride = shape[L_OUT_STRIDE];
    const int64_t k_blocks = in_pad / 32, rank_pad = lora_tile_round(rank, 32);
    /* Each part's column blocks, first global block and offset in a slot's B copy. */
    int64_t first[LORA_MAX_PARTS + 1], b_off[LORA_MAX_PARTS + 1];
    first[0] = b_off[0] = 0;
    for (int64_t p = 0; p < n_parts; p++) {
        const int64_t blocks = (parts[2 * p + 1] + 15) / 16;
        first[p + 1] = first[p] + blocks;
        b_off[p + 1] = b_off[p] + blocks * rank * 16;
    }
    const int64_t col_blocks = first[n_parts], a_slot = width * in_pad, b_slot = b_off[n_parts];
    const int64_t splits = lora_splits(plan->items, lora_threads(shape), col_blocks);
    const int64_t tasks = plan->items * splits;
    LoraTileScratch s =
        lora_tile_scratch(scratch + (size_t)omp_get_thread_num() * layout->bytes, layout);
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t item = task / splits, part = task % splits;
        int64_t slot, at;
        const int nb = lora_item(plan, item, LORA_TILE_ROWS, &slot, &at);
        const int32_t *rows = plan->order + at;
        for (int b = 0; b < nb; b++) {
            memcpy(s.x + b * in_pad, x + rows[b] * x_stride, (size_t)in * 2);
            memset(s.x + b * in_pad + in, 0, (size_t)(in_pad - in) * 2);
        }
        lora_tile_shrink(s.x, in_pad * 2, a_tiles + slot * a_slot, k_blocks, width / 16, s.t,
                         width);
        for (int64_t p = 0; p < n_parts; p++)
            for (int b = 0; b < nb; b++) {
                uint16_t *dst = s.t_bf + (p * 16 + b) * rank_pad;
                const float *src = s.t + b * width + p * rank;
                int64_t c = 0;
                for (; c + VW <= rank; c += VW) bf16_storev(dst + c, f32_loadv(src + c));
                for (; c < rank; c++) dst[c] = bf16_store(src[c]);
            }
        const uint16_t *b_of_slot = b_tiles + slot * b_slot;
        const int64_t g0 = col_blocks * part / splits, g1 = col_blocks * (part + 1) / splits;
        int64_t p = 0;
        for (int64_t g = g0; g < g1; g++) {
            while (g >= first[p + 1]) p++;
            const int64_t jb = g - first[p];
            _tile_zero(0);
            for (int64_t kb = 0; kb * 32 < rank; kb++) {
                _tile_loadd(4, s.t_bf + p * 16 * rank_pad + kb * 32, rank_pad * 2);
                _tile_loadd(6, b_of_slot + b_off[p] + jb * rank * 16 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, s.c, 64);
            const int64_t done = jb * 16, cols = parts[2 * p + 1] - done;
            lora_tile_add(s.c, out, out_bf16, out_stride, rows, nb, parts[2 * p] + done,
                          (int)(cols < 16 ? cols : 16));
        }
    }
}

#ifdef LORA_TILES_ENTRY
/* The update of every row of `slot_of_row` >= 0 in one call (its own parallel region, a team
 * no larger than its tasks), x and out bf16: lora_update_bf16's arguments with the factors'
 * tile-packed copies. Returns 0, or -1 when out of memory. */
int lora_update_tiles_bf16(const int64_t *shape, const uint16_t *x, uint16_t *out,
                           const uint16_t *a_tiles, const uint16_t *b_tiles,
                           const int32_t *slot_of_row, const int64_t *parts) {
    LoraPlan plan;
    if (lora_plan_build(&plan, slot_of_row, shape[L_ROWS], shape[L_SLOTS], LORA_TILE_ROWS) != 0)
        return -1;
    /* Fewer items than threads split their column blocks: every thread has work. */
    const int64_t threads = lora_threads(shape);
    const LoraTileLayout layout = lora_tile_layout(shape, 1);
    char *scratch = aligned_alloc(64, layout.bytes * (size_t)threads);
    if (!scratch) {
        lora_plan_free(&plan);
        return -1;
    }
    memset(scratch, 0, layout.bytes * (size_t)threads);
    #pragma omp parallel num_threads((int)threads)
    {
        amx_configure();
        lora_run_tiles(shape, parts, x, out, 1, a_tiles, b_tiles, &plan, scratch, &layout);
        _tile_release();
    }
    free(scratch);
    lora_plan_free(&plan);
    return 0;
}
#endif

#endif
