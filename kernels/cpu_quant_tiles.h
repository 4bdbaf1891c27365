/* The int8-activation dot products over row tiles (QuantWeight.tile_rows = 8,
 * kernels/quant_weight.py) of qmatvec and qgate_up in cpu_quant.c: TILES 1 where built (with
 * ACT8, cpu_quant_act8.h), qmatvec_tiles and qgate_up_tiles.
 *
 * Why tiles: in the row-major layout every 32 weights of a row need their own reduction
 * (maddubs, madd, convert, scale FMA) and every row a horizontal sum, ~8 vector instructions
 * per 32 weights, more work than reading the 16 bytes costs. In a tile one 32-byte load holds
 * 4 columns of each of 8 rows, so each instruction serves 8 output rows: x is broadcast 4
 * bytes at a time, a block's 8 products (q4) add up in int16 lanes without overflow
 * (8 x 2 x 15 x 127 = 30480), the block's reduction and its 8 rows' scales (one fp16 vector
 * load) cost 5 instructions per 256 weights, and lane r of the accumulator is row r's result:
 * no horizontal sums. About 4 instructions per 32 weights in all, where the read is the bound.
 *
 * Tile t, block b (32 columns): q4 128 bytes at (t * blocks + b) * 128, chunk j (32 bytes)
 * holding bytes 4j..4j+3 of each row's ggml block (columns 4j.. low, 16 + 4j.. high nibbles);
 * q8 256 bytes, chunk j holding columns 4j..4j+3. Scales and mins [tiles, groups, 8]. */
#ifndef CPU_QUANT_TILES_H
#define CPU_QUANT_TILES_H

#include "cpu_decode_simd.h"
#include "cpu_quant.h"
#include "cpu_quant_act8.h"

#if ACT8
#define TILE 8

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TILE_DP(acc, w, x) _mm256_dpbusd_epi32((acc), (w), (x))
#elif defined(__AVXVNNI__)
#define TILE_DP(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
#endif

#ifdef TILE_DP
/* VNNI: one instruction multiplies and sums into int32 lanes. */
#define Q4_ACC(acc, w, x) ((acc) = TILE_DP((acc), (w), (x)))
#define Q4_FINISH(acc) (acc)
#define Q8_ACC(acc, w, x) ((acc) = TILE_DP((acc), (w), (x)))
#else
/* AVX2: q4 products summed in int16 for the whole block, widened once; q8 products
 * (|w| x 127 x 2 = 32258) leave no room in int16, so each is widened to int32. */
#define Q4_ACC(acc, w, x) ((acc) = _mm256_add_epi16((acc), _mm256_maddubs_epi16((w), (x))))
#define Q4_FINISH(acc) _mm256_madd_epi16((acc), _mm256_set1_epi16(1))
#define Q8_ACC(acc, w, x)                                                                      \
    ((acc) = _mm256_add_epi32(                                                                 \
         (acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1))))
#endif

/* Pins NB (<= 4) vector accumulators in registers at this point: without it GCC computes a
 * block's products ahead of their sums and spills them (6 of 8 per chunk at NB = 4). */
#define PIN_REGS(v, NB)                                                                        \
    do {                                                                                       \
        for (int pin = 0; pin < (NB); pin++) __asm__ volatile("" : "+x"((v)[pin]));           \
    } while (0)

/* 4 int8 of x, broadcast to every 32-bit lane (one load uop). */
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Tiles ahead of the one being summed that are asked for (a tile is 1-6 KB at K 576-1536;
 * the hardware prefetcher alone left loads waiting on DRAM at tile starts). */
#define TILE_PREFETCH_BYTES 2048

/* Tile tq of w against nb <= 4 rows of int8 x (nb a constant once inlined): out[b * 8 + r] =
 * row 8t + r . x[b]; sc, tm: the tile's scales and (q4) mins, [groups, 8]. */
static ALWAYS_INLINE void tile_dot(const QW *w, const uint8_t *tq, const uint16_t *sc,
                                   const void *tm, const int8_t *xq, const float *dx,
                                   const float *xs, const int nb, float *out) {
    const int64_t k = w->k, ng = groups_of(w), nblk = k / 32, gb = w->group / 32;
    const int q4 = w->bits == 4;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[4];
    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + g * TILE)));
        const int64_t end = (g + 1) * gb < nblk ? (g + 1) * gb : nblk;
        for (int64_t blk = g * gb; blk < end; blk++) {
            __m256i is[4];
            for (int b = 0; b < nb; b++) is[b] = _mm256_setzero_si256();
            if (q4) {
                const uint8_t *tb = tq + blk * 128;
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES);
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES + 64);
                for (int j = 0; j < 4; j++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(tb + 32 * j));
                    __m256i lo = _mm256_and_si256(raw, mask);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                    for (int b = 0; b < nb; b++) {
                        const int8_t *xb = xq + b * k + blk * 32 + 4 * j;
                        Q4_ACC(is[b], lo, bcast4(xb));
                        Q4_ACC(is[b], hi, bcast4(xb + 16));
                    }
                    PIN_REGS(is, nb);
                }
                for (int b = 0; b < nb; b++) is[b] = Q4_FINISH(is[b]);
            } else {
                const uint8_t *tb = tq + blk * 256;
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES);
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES + 64);
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES + 128);
                __builtin_prefetch(tb + TILE_PREFETCH_BYTES + 192);
                for (int j = 0; j < 8; j++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(tb + 32 * j));
                    /* maddubs takes unsigned x signed: |w|, and w's sign moved to x. */
                    __m256i wa = _mm256_abs_epi8(raw);
                    for (int b = 0; b < nb; b++) {
                        const int8_t *xb = xq + b * k + blk * 32 + 4 * j;
                        Q8_ACC(is[b], wa, _mm256_sign_epi8(bcast4(xb), raw));
                    }
                    PIN_REGS(is, nb);
                }
            }
            for (int b = 0; b < nb; b++) {
                __m256 d = _mm256_mul_ps(sv, _mm256_broadcast_ss(dx + b * nblk + blk));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[b]), d, acc[b]);
            }
        }
    }
    /* q4's min term: sum over groups of the 8 rows' mins times x's float32 group sum. */
    if (q4)
        for (int64_t g = 0; g < ng; g++) {
            __m256 mv = w->mins_f32
                ? _mm256_loadu_ps((const float *)tm + g * TILE)
                : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)tm + g * TILE)));
            for (int b = 0; b < nb; b++)
                acc[b] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(xs + b * ng + g), acc[b]);
        }
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(out + b * TILE, acc[b]);
}

/* Tile t of w (tile_rows 8) against nb <= 4 rows of int8 x (dx: their block scales, xs: q4's
 * float32 group sums of x): out [nb, 8]. */
static inline void qtile_act8(const QW *w, int64_t t, const int8_t *xq, const float *dx,
                              const float *xs, int64_t nb, float *out) {
    const int64_t k = w->k, ng = groups_of(w);
    const int q4 = w->bits == 4;
    const uint8_t *tq = w->q + t * TILE * (q4 ? k / 2 : k);
    const uint16_t *sc = w->scales + t * TILE * ng;
    const void *tm = q4 ? min_row(w, t * TILE) : NULL; /* [groups, 8] from row 8t on */
    switch (nb) {
    case 1: tile_dot(w, tq, sc, tm, xq, dx, xs, 1, out); break;
    case 2: tile_dot(w, tq, sc, tm, xq, dx, xs, 2, out); break;
    case 3: tile_dot(w, tq, sc, tm, xq, dx, xs, 3, out); break;
    default: tile_dot(w, tq, sc, tm, xq, dx, xs, 4, out); break;
    }
}

/* Inside qmatvec's parallel region, x already quantized: y[b, n] (+)= ... over row tiles. */
static void qmatvec_tiles(const QW *w, const int8_t *xq, const float *dx, const float *xs,
                          const float *bias, float *y, int64_t batch, int accumulate) {
    const int64_t k = w->k, n_out = w->n, ng = groups_of(w), nblk = k / 32;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < n_out / TILE; t++) {
        float d[4 * TILE];
        for (int64_t b0 = 0; b0 < batch; b0 += 4) {
            int64_t nb = batch - b0 < 4 ? batch - b0 : 4;
            qtile_act8(w, t, xq + b0 * k, dx + b0 * nblk, xs + b0 * ng, nb, d);
            for (int64_t i = 0; i < nb; i++) {
                float *dst = y + (b0 + i) * n_out + t * TILE;
                __m256 v = _mm256_loadu_ps(d + i * TILE);
                if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + t * TILE));
                if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(dst));
                _mm256_storeu_ps(dst, v);
            }
        }
    }
}
/* Inside qgate_up's parallel region, x already prepared: act[b, i] = silu(gate_i . x[b]) *
 * (up_i . x[b]) over the merged [2 * inter, k] matrix, gate tile t and up tile
 * t + inter / 8 on one thread. */
static void qgate_up_tiles(const QW *w, const int8_t *xq, const float *dx, const float *xs,
                           float *act, int64_t batch, int64_t inter) {
    const int64_t k = w->k, ng = groups_of(w), nblk = k / 32, up = inter / TILE;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < up; t++) {
        float g[4 * TILE], u[4 * TILE];
        for (int64_t b0 = 0; b0 < batch; b0 += 4) {
            int64_t nb = batch - b0 < 4 ? batch - b0 : 4;
            qtile_act8(w, t, xq + b0 * k, dx + b0 * nblk, xs + b0 * ng, nb, g);
            qtile_act8(w, t + up, xq + b0 * k, dx + b0 * nblk, xs + b0 * ng, nb, u);
            for (int64_t i = 0; i < nb; i++)
                for (int r = 0; r < TILE; r++)
                    act[(b0 + i) * inter + t * TILE + r] = silu(g[i * TILE + r]) * u[i * TILE + r];
        }
    }
}
#define TILES 1
#else
#define TILES 0
#endif

#endif
