/* Matmuls and the decode forward over packed 4- and 8-bit weights (the layouts of
 * appliance/layers/quant.py), reading the packed bytes directly: each run of columns is
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
 * This file includes cpu_decode.c for the pieces of the decode forward that do not touch the
 * weights (norms, rotary and KV store, paged attention) and is built into its own library by
 * kernels/cpu_quant.py with the same flags (-march=native under APPLIANCE_CPU_MASK), so the
 * vector width follows the ISA: 8 floats on AVX2, 16 on AVX-512.
 */
#include "cpu_decode.c"

#include <omp.h>

/* A packed weight as cpu_quant.py passes it: int64 fields, pointers as integers. */
typedef struct {
    int64_t bits;            /* 4 or 8 */
    int64_t n, k, group;
    const uint8_t *q;        /* q4: [n, k/2]; q8: int8 [n, k] */
    const uint16_t *scales;  /* fp16 [n, groups] */
    const void *mins;        /* [n, groups], q4 only: fp16, or float32 when mins_f32 */
    int64_t mins_f32;        /* AWQ/GPTQ: -zero * scale is exact in float32, not in fp16 */
    int64_t act8;            /* x quantized to int8 per 32 columns: integer dot products */
    int64_t tiles;           /* 8: the row-tile order (cpu_quant_tiles.h), int8 x always */
} QW;

typedef uint8_t vb __attribute__((vector_size(VW)));
typedef int8_t vsb __attribute__((vector_size(VW)));

/* IEEE half -> float: F16C's one instruction where the CPU has it (the per-group scalar work
 * is as large as the vector work at group 32), else by bits (normals, subnormals, inf/nan). */
#if defined(__F16C__)
#include <immintrin.h>
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Groups whose scales (and mins) one pass converts to float32 up front (the AVX2 dot kernels). */
#define GCHUNK 256

/* fp16 -> float32 of n values (scales of up to GCHUNK groups), 8 at a time. */
static inline void h2f_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = h2f(h[i]);
}
#else
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

static inline int64_t groups_of(const QW *w) { return (w->k + w->group - 1) / w->group; }

/* Min i of a row's groups (row base pointer `mrow`, typed by the flag). */
static inline float min_at(const QW *w, const void *mrow, int64_t i) {
    return w->mins_f32 ? ((const float *)mrow)[i] : h2f(((const uint16_t *)mrow)[i]);
}

static inline const void *min_row(const QW *w, int64_t n) {
    int64_t off = n * groups_of(w);
    return w->mins_f32 ? (const void *)((const float *)w->mins + off)
                       : (const void *)((const uint16_t *)w->mins + off);
}

/* The float32-activation dot products (Q4_KERNEL, Q8_KERNEL). */
#include "cpu_quant_dot.h"

/* The int8-activation dot products (AVX2 / AVX-VNNI / AVX-512-VNNI), or ACT8 0. */
#include "cpu_quant_act8.h"
/* The int8-activation dot over row tiles (TILES 1 where built, with ACT8). */
#include "cpu_quant_tiles.h"

/* Whether this build has the row-tile kernels (cpu_quant.py tiles weights only then). */
int quant_tiles_supported(void) { return TILES; }

/* Row n of w against nb <= 4 rows of x. */
static inline void qdot(const QW *w, int64_t n, const float *x, const float *xs, int64_t nb,
                        float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w);
    const uint16_t *srow = w->scales + n * ng;
    if (w->bits == 4) {
        const uint8_t *qrow = w->q + n * (k / 2);
        const void *mrow = min_row(w, n);
        /* The next row streams in while this one is summed (as the 16-bit matvec does). */
        for (int64_t off = 0; off < k / 2; off += 64) __builtin_prefetch(qrow + k / 2 + off);
        switch (nb) {
        case 1: Q4_KERNEL(1); break;
        case 2: Q4_KERNEL(2); break;
        case 3: Q4_KERNEL(3); break;
        default: Q4_KERNEL(4); break;
        }
    } else {
        const uint8_t *qrow = w->q + n * k;
        for (int64_t off = 0; off < k; off += 64) __builtin_prefetch(qrow + k + off);
        switch (nb) {
        case 1: Q8_KERNEL(1); break;
        case 2: Q8_KERNEL(2); break;
        case 3: Q8_KERNEL(3); break;
        default: Q8_KERNEL(4); break;
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
        _Pragma("omp for schedule(static) nowait")
        for (int64_t i = 0; i < batch * ng; i++) group_sum(x, w, ng, i, xs);
    }
    if (act8) {
        _Pragma("omp for schedule(static) nowait")
        for (int64_t i = 0; i < batch * (k / 32); i++) quantize_block(x, k, i, dx, xq);
    }
    _Pragma("omp barrier")
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
    _Pragma("omp for schedule(static)")
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
    _Pragma("omp for schedule(static)")
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
    _Pragma("omp parallel num_threads(threads)")
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
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
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

/* Per-layer pointers of the quantized decode (cpu_quant.py QLAYER_FIELDS): the linears are
 * QW descriptors, the qkv bias float32, norms and the KV cache in the model dtype T. */
enum { Q_LN1, Q_WQKV, Q_BQKV, Q_WO, Q_LN2, Q_WGU, Q_WDOWN, Q_KCACHE, Q_VCACHE, Q_COUNT };

#define DEFINE_QUANT_DECODE(SUFFIX, T)                                                          \
    /* rms_norm_##SUFFIX of cpu_decode.c over all rows on the calling thread (own_prep). */     \
    static void rms_norm_own_##SUFFIX(const float *x, const T *weight, float *out, int64_t batch, \
                                      int64_t hidden, float eps) {                              \
        for (int64_t b = 0; b < batch; b++) {                                                   \
            const float *xb = x + b * hidden;                                                   \
            float ss = 0.0f;                                                                    \
            for (int64_t j = 0; j < hidden; j++) ss += xb[j] * xb[j];                           \
            float r = 1.0f / sqrtf(ss / (float)hidden + eps);                                   \
            for (int64_t j = 0; j < hidden; j++) out[b * hidden + j] = SUFFIX##_load(weight[j]) * xb[j] * r; \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    /* normed = rms_norm(hidden): on this thread alone (own_prep, into its own buffer) or shared \
     * by the team (its loop's barrier). */                                                     \
    static inline void norm_for_matvec_##SUFFIX(const float *hidden, const T *weight, float *normed, \
                                                const Shape *s, float eps, int own_prep) {      \
        if (own_prep)                                                                           \
            rms_norm_own_##SUFFIX(hidden, weight, normed, s->batch, s->hidden, eps);            \
        else                                                                                    \
            rms_norm_##SUFFIX(hidden, weight, normed, s->batch, s->hidden, eps);                \
    }                                                                                           \
                                                                                                \
    /* The decode forward of cpu_decode.c's decode_forward_*, with every linear read packed.    \
     * hidden [batch, hidden] holds the embeddings on entry; logits [batch, vocab] out. */      \
    int qdecode_forward_##SUFFIX(const int64_t *shape, const int64_t *layer_ptrs,               \
                                 const T *final_norm, const int64_t *lm_head,                   \
                                 const float *cos_table, const float *sin_table,                \
                                 const int64_t *positions, const int64_t *slots,                \
                                 const int32_t *tables, const int32_t *seq_lens, float eps,     \
                                 float scale, float *hidden, float *logits) {                   \
        const Shape *s = (const Shape *)shape;                                                  \
        const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;       \
        const int64_t q_w = s->heads * s->head_dim, widest = s->inter > q_w ? s->inter : q_w;   \
        const int own_prep = s->batch <= OWN_PREP_MAX_BATCH;                                    \
        /* Per thread (one set when shared): the normed rows and the matrices' prepared x. */   \
        const size_t per_thread = (size_t)s->batch * hs + scratch_floats(s->batch, widest > hs ? widest : hs); \
        const int64_t sets = own_prep ? s->threads : 1;                                         \
        const size_t split_floats = attention_scratch_floats(s);                                \
        size_t floats = (size_t)s->batch * (qkv_w + q_w + 3 * s->inter) + sets * per_thread + split_floats; \
        float *scratch = malloc(floats * sizeof(float));                                        \
        if (!scratch) return -1;                                                                \
        float *qkv = scratch, *attn = qkv + s->batch * qkv_w, *gu = attn + s->batch * q_w;      \
        float *act = gu + s->batch * 2 * s->inter, *prep = act + s->batch * s->inter;           \
        float *split = prep + sets * per_thread;                                                \
        memset(split, 0, split_floats * sizeof(float)); /* the split's counters */              \
        _Pragma("omp parallel num_threads(s->threads)")                                         \
        {                                                                                       \
            float *normed = prep + (own_prep ? omp_get_thread_num() : 0) * per_thread;          \
            float *xs = normed + s->batch * hs;                                                 \
            for (int64_t layer = 0; layer < s->layers; layer++) {                               \
                const int64_t *p = layer_ptrs + layer * Q_COUNT;                                \
                T *k_cache = (T *)(intptr_t)p[Q_KCACHE], *v_cache = (T *)(intptr_t)p[Q_VCACHE]; \
                norm_for_matvec_##SUFFIX(hidden, (const T *)(intptr_t)p[Q_LN1], normed, s, eps, own_prep); \
                qmatvec(normed, (const QW *)(intptr_t)p[Q_WQKV], (const float *)(intptr_t)p[Q_BQKV], \
                        qkv, s->batch, 0, xs, own_prep);                                        \
                rope_attention_##SUFFIX(qkv, cos_table, sin_table, positions, slots, k_cache,   \
                                        v_cache, tables, seq_lens, s, scale, attn, split);             \
                qmatvec(attn, (const QW *)(intptr_t)p[Q_WO], NULL, hidden, s->batch, 1, xs, own_prep); \
                norm_for_matvec_##SUFFIX(hidden, (const T *)(intptr_t)p[Q_LN2], normed, s, eps, own_prep); \
                qgate_up(normed, (const QW *)(intptr_t)p[Q_WGU], gu, act, s->batch, s->inter, xs, \
                         own_prep);                                                             \
                qmatvec(act, (const QW *)(intptr_t)p[Q_WDOWN], NULL, hidden, s->batch, 1, xs, own_prep); \
            }                                                                                   \
            norm_for_matvec_##SUFFIX(hidden, final_norm, normed, s, eps, own_prep);             \
            qmatvec(normed, (const QW *)lm_head, NULL, logits, s->batch, 0, xs, own_prep);      \
        }                                                                                       \
        free(scratch);                                                                          \
        return 0;                                                                               \
    }

DEFINE_QUANT_DECODE(bf16, uint16_t)
DEFINE_QUANT_DECODE(f32, float)
