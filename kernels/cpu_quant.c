/* Matmuls and the decode forward over packed 4- and 8-bit weights (the layouts of
 * kernels/quant_weight.py), reading the packed bytes directly: each run of columns is
 * dequantized into registers and multiplied into float32 accumulators. No dense copy exists.
 *
 *   q4: uint8 [n, k/2]; per 32 columns 16 bytes, byte i = column i (low nibble) and column
 *       i + 16 (high nibble); fp16 scale and min (or float32 min) per `group` columns:
 *       w = q * scale + min.
 *   q8: int8 [n, k]; fp16 scale per `group` columns (the last group may be short): w = q * scale.
 *
 * For q4, sum_j (q_j s + m) x_j = s sum_j q_j x_j + m sum_j x_j: the group sums of x are taken
 * once per call (shared by all n rows), so the inner loop is one convert and one FMA per column.
 *
 * Built into its own library by kernels/cpu_quant.py with cpu_decode.c's flags (-march=native
 * under APPLIANCE_CPU_MASK), so the vector width follows the ISA: 8 floats on AVX2, 16 on
 * AVX-512. The pieces of the decode forward that do not touch the weights (norms, rotary and KV
 * store, paged attention) are cpu_decode.c's, instantiated here from the same template
 * (cpu_decode_steps.inc.c) rather than linked from cpu_decode.c: each library stays one
 * translation unit built by one compiler call, its helpers inline into its loops, and its
 * cache key is this file and what it includes (cpu_native.py). cpu_quant.h lists the exports.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_simd.h"
#include "cpu_decode_attention.h"
#include "cpu_template.h"

#define SUFFIX bf16
#define T uint16_t
#include "cpu_decode_steps.inc.c"
#define SUFFIX f32
#define T float
#include "cpu_decode_steps.inc.c"

#include "cpu_quant.h"

/* The float32-activation dot products (q4_dot, q8_dot). */
#include "cpu_quant_dot.h"

/* The int8-activation dot products (AVX2 / AVX-VNNI / AVX-512-VNNI), or ACT8 0. */
#include "cpu_quant_act8.h"
/* The int8-activation dot over row tiles (TILES 1 where built, with ACT8). */
#include "cpu_quant_tiles.h"

int quant_tiles_supported(void) { return TILES; }

/* Row n of w against nb <= 4 rows of x. */
static inline void qdot(const QW *w, int64_t n, const float *x, const float *xs, int64_t nb,
                        float *out) {
    const int64_t k = w->k, ng = groups_of(w);
    const uint16_t *srow = w->scales + n * ng;
    if (w->bits == 4) {
        const uint8_t *qrow = w->q + n * (k / 2);
        const void *mrow = min_row(w, n);
        /* The next row streams in while this one is summed (as the 16-bit matvec does). */
        for (int64_t off = 0; off < k / 2; off += 64) __builtin_prefetch(qrow + k / 2 + off);
        switch (nb) {
        case 1: q4_dot(w, qrow, srow, mrow, x, xs, 1, out); break;
        case 2: q4_dot(w, qrow, srow, mrow, x, xs, 2, out); break;
        case 3: q4_dot(w, qrow, srow, mrow, x, xs, 3, out); break;
        default: q4_dot(w, qrow, srow, mrow, x, xs, 4, out); break;
        }
    } else {
        const uint8_t *qrow = w->q + n * k;
        for (int64_t off = 0; off < k; off += 64) __builtin_prefetch(qrow + k + off);
        switch (nb) {
        case 1: q8_dot(w, qrow, srow, x, 1, out); break;
        case 2: q8_dot(w, qrow, srow, x, 2, out); break;
        case 3: q8_dot(w, qrow, srow, x, 3, out); break;
        default: q8_dot(w, qrow, srow, x, 4, out); break;
        }
    }
}

/* Whether w takes the int8-activation dot (asked for, built, and K and group in whole
 * 32-column blocks). */
static inline int use_act8(const QW *w) {
    return ACT8 && (w->act8 || w->tiles) && w->k % 32 == 0 && w->group % 32 == 0;
}

/* Floats of scratch qmatvec needs for `batch` rows of x of length k. */
static inline size_t scratch_floats(int64_t batch, int64_t k) {
    return (size_t)batch * (k / 16 + k / 32 + k / 4 + 16);
}

/* Decode steps of up to this many sequences prepare each matrix's x (norm, group sums, int8)
 * on every thread, each into its own scratch, instead of sharing the work: that work is a
 * few microseconds at batch 1, while the two barriers it needs cost more. Under
 * OMP_WAIT_POLICY=PASSIVE (the tests and the benchmarks' setting) a thread waiting at a
 * barrier sleeps in the kernel and is woken through it; on a 2-core Zen 3 VM shared with other jobs,
 * SmolLM2 Q4_1 at batch 1 spent 4-7 M cycles a step on two threads in phases that took 0.2 M
 * on one (rotary, norms, silu: their barriers). With this, rotary inside attention's items
 * and silu inside the gate/up tiles, a layer crosses 5 barriers instead of 13. */
#define OWN_PREP_MAX_BATCH 8

/* q4's group sum i of x (row i / ng). */
static inline void group_sum(const float *x, const QW *w, int64_t ng, int64_t i, float *xs) {
    const float *xg = x + (i / ng) * w->k + (i % ng) * w->group;
    float s = 0.0f;
    for (int64_t j = 0; j < w->group; j++) s += xg[j];
    xs[i] = s;
}

/* 32-column block i of x in int8 (row i / nblk), with its scale dx[i]. */
static inline void quantize_block(const float *x, int64_t k, int64_t i, float *dx, int8_t *xq) {
    const int64_t nblk = k / 32;
    const float *xb = x + (i / nblk) * k + (i % nblk) * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
    float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    dx[i] = d;
    int8_t *qb = xq + (i / nblk) * k + (i % nblk) * 32;
    for (int j = 0; j < 32; j++) qb[j] = (int8_t)lrintf(xb[j] * inv);
}

/* x prepared for w's dot products into xs (q4's group sums of x; int8 x and its block
 * scales): shared by the team (its barrier follows), or with `own_prep` all of it on the
 * calling thread, into its own xs. */
static void qprep(const float *x, const QW *w, int64_t batch, float *xs, int own_prep) {
    const int64_t k = w->k, ng = groups_of(w);
    const int act8 = use_act8(w);
    float *dx = xs + batch * ng;
    int8_t *xq = (int8_t *)(dx + batch * (k / 32) + 8);
    if (own_prep) {
        if (w->bits == 4)
            for (int64_t i = 0; i < batch * ng; i++) group_sum(x, w, ng, i, xs);
        if (act8)
            for (int64_t i = 0; i < batch * (k / 32); i++) quantize_block(x, k, i, dx, xq);
        return;
    }
    if (w->bits == 4) {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < batch * ng; i++) group_sum(x, w, ng, i, xs);
    }
    if (act8) {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < batch * (k / 32); i++) quantize_block(x, k, i, dx, xq);
    }
    #pragma omp barrier
}

/* Inside a parallel region: y[b, n] (+)= x[b, :] . w[n, :] (+ bias[n]); every thread returns
 * once all of y is written. xs: scratch of scratch_floats(batch, k) floats (q4's group sums
 * of x; int8 x and its block scales), shared by the team, or with `own_prep` this thread's
 * own: each thread then prepares all of x itself and no barrier precedes the products. */
static void qmatvec(const float *x, const QW *w, const float *bias, float *y, int64_t batch,
                    int accumulate, float *xs, int own_prep) {
    const int64_t k = w->k, n_out = w->n, ng = groups_of(w);
    const int act8 = use_act8(w);
    float *dx = xs + batch * ng;
    int8_t *xq = (int8_t *)(dx + batch * (k / 32) + 8);
    qprep(x, w, batch, xs, own_prep);
#if TILES
    if (w->tiles) {
        qmatvec_tiles(w, xq, dx, xs, bias, y, batch, accumulate);
        return;
    }
#endif
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        float d[4];
        float bn = bias ? bias[n] : 0.0f;
        for (int64_t b0 = 0; b0 < batch; b0 += 4) {
            int64_t nb = batch - b0 < 4 ? batch - b0 : 4;
#if ACT8
            if (act8)
                qdot_act8(w, n, xq + b0 * k, dx + b0 * (k / 32), xs + b0 * ng, nb, d);
            else
#endif
                qdot(w, n, x + b0 * k, xs + b0 * ng, nb, d);
            for (int64_t i = 0; i < nb; i++) {
                float *dst = y + (b0 + i) * n_out + n;
                *dst = (accumulate ? *dst : 0.0f) + d[i] + bn;
            }
        }
    }
}

/* Inside a parallel region: act[b, i] = silu(gate_i . x[b]) * (up_i . x[b]) for the merged
 * gate|up matrix w ([2 * inter, k]); every thread returns once all of act is written. Row
 * tiles take a tile of gate rows and its tile of up rows on one thread, so silu follows
 * without another barrier; other layouts go through gu ([batch, 2 * inter]) and a pass. */
static void qgate_up(const float *x, const QW *w, float *gu, float *act, int64_t batch,
                     int64_t inter, float *xs, int own_prep) {
#if TILES
    if (w->tiles && inter % TILE == 0) {
        const int64_t k = w->k, ng = groups_of(w);
        float *dx = xs + batch * ng;
        int8_t *xq = (int8_t *)(dx + batch * (k / 32) + 8);
        qprep(x, w, batch, xs, own_prep);
        qgate_up_tiles(w, xq, dx, xs, act, batch, inter);
        return;
    }
#endif
    qmatvec(x, w, NULL, gu, batch, 0, xs, own_prep);
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < batch * inter; i++) {
        int64_t b = i / inter, c = i % inter;
        const float *row = gu + b * 2 * inter;
        act[i] = silu(row[c]) * row[inter + c];
    }
}

/* y [batch, n] = x [batch, k] . w^T (+ bias), float32. Returns 0, or -1 if out of memory. */
int quant_matmul(const int64_t *qw, const float *x, const float *bias, float *y, int64_t batch,
                 int64_t threads) {
    const QW *w = (const QW *)qw;
    float *xs = malloc(scratch_floats(batch, w->k) * sizeof(float));
    if (!xs) return -1;
    #pragma omp parallel num_threads(threads)
    qmatvec(x, w, bias, y, batch, 0, xs, 0);
    free(xs);
    return 0;
}

/* Row n of a row-tiled w (quant.py's tile order) in float32: lane n % 8 of tile n / 8, whose
 * 4-byte pieces sit 32 bytes apart in each block (the wide passes dequantize every row). */
static void dequant_tiled_row(const QW *w, int64_t n, float *o) {
    const int64_t k = w->k, ng = groups_of(w), lane = n % 8, nblk = k / 32;
    const int q4 = w->bits == 4;
    const uint8_t *tq = w->q + (n / 8) * 8 * (q4 ? k / 2 : k) + lane * 4;
    const uint16_t *sc = w->scales + (n / 8) * 8 * ng + lane;
    const void *tm = q4 ? min_row(w, n - lane) : NULL;
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t g = blk * 32 / w->group;
        const float s = h2f(sc[g * 8]);
        float *ob = o + blk * 32;
        if (q4) {
            const float m = min_at(w, tm, g * 8 + lane);
            const uint8_t *tb = tq + blk * 128;
            for (int i = 0; i < 16; i++) { /* byte i of the ggml block: chunk i / 4 */
                uint8_t byte = tb[(i / 4) * 32 + i % 4];
                ob[i] = (float)(byte & 0x0F) * s + m;
                ob[i + 16] = (float)(byte >> 4) * s + m;
            }
        } else {
            const int8_t *tb = (const int8_t *)tq + blk * 256;
            for (int c = 0; c < 32; c++) ob[c] = (float)tb[(c / 4) * 32 + c % 4] * s;
        }
    }
}

/* out [nrows, k] = float32 rows `rows` of w (all n rows when rows is NULL): the embedding
 * lookup of a packed table and the transient tiles of wide (prefill) matmuls. */
void quant_dequant_rows(const int64_t *qw, const int64_t *rows, int64_t nrows, float *out,
                        int64_t threads) {
    const QW *w = (const QW *)qw;
    const int64_t k = w->k, ng = groups_of(w);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < nrows; r++) {
        int64_t n = rows ? rows[r] : r;
        float *o = out + r * k;
        if (w->tiles) {
            dequant_tiled_row(w, n, o);
            continue;
        }
        const uint16_t *srow = w->scales + n * ng;
        if (w->bits == 4) {
            const uint8_t *q = w->q + n * (k / 2);
            const void *mrow = min_row(w, n);
            for (int64_t c = 0; c < k; c += 32) {
                float s = h2f(srow[c / w->group]), m = min_at(w, mrow, c / w->group);
                for (int i = 0; i < 16; i++) {
                    o[c + i] = (float)(q[c / 2 + i] & 0x0F) * s + m;
                    o[c + 16 + i] = (float)(q[c / 2 + i] >> 4) * s + m;
                }
            }
        } else {
            const int8_t *q = (const int8_t *)w->q + n * k;
            for (int64_t j = 0; j < k; j++) o[j] = (float)q[j] * h2f(srow[j / w->group]);
        }
    }
}

#define SUFFIX bf16
#define T uint16_t
#include "cpu_quant_decode.inc.c"
#define SUFFIX f32
#define T float
#include "cpu_quant_decode.inc.c"
