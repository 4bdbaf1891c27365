/* Template (cpu_template.h; parameters SUFFIX and T, and LORA_DPBF16 for a bf16 shrink in
 * AVX-512-BF16 pair dot products): the batched LoRA update of cpu_lora.c.
 *
 * Optional parameters, for the fused decode forwards (cpu_decode.c), whose activations are
 * float32 over T weights: LORA_OUT_F32 makes out float32 and LORA_X_F32 x too (the factors
 * stay T; the AMX forward passes its products' bf16 copy of x, so its shrink keeps the
 * AVX-512-BF16 pair dot products), LORA_NAME names the instance's functions in place of
 * SUFFIX, and LORA_NO_ENTRY leaves out lora_update (its own parallel region): the forwards
 * call lora_run inside theirs. */
#if !defined(SUFFIX) || !defined(T)
#error "define SUFFIX and T before including this template (cpu_template.h)"
#endif

#include <omp.h>

#include "cpu_decode_simd.h"
#include "cpu_lora.h"
#include "cpu_template.h"

#ifdef LORA_NAME
#define LFN(name) TPL_CAT(name##_, LORA_NAME)
#else
#define LFN(name) FN(name)
#endif
/* x: XT, read with XLOAD / XLOADV; out: OT, read and written with OLOAD / OLOADV / OSTORE /
 * OSTOREV. */
#ifdef LORA_X_F32
#define XT float
#define XLOAD f32_load
#define XLOADV f32_loadv
#else
#define XT T
#define XLOAD LOAD
#define XLOADV LOADV
#endif
#ifdef LORA_OUT_F32
#define OT float
#define OLOAD f32_load
#define OLOADV f32_loadv
#define OSTORE f32_store
#define OSTOREV f32_storev
#else
#define OT T
#define OLOAD LOAD
#define OLOADV LOADV
#define OSTORE STORE
#define OSTOREV STOREV
#endif

/* t[b * width + c] = x_b . a_c for the item's nb rows and the slot's width factor rows: dot
 * products along the in features, two factor rows at a time (each x load feeds both). */
static ALWAYS_INLINE void LFN(lora_shrink)(const XT *const *xr, const T *a, int64_t k,
                                          int64_t width, float *t, const int nb) {
    int64_t c = 0;
#if defined(LORA_DPBF16) && !defined(LORA_X_F32)
    /* 32 bf16 products a lane pair per instruction, summed in float32; the last partial
     * chunk by masked loads (zeros add nothing). */
    const int64_t full = k & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    for (; c < width; c += 2) {
        const int pair = c + 1 < width;
        const T *a0 = a + c * k, *a1 = a + (c + pair) * k;
        __m512 acc0[nb], acc1[nb];
        for (int b = 0; b < nb; b++) acc0[b] = acc1[b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 32) {
            __m512i w0, w1;
            if (j < full) {
                w0 = _mm512_loadu_si512((const void *)(a0 + j));
                w1 = _mm512_loadu_si512((const void *)(a1 + j));
            } else {
                w0 = _mm512_maskz_loadu_epi16(tail, a0 + j);
                w1 = _mm512_maskz_loadu_epi16(tail, a1 + j);
            }
            for (int b = 0; b < nb; b++) {
                __m512i xv = j < full ? _mm512_loadu_si512((const void *)(xr[b] + j))
                                      : _mm512_maskz_loadu_epi16(tail, xr[b] + j);
                acc0[b] = _mm512_dpbf16_ps(acc0[b], (__m512bh)w0, (__m512bh)xv);
                acc1[b] = _mm512_dpbf16_ps(acc1[b], (__m512bh)w1, (__m512bh)xv);
            }
        }
        for (int b = 0; b < nb; b++) {
            t[b * width + c] = _mm512_reduce_add_ps(acc0[b]);
            if (pair) t[b * width + c + 1] = _mm512_reduce_add_ps(acc1[b]);
        }
    }
#else
    for (; c < width; c += 2) {
        const int pair = c + 1 < width;
        const T *a0 = a + c * k, *a1 = a + (c + pair) * k;
        vf acc0[nb], acc1[nb];
        for (int b = 0; b < nb; b++) acc0[b] = acc1[b] = (vf){0};
        int64_t j = 0;
        for (; j + VW <= k; j += VW) {
            vf w0 = LOADV(a0 + j), w1 = LOADV(a1 + j);
            for (int b = 0; b < nb; b++) {
                vf xv = XLOADV(xr[b] + j);
                acc0[b] += w0 * xv;
                acc1[b] += w1 * xv;
            }
        }
        for (int b = 0; b < nb; b++) {
            float s0 = hsum(acc0[b]), s1 = hsum(acc1[b]);
            for (int64_t jj = j; jj < k; jj++) {
                s0 += LOAD(a0[jj]) * XLOAD(xr[b][jj]);
                s1 += LOAD(a1[jj]) * XLOAD(xr[b][jj]);
            }
            t[b * width + c] = s0;
            if (pair) t[b * width + c + 1] = s1;
        }
    }
#endif
}

/* out_b[j0, j1) += sum over factor columns [c0, c1) of t[b][c] * b_t[c][j0, j1): each factor
 * vector loaded once for the nb rows, LORA_COLS_V vectors of columns per block held in
 * registers over the part's rank, the output read and rounded once. */
static ALWAYS_INLINE void LFN(lora_expand)(OT *const *orow, const float *t, int64_t width,
                                          const T *bt, int64_t n_out, int64_t c0, int64_t c1,
                                          int64_t j0, int64_t j1, const int nb) {
    int64_t j = j0;
    for (; j + LORA_COLS_V * VW <= j1; j += LORA_COLS_V * VW) {
        vf acc[nb][LORA_COLS_V];
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < LORA_COLS_V; q++) acc[b][q] = (vf){0};
        for (int64_t c = c0; c < c1; c++) {
            const T *bc = bt + c * n_out + j;
            vf w[LORA_COLS_V];
            for (int q = 0; q < LORA_COLS_V; q++) w[q] = LOADV(bc + q * VW);
            for (int b = 0; b < nb; b++) {
                const float tv = t[b * width + c];
                for (int q = 0; q < LORA_COLS_V; q++) acc[b][q] += tv * w[q];
            }
        }
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < LORA_COLS_V; q++) {
                OT *o = orow[b] + j + q * VW;
                OSTOREV(o, OLOADV(o) + acc[b][q]);
            }
    }
    for (; j + VW <= j1; j += VW) {
        vf acc[nb];
        for (int b = 0; b < nb; b++) acc[b] = (vf){0};
        for (int64_t c = c0; c < c1; c++) {
            vf w = LOADV(bt + c * n_out + j);
            for (int b = 0; b < nb; b++) acc[b] += t[b * width + c] * w;
        }
        for (int b = 0; b < nb; b++) OSTOREV(orow[b] + j, OLOADV(orow[b] + j) + acc[b]);
    }
    for (; j < j1; j++) {
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int64_t c = c0; c < c1; c++) s += t[b * width + c] * LOAD(bt[c * n_out + j]);
            orow[b][j] = OSTORE(OLOAD(orow[b][j]) + s);
        }
    }
}

/* One work item: nb rows (indices `rows`) of one slot, output columns [j0, j1). */
static ALWAYS_INLINE void LFN(lora_item)(const int64_t *shape, const XT *x, OT *out,
                                        const T *a_slot, const T *bt_slot, const int32_t *rows,
                                        const int64_t *parts, int64_t j0, int64_t j1,
                                        const int nb) {
    const int64_t k = shape[L_IN], n_out = shape[L_OUT], width = shape[L_WIDTH];
    const int64_t rank = shape[L_RANK];
    const XT *xr[LORA_ROWS];
    OT *orow[LORA_ROWS];
    for (int b = 0; b < nb; b++) {
        xr[b] = x + rows[b] * shape[L_X_STRIDE];
        orow[b] = out + rows[b] * shape[L_OUT_STRIDE];
    }
    float t[LORA_ROWS * width];
    LFN(lora_shrink)(xr, a_slot, k, width, t, nb);
    for (int64_t p = 0; p < shape[L_PARTS]; p++) {
        const int64_t lo = parts[2 * p] > j0 ? parts[2 * p] : j0;
        const int64_t end = parts[2 * p] + parts[2 * p + 1];
        const int64_t hi = end < j1 ? end : j1;
        if (lo < hi) LFN(lora_expand)(orow, t, width, bt_slot, n_out, p * rank, (p + 1) * rank, lo, hi, nb);
    }
}

/* The update of every row the plan holds (module comment, cpu_lora.c), its tasks shared over
 * the calling team: inside a parallel region (the fused forwards) or from lora_update's own.
 * An orphaned worksharing loop: its closing barrier ends the update for the whole team. */
static void LFN(lora_run)(const int64_t *shape, const XT *x, OT *out, const T *a, const T *bt,
                          const LoraPlan *plan, const int64_t *parts) {
    const int64_t width = shape[L_WIDTH], k = shape[L_IN], n_out = shape[L_OUT];
    /* Fewer items than threads: output columns split in whole vectors. */
    const int64_t vecs = (n_out + VW - 1) / VW;
    const int64_t splits = lora_splits(plan->items, lora_threads(shape), vecs);
    const int64_t tasks = plan->items * splits;
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t item = task / splits, part = task % splits;
        int64_t s, first;
        const int nb = lora_item(plan, item, LORA_ROWS, &s, &first);
        const int64_t j0 = (vecs * part / splits) * VW;
        const int64_t j1e = (vecs * (part + 1) / splits) * VW;
        const int64_t j1 = j1e < n_out ? j1e : n_out;
        const T *a_slot = a + s * width * k;
        const T *bt_slot = bt + s * width * n_out;
        const int32_t *rows_of = plan->order + first;
        /* nb a constant in each call: the item's loops unroll, its accumulators in registers. */
#define LORA_ITEM(NB) LFN(lora_item)(shape, x, out, a_slot, bt_slot, rows_of, parts, j0, j1, NB)
        switch (nb) {
            case 1: LORA_ITEM(1); break;
            case 2: LORA_ITEM(2); break;
            case 3: LORA_ITEM(3); break;
            case 4: LORA_ITEM(4); break;
            case 5: LORA_ITEM(5); break;
            case 6: LORA_ITEM(6); break;
            case 7: LORA_ITEM(7); break;
            default: LORA_ITEM(8); break;
        }
#undef LORA_ITEM
    }
}

#ifndef LORA_NO_ENTRY
/* The update of every row of `slot_of_row` >= 0 in one call (its own parallel region, a team
 * no larger than its tasks). Returns 0, or -1 when out of memory for the row order. */
int LFN(lora_update)(const int64_t *shape, const XT *x, OT *out, const T *a, const T *bt,
                     const int32_t *slot_of_row, const int64_t *parts) {
    LoraPlan plan;
    if (lora_plan_build(&plan, slot_of_row, shape[L_ROWS], shape[L_SLOTS], LORA_ROWS) != 0)
        return -1;
    const int64_t threads = lora_threads(shape);
    const int64_t vecs = (shape[L_OUT] + VW - 1) / VW;
    const int64_t tasks = plan.items * lora_splits(plan.items, threads, vecs);
    const int team = (int)(tasks < threads ? tasks : threads);
    #pragma omp parallel num_threads(team > 0 ? team : 1)
    LFN(lora_run)(shape, x, out, a, bt, &plan, parts);
    lora_plan_free(&plan);
    return 0;
}
#endif

#undef LFN
#undef XT
#undef XLOAD
#undef XLOADV
#undef OT
#undef OLOAD
#undef OLOADV
#undef OSTORE
#undef OSTOREV
#undef SUFFIX
#undef T
