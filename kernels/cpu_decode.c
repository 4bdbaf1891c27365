/* Decode steps of a Llama-family model on the CPU, in one call.
 *
 * A decode step of a few sequences is bound by reading the weights once. In torch it is ~500
 * small operator calls whose dispatch costs as much as the reads; here the whole forward (every
 * layer, the final norm and the LM head) runs inside one OpenMP region: the matrix-vector
 * products are split across threads by output row, everything between them is small.
 *
 * Weights, norms, biases and the KV cache are in the model dtype T (bfloat16 or float32);
 * activations stay in float32. Layout matches the torch path (kernels/paged_attention.py):
 * k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim], rotate-half rotary tables
 * [max_position, head_dim], merged q|k|v and gate|up projections (rows = output features).
 *
 * Built by kernels/cpu_native.py with the box's C compiler (-march=native); also exports
 * paged_decode_attention_* for the torch path's larger decode batches.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Per-layer pointers, in this order (see cpu_native.py LAYER_FIELDS). */
enum { P_LN1, P_WQKV, P_BQKV, P_WO, P_LN2, P_WGU, P_WDOWN, P_KCACHE, P_VCACHE, P_COUNT };

/* Shapes, in this order (see cpu_native.py SHAPE_FIELDS). */
typedef struct {
    int64_t batch, layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    int64_t block_size, table_stride, threads;
} Shape;

/* Tokens of one attention chunk: scores live on the stack. */
#define CHUNK 64
/* Limits the Python side checks (cpu_native.py MAX_GROUP / MAX_HEAD_DIM). */
#define MAX_GROUP 16
/* Query heads one attention work item holds scores for (a multiple of MAX_GROUP). */
#define MAX_QUERY_HEADS 64
#define MAX_HEAD_DIM 256
/* Tokens ahead whose K/V rows are prefetched. */
#define PREFETCH 16

static inline float bf16_load(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16. */
static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* GCC/Clang vector extensions, as wide as one register of the -march the build targets
 * (kernels/cpu_native.py builds for the CPU it runs on): 16 floats with AVX-512, 8 with AVX2,
 * 4 with SSE. Wider than a register, GCC keeps arrays of them (the dot products' accumulators)
 * in memory: on a Zen 3 (AVX2) 16-float vectors ran the decode forward at 1.6 GB/s. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

static inline vf f32_loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf bf16_loadv(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Round VW floats to bfloat16 (nearest even; finite inputs), kept as floats / stored. */
static inline vf bf16_roundv(vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline void bf16_storev(uint16_t *p, vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    vh h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, vh);
    memcpy(p, &h, sizeof h);
}

static inline vf f32_roundv(vf v) { return v; }
static inline void f32_storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* e^x for VW lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]; below -87 it is 0, as the
 * softmax wants for masked or far-below-max scores). glibc's expf is scalar here. */
static inline vf exp_v(vf x) {
    vi too_small = x < -87.0f;
    vi too_big = x > 88.0f;
    x = (vf)(((vi)x & ~too_big) | ((vi)((vf){0} + 88.0f) & too_big));
    x = (vf)(((vi)x & ~too_small) | ((vi)((vf){0} - 87.0f) & too_small));
    /* n = floor(x log2(e) + 1/2) by conversion (the add-a-magic-number trick does not survive
     * -fassociative-math). */
    vf y = x * 1.44269504088896341f + 0.5f;
    vi ni = __builtin_convertvector(y, vi);
    ni += (vi)(__builtin_convertvector(ni, vf) > y); /* truncation went up: minus one */
    vf n = __builtin_convertvector(ni, vf);
    vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf scaled = (vf)((vi)p + (ni << 23));
    return (vf)((vi)scaled & ~too_small);
}

/* NB dot products of one weight row (loaded once per VW columns) with NB rows of x. */
#define DOT_ROWS(LOADV, LOAD, NB)                                                              \
    do {                                                                                       \
        vf acc[NB];                                                                          \
        for (int b = 0; b < NB; b++) acc[b] = (vf){0};                                       \
        int64_t j = 0;                                                                         \
        for (; j + VW <= k; j += VW) {                                                         \
            vf wv = LOADV(row + j);                                                          \
            for (int b = 0; b < NB; b++) acc[b] += wv * f32_loadv(x + b * k + j);              \
        }                                                                                      \
        for (int b = 0; b < NB; b++) {                                                         \
            float s = hsum(acc[b]);                                                            \
            for (int64_t jj = j; jj < k; jj++) s += LOAD(row[jj]) * x[b * k + jj];             \
            out[b] = s;                                                                        \
        }                                                                                      \
    } while (0)

/* The same for two weight rows at once (r0, r1): each x load feeds both, so a 4-row batch
 * needs 2 weight + 4 x loads per 8 FMAs instead of 1 + 4 per 4 (wide decode batches are
 * load-bound otherwise). Each dot sums in the same order as DOT_ROWS: identical results. */
#define DOT2_ROWS(LOADV, LOAD, NB)                                                             \
    do {                                                                                       \
        vf acc0[NB], acc1[NB];                                                                 \
        for (int b = 0; b < NB; b++) acc0[b] = acc1[b] = (vf){0};                              \
        int64_t j = 0;                                                                         \
        for (; j + VW <= k; j += VW) {                                                         \
            /* The next pair of rows (2k on): the weights stream at the read bandwidth (a Zen 3   \
             * batch-1 step 28.9 -> 15.7 ms; the hardware prefetcher alone stops short). */     \
            __builtin_prefetch(r0 + j + 2 * k);                                                \
            __builtin_prefetch(r1 + j + 2 * k);                                                \
            vf w0 = LOADV(r0 + j), w1 = LOADV(r1 + j);                                         \
            for (int b = 0; b < NB; b++) {                                                     \
                vf xv = f32_loadv(x + b * k + j);                                              \
                acc0[b] += w0 * xv;                                                            \
                acc1[b] += w1 * xv;                                                            \
            }                                                                                  \
        }                                                                                      \
        for (int b = 0; b < NB; b++) {                                                         \
            float s0 = hsum(acc0[b]), s1 = hsum(acc1[b]);                                      \
            for (int64_t jj = j; jj < k; jj++) {                                               \
                s0 += LOAD(r0[jj]) * x[b * k + jj];                                            \
                s1 += LOAD(r1[jj]) * x[b * k + jj];                                            \
            }                                                                                  \
            out0[b] = s0;                                                                      \
            out1[b] = s1;                                                                      \
        }                                                                                      \
    } while (0)

/* attend_heads' scores of G query heads (compile-time, so their accumulators stay in
 * registers) against the chunk's K rows of their KV head: sc[h][t] = q_h . k_t * scale. */
#define QK_GROUP(LOADV, G)                                                                     \
        for (int64_t t = 0; t < n; t++) {                                                      \
            const __typeof__(*kh) *kr = kh + slot_of[t] * row;                                 \
            vf acc[G];                                                                         \
            for (int h = 0; h < G; h++) acc[h] = (vf){0};                                      \
            for (int64_t j = 0; j < d; j += VW) {                                              \
                vf kv = LOADV(kr + j);                                                         \
                for (int h = 0; h < G; h++) acc[h] += f32_loadv(qg + h * d + j) * kv;          \
            }                                                                                  \
            for (int h = 0; h < G; h++) sc[h][t] = hsum(acc[h]) * scale;                       \
        }

/* out_h += sum_t p[h][t] v_t for G query heads, VW columns at a time over the chunk's V
 * rows: one V load serves the G heads, the sums stay in registers. */
#define PV_GROUP(LOADV, G)                                                                     \
        for (int64_t j = 0; j < d; j += VW) {                                                  \
            vf acc[G];                                                                         \
            for (int h = 0; h < G; h++) acc[h] = f32_loadv(og + h * d + j);                    \
            for (int64_t t = 0; t < n; t++) {                                                  \
                vf vv = LOADV(vh + slot_of[t] * row + j);                                      \
                for (int h = 0; h < G; h++) acc[h] += sc[h][t] * vv;                           \
            }                                                                                  \
            for (int h = 0; h < G; h++) memcpy(og + h * d + j, &acc[h], sizeof acc[h]);        \
        }

#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE, LOADV)                                                   \
                                                                                                 \
    /* out[b] = row . x[b, :] for nb <= 4 rows of x: one weight load feeds nb independent   \
     * accumulator chains. */                                                                   \
    static inline void dot_##SUFFIX(const T *row, const float *x, int64_t k, int64_t nb,       \
                                    float *out) {                                              \
        switch (nb) {                                                                          \
        case 1: DOT_ROWS(LOADV, LOAD, 1); break;                                               \
        case 2: DOT_ROWS(LOADV, LOAD, 2); break;                                               \
        case 3: DOT_ROWS(LOADV, LOAD, 3); break;                                               \
        default: DOT_ROWS(LOADV, LOAD, 4); break;                                              \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static inline void dot2_##SUFFIX(const T *r0, const T *r1, const float *x, int64_t k,      \
                                     int64_t nb, float *out0, float *out1) {                   \
        switch (nb) {                                                                          \
        case 1: DOT2_ROWS(LOADV, LOAD, 1); break;                                              \
        case 2: DOT2_ROWS(LOADV, LOAD, 2); break;                                              \
        case 3: DOT2_ROWS(LOADV, LOAD, 3); break;                                              \
        default: DOT2_ROWS(LOADV, LOAD, 4); break;                                             \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* y[b, n] (+)= x[b, :] . w[n, :] (+ bias[n]) for the rows n of this thread, two rows at  \
     * a time (the last one alone when n_out is odd). */                                      \
    static void matvec_##SUFFIX(const float *x, const T *w, const T *bias, float *y,           \
                                int64_t batch, int64_t n_out, int64_t k, int accumulate) {     \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t pair = 0; pair < (n_out + 1) / 2; pair++) {                               \
            int64_t n = 2 * pair;                                                              \
            int two = n + 1 < n_out;                                                           \
            const T *r0 = w + n * k, *r1 = two ? r0 + k : r0;                                  \
            float bias0 = bias ? LOAD(bias[n]) : 0.0f;                                         \
            float bias1 = bias && two ? LOAD(bias[n + 1]) : 0.0f, d0[4], d1[4];                \
            for (int64_t b0i = 0; b0i < batch; b0i += 4) {                                     \
                int64_t nb = batch - b0i < 4 ? batch - b0i : 4;                                \
                if (two)                                                                       \
                    dot2_##SUFFIX(r0, r1, x + b0i * k, k, nb, d0, d1);                         \
                else                                                                           \
                    dot_##SUFFIX(r0, x + b0i * k, k, nb, d0);                                  \
                for (int64_t i = 0; i < nb; i++) {                                             \
                    float *dst = y + (b0i + i) * n_out + n;                                    \
                    dst[0] = (accumulate ? dst[0] : 0.0f) + d0[i] + bias0;                     \
                    if (two) dst[1] = (accumulate ? dst[1] : 0.0f) + d1[i] + bias1;            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* act[b, i] = silu(gate_i . x) * (up_i . x): both rows of output i on one thread. */     \
    static void gate_up_##SUFFIX(const float *x, const T *w, float *act, int64_t batch,        \
                                 int64_t inter, int64_t k) {                                   \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t i = 0; i < inter; i++) {                                                  \
            const T *g = w + i * k, *u = w + (inter + i) * k;                                  \
            float gd[4], ud[4];                                                                \
            for (int64_t b0i = 0; b0i < batch; b0i += 4) {                                     \
                int64_t nb = batch - b0i < 4 ? batch - b0i : 4;                                \
                dot2_##SUFFIX(g, u, x + b0i * k, k, nb, gd, ud);                               \
                for (int64_t j = 0; j < nb; j++) act[(b0i + j) * inter + i] = silu(gd[j]) * ud[j]; \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static void rms_norm_##SUFFIX(const float *x, const T *weight, float *out, int64_t batch,    \
                                  int64_t hidden, float eps) {                                   \
        _Pragma("omp for schedule(static)")                                                      \
        for (int64_t b = 0; b < batch; b++) {                                                    \
            const float *xb = x + b * hidden;                                                    \
            float ss = 0.0f;                                                                     \
            for (int64_t j = 0; j < hidden; j++) ss += xb[j] * xb[j];                            \
            float r = 1.0f / sqrtf(ss / (float)hidden + eps);                                    \
            for (int64_t j = 0; j < hidden; j++) out[b * hidden + j] = LOAD(weight[j]) * xb[j] * r; \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Query heads [nkv * group, head_dim] of KV heads g0 .. g0+nkv-1 over one sequence's        \
     * context in the paged cache: each K/V row is read once for all of them; online softmax a   \
     * chunk at a time, float32 throughout; rows some tokens ahead are prefetched (the blocks    \
     * are scattered, so the hardware prefetcher cannot follow). A chunk's slots are looked up   \
     * once (a division per token cost as much as its dot products); for up to 4 query heads a   \
     * KV head (SmolLM2 3, Llama-2 1) the products run in registers (ATTEND_GROUP), where the    \
     * generic loop kept updating `out` in memory for every token. Same sums in the same order   \
     * either way. */                                                                            \
    static void attend_heads_##SUFFIX(const float *q, const T *k_cache, const T *v_cache,        \
                                      const int32_t *table, int64_t seq_len, int64_t g0,         \
                                      int64_t nkv, int64_t group, const Shape *s, float scale,   \
                                      float *out) {                                              \
        const int64_t d = s->head_dim, row = s->kv_heads * d, bs = s->block_size;                \
        const int64_t nq = nkv * group, span = nkv * d * (int64_t)sizeof(T);                     \
        const int vec = d % VW == 0;                                                             \
        float m[MAX_QUERY_HEADS], l[MAX_QUERY_HEADS];                                            \
        float scores[MAX_QUERY_HEADS][CHUNK];                                                    \
        int64_t slot_of[CHUNK + PREFETCH];                                                       \
        for (int64_t h = 0; h < nq; h++) {                                                       \
            m[h] = -FLT_MAX;                                                                     \
            l[h] = 0.0f;                                                                         \
        }                                                                                        \
        for (int64_t j = 0; j < nq * d; j++) out[j] = 0.0f;                                      \
        for (int64_t t0 = 0; t0 < seq_len; t0 += CHUNK) {                                        \
            int64_t n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
            int64_t ahead = seq_len - t0 < CHUNK + PREFETCH ? seq_len - t0 : CHUNK + PREFETCH;   \
            for (int64_t t = 0, blk = t0 / bs, off = t0 % bs; t < ahead; t++) {                  \
                slot_of[t] = (int64_t)table[blk] * bs + off;                                     \
                if (++off == bs) {                                                               \
                    off = 0;                                                                     \
                    blk++;                                                                       \
                }                                                                                \
            }                                                                                    \
            /* Lanes past n of the last vector: exp_v reads them (results unused); zeros, not    \
             * stack garbage. */                                                                 \
            for (int64_t h = 0; h < nq; h++)                                                     \
                for (int64_t t = n; t < CHUNK && t % VW; t++) scores[h][t] = 0.0f;               \
            for (int64_t t = 0; t < n; t++) {                                                    \
                if (t + PREFETCH < ahead) {                                                      \
                    const char *kp = (const char *)(k_cache + slot_of[t + PREFETCH] * row + g0 * d); \
                    const char *vp = (const char *)(v_cache + slot_of[t + PREFETCH] * row + g0 * d); \
                    for (int64_t off = 0; off < span; off += 64) {                               \
                        __builtin_prefetch(kp + off);                                            \
                        __builtin_prefetch(vp + off);                                            \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int64_t gi = 0; gi < nkv; gi++) {                                               \
                const T *kh = k_cache + (g0 + gi) * d;                                           \
                const float *qg = q + gi * group * d;                                            \
                float(*sc)[CHUNK] = scores + gi * group;                                         \
                if (vec && group <= 4) {                                                         \
                    switch (group) {                                                             \
                    case 1: QK_GROUP(LOADV, 1); break;                                           \
                    case 2: QK_GROUP(LOADV, 2); break;                                           \
                    case 3: QK_GROUP(LOADV, 3); break;                                           \
                    default: QK_GROUP(LOADV, 4); break;                                          \
                    }                                                                            \
                    continue;                                                                    \
                }                                                                                \
                for (int64_t t = 0; t < n; t++) {                                                \
                    const T *kr = kh + slot_of[t] * row;                                         \
                    for (int64_t h = 0; h < group; h++) {                                        \
                        const float *qh = qg + h * d;                                            \
                        float dot = 0.0f;                                                        \
                        if (vec) {                                                               \
                            vf acc = (vf){0};                                                    \
                            for (int64_t j = 0; j < d; j += VW) acc += f32_loadv(qh + j) * LOADV(kr + j); \
                            dot = hsum(acc);                                                     \
                        } else {                                                                 \
                            for (int64_t j = 0; j < d; j++) dot += qh[j] * LOAD(kr[j]);          \
                        }                                                                        \
                        sc[h][t] = dot * scale;                                                  \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int64_t h = 0; h < nq; h++) {                                                   \
                float cm = m[h];                                                                 \
                for (int64_t t = 0; t < n; t++) cm = scores[h][t] > cm ? scores[h][t] : cm;      \
                float correction = expf(m[h] - cm);                                              \
                l[h] *= correction;                                                              \
                for (int64_t j = 0; j < d; j++) out[h * d + j] *= correction;                    \
                /* Whole vectors: lanes past n are computed and never used. */                   \
                for (int64_t t = 0; t < n; t += VW) {                                            \
                    vf e = exp_v(f32_loadv(&scores[h][t]) - cm);                                 \
                    memcpy(&scores[h][t], &e, sizeof e);                                         \
                }                                                                                \
                for (int64_t t = 0; t < n; t++) l[h] += scores[h][t];                            \
                m[h] = cm;                                                                       \
            }                                                                                    \
            for (int64_t gi = 0; gi < nkv; gi++) {                                               \
                const T *vh = v_cache + (g0 + gi) * d;                                           \
                float *og = out + gi * group * d;                                                \
                float(*sc)[CHUNK] = scores + gi * group;                                         \
                if (vec && group <= 4) {                                                         \
                    switch (group) {                                                             \
                    case 1: PV_GROUP(LOADV, 1); break;                                           \
                    case 2: PV_GROUP(LOADV, 2); break;                                           \
                    case 3: PV_GROUP(LOADV, 3); break;                                           \
                    default: PV_GROUP(LOADV, 4); break;                                          \
                    }                                                                            \
                    continue;                                                                    \
                }                                                                                \
                for (int64_t t = 0; t < n; t++) {                                                \
                    const T *vr = vh + slot_of[t] * row;                                         \
                    for (int64_t h = 0; h < group; h++) {                                        \
                        float p = sc[h][t];                                                      \
                        float *o = og + h * d;                                                   \
                        if (vec) {                                                               \
                            for (int64_t j = 0; j < d; j += VW) {                                \
                                vf acc = f32_loadv(o + j) + p * LOADV(vr + j);                   \
                                memcpy(o + j, &acc, sizeof acc);                                 \
                            }                                                                    \
                        } else {                                                                 \
                            for (int64_t j = 0; j < d; j++) o[j] += p * LOAD(vr[j]);             \
                        }                                                                        \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int64_t h = 0; h < nq; h++) {                                                       \
            float inv = 1.0f / l[h];                                                             \
            for (int64_t j = 0; j < d; j++) out[h * d + j] *= inv;                               \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Decode attention, one query per sequence: q rows of heads*head_dim floats, q_stride     \
     * apart (float32); out [batch, heads, head_dim]. With enough sequences to keep the threads busy, one work item takes a sequence's  \
     * KV heads together (each token's K/V row is then one contiguous read); otherwise one KV  \
     * head each. */                                                                           \
    static void attention_##SUFFIX(const float *q, int64_t q_stride, const T *k_cache,        \
                                   const T *v_cache, const int32_t *tables,                    \
                                   const int32_t *seq_lens, const Shape *s, float scale,       \
                                   float *out) {                                               \
        const int64_t group = s->heads / s->kv_heads, d = s->head_dim;                         \
        int64_t per_item = 1;                                                                  \
        if (s->batch >= 4 * s->threads) {                                                      \
            per_item = MAX_QUERY_HEADS / group;                                                \
            if (per_item > s->kv_heads) per_item = s->kv_heads;                                \
        }                                                                                      \
        const int64_t items_per_seq = (s->kv_heads + per_item - 1) / per_item;                 \
        _Pragma("omp for schedule(dynamic, 1)")                                                \
        for (int64_t w = 0; w < s->batch * items_per_seq; w++) {                               \
            int64_t b = w / items_per_seq, g0 = (w % items_per_seq) * per_item;                \
            int64_t nkv = s->kv_heads - g0 < per_item ? s->kv_heads - g0 : per_item;           \
            int64_t head = g0 * group;                                                         \
            attend_heads_##SUFFIX(q + b * q_stride + head * d, k_cache, v_cache,               \
                                  tables + b * s->table_stride, seq_lens[b], g0, nkv, group,   \
                                  s, scale, out + (b * s->heads + head) * d);                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Rotate (rotate-half) head h of sequence b's qkv row in place; a K head (h >= heads) is    \
     * stored with its V into the cache at the token's slot. */                                  \
    static inline void rotate_head_##SUFFIX(float *qkv, int64_t b, int64_t h,                    \
                                            const float *cos_table, const float *sin_table,      \
                                            const int64_t *positions, const int64_t *slots,      \
                                            T *k_cache, T *v_cache, const Shape *s) {            \
        const int64_t d = s->head_dim, half = d / 2;                                             \
        const int64_t width = (s->heads + 2 * s->kv_heads) * d;                                  \
        float *x = qkv + b * width + h * d;                                                      \
        const float *c = cos_table + positions[b] * d, *sn = sin_table + positions[b] * d;       \
        for (int64_t j = 0; j < half; j++) {                                                     \
            float x1 = x[j], x2 = x[j + half];                                                   \
            x[j] = x1 * c[j] - x2 * sn[j];                                                       \
            x[j + half] = x2 * c[j + half] + x1 * sn[j + half];                                  \
        }                                                                                        \
        if (h >= s->heads && slots[b] >= 0) {                                                    \
            int64_t kv = h - s->heads;                                                           \
            T *kd = k_cache + (slots[b] * s->kv_heads + kv) * d;                                 \
            T *vd = v_cache + (slots[b] * s->kv_heads + kv) * d;                                 \
            const float *v = qkv + b * width + (s->heads + s->kv_heads + kv) * d;                \
            for (int64_t j = 0; j < d; j++) {                                                    \
                kd[j] = STORE(x[j]);                                                             \
                vd[j] = STORE(v[j]);                                                             \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* Rotate q and k (rotate-half), then store k and v of each sequence's new token. */         \
    static void rotate_and_store_##SUFFIX(float *qkv, const float *cos_table,                    \
                                          const float *sin_table, const int64_t *positions,      \
                                          const int64_t *slots, T *k_cache, T *v_cache,          \
                                          const Shape *s) {                                      \
        const int64_t heads = s->heads + s->kv_heads;                                            \
        _Pragma("omp for schedule(static)")                                                      \
        for (int64_t w = 0; w < s->batch * heads; w++)                                           \
            rotate_head_##SUFFIX(qkv, w / heads, w % heads, cos_table, sin_table, positions, slots, \
                                 k_cache, v_cache, s);                                           \
    }                                                                                            \
                                                                                                 \
    /* rotate_and_store_ and attention_ in one pass over attention_'s work items: an item        \
     * rotates its own query heads and KV heads, stores its K/V, then attends. Nothing it reads  \
     * is written by another item, so the barrier between the two phases goes (one of a          \
     * layer's few in the decode forwards, each costing a wake-up through the kernel under       \
     * OMP_WAIT_POLICY=PASSIVE). The same arithmetic as the two calls. */                        \
    static void rope_attention_##SUFFIX(float *qkv, const float *cos_table, const float *sin_table, \
                                        const int64_t *positions, const int64_t *slots,          \
                                        T *k_cache, T *v_cache, const int32_t *tables,           \
                                        const int32_t *seq_lens, const Shape *s, float scale,    \
                                        float *out) {                                            \
        const int64_t group = s->heads / s->kv_heads, d = s->head_dim;                           \
        const int64_t q_stride = (s->heads + 2 * s->kv_heads) * d;                               \
        int64_t per_item = 1;                                                                    \
        if (s->batch >= 4 * s->threads) {                                                        \
            per_item = MAX_QUERY_HEADS / group;                                                  \
            if (per_item > s->kv_heads) per_item = s->kv_heads;                                  \
        }                                                                                        \
        const int64_t items_per_seq = (s->kv_heads + per_item - 1) / per_item;                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                  \
        for (int64_t w = 0; w < s->batch * items_per_seq; w++) {                                 \
            int64_t b = w / items_per_seq, g0 = (w % items_per_seq) * per_item;                  \
            int64_t nkv = s->kv_heads - g0 < per_item ? s->kv_heads - g0 : per_item;             \
            int64_t head = g0 * group;                                                           \
            for (int64_t h = head; h < head + nkv * group; h++)                                  \
                rotate_head_##SUFFIX(qkv, b, h, cos_table, sin_table, positions, slots, k_cache, \
                                     v_cache, s);                                                \
            for (int64_t kv = g0; kv < g0 + nkv; kv++)                                           \
                rotate_head_##SUFFIX(qkv, b, s->heads + kv, cos_table, sin_table, positions, slots, \
                                     k_cache, v_cache, s);                                       \
            attend_heads_##SUFFIX(qkv + b * q_stride + head * d, k_cache, v_cache,               \
                                  tables + b * s->table_stride, seq_lens[b], g0, nkv, group, s,  \
                                  scale, out + (b * s->heads + head) * d);                       \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* The whole decode forward. hidden [batch, hidden] holds the token embeddings on entry;     \
     * logits [batch, vocab] receive the LM head's output. Returns 0, or -1 if out of memory. */ \
    int decode_forward_##SUFFIX(const int64_t *shape, const int64_t *layer_ptrs,                 \
                                const T *final_norm, const T *lm_head, const float *cos_table,   \
                                const float *sin_table, const int64_t *positions,                \
                                const int64_t *slots, const int32_t *tables,                     \
                                const int32_t *seq_lens, float eps, float scale, float *hidden,  \
                                float *logits) {                                                 \
        const Shape *s = (const Shape *)shape;                                                   \
        const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;        \
        const int64_t q_w = s->heads * s->head_dim;                                              \
        size_t floats = (size_t)s->batch * (hs + qkv_w + q_w + s->inter);                        \
        float *scratch = malloc(floats * sizeof(float));                                         \
        if (!scratch) return -1;                                                                 \
        float *normed = scratch, *qkv = normed + s->batch * hs;                                  \
        float *attn = qkv + s->batch * qkv_w, *act = attn + s->batch * q_w;                      \
        _Pragma("omp parallel num_threads(s->threads)")                                          \
        {                                                                                        \
            for (int64_t layer = 0; layer < s->layers; layer++) {                                \
                const int64_t *p = layer_ptrs + layer * P_COUNT;                                 \
                T *k_cache = (T *)(intptr_t)p[P_KCACHE], *v_cache = (T *)(intptr_t)p[P_VCACHE];  \
                rms_norm_##SUFFIX(hidden, (const T *)(intptr_t)p[P_LN1], normed, s->batch, hs,   \
                                  eps);                                                          \
                matvec_##SUFFIX(normed, (const T *)(intptr_t)p[P_WQKV],                          \
                                (const T *)(intptr_t)p[P_BQKV], qkv, s->batch, qkv_w, hs, 0);    \
                rope_attention_##SUFFIX(qkv, cos_table, sin_table, positions, slots, k_cache,    \
                                        v_cache, tables, seq_lens, s, scale, attn);              \
                matvec_##SUFFIX(attn, (const T *)(intptr_t)p[P_WO], NULL, hidden, s->batch, hs,  \
                                q_w, 1);                                                         \
                rms_norm_##SUFFIX(hidden, (const T *)(intptr_t)p[P_LN2], normed, s->batch, hs,   \
                                  eps);                                                          \
                gate_up_##SUFFIX(normed, (const T *)(intptr_t)p[P_WGU], act, s->batch,           \
                                 s->inter, hs);                                                  \
                matvec_##SUFFIX(act, (const T *)(intptr_t)p[P_WDOWN], NULL, hidden, s->batch,    \
                                hs, s->inter, 1);                                                \
            }                                                                                    \
            rms_norm_##SUFFIX(hidden, final_norm, normed, s->batch, hs, eps);                    \
            matvec_##SUFFIX(normed, lm_head, NULL, logits, s->batch, s->vocab, hs, 0);           \
        }                                                                                        \
        free(scratch);                                                                           \
        return 0;                                                                                \
    }                                                                                            \
                                                                                                 \
    /* Decode attention alone, for the torch path: q/out [batch, heads, head_dim] in T.       \
     * Returns 0, or -1 if out of memory. */                                                   \
    int paged_decode_attention_##SUFFIX(const int64_t *shape, const T *q, const T *k_cache,    \
                                        const T *v_cache, const int32_t *tables,               \
                                        const int32_t *seq_lens, float scale, T *out) {        \
        const Shape *s = (const Shape *)shape;                                                 \
        const int64_t n = s->batch * s->heads * s->head_dim;                                   \
        float *qf = malloc(2 * (size_t)n * sizeof(float));                                     \
        if (!qf) return -1;                                                                    \
        float *of = qf + n;                                                                    \
        _Pragma("omp parallel num_threads(s->threads)")                                        \
        {                                                                                      \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t j = 0; j < n; j++) qf[j] = LOAD(q[j]);                                \
            attention_##SUFFIX(qf, s->heads * s->head_dim, k_cache, v_cache, tables, seq_lens, \
                               s, scale, of);                                                  \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t j = 0; j < n; j++) out[j] = STORE(of[j]);                             \
        }                                                                                      \
        free(qf);                                                                              \
        return 0;                                                                              \
    }                                                                                          \
                                                                                               \
    /* The same with float32 queries and output over a T cache: a float32 forward that keeps  \
     * its K/V in 16 bits (CPUs without bf16 arithmetic). Nothing to convert on the way. */    \
    int paged_decode_attention_f32q_##SUFFIX(const int64_t *shape, const float *q,             \
                                             const T *k_cache, const T *v_cache,               \
                                             const int32_t *tables, const int32_t *seq_lens,   \
                                             float scale, float *out) {                        \
        const Shape *s = (const Shape *)shape;                                                 \
        _Pragma("omp parallel num_threads(s->threads)")                                        \
        attention_##SUFFIX(q, s->heads * s->head_dim, k_cache, v_cache, tables, seq_lens, s,    \
                           scale, out);                                                        \
        return 0;                                                                              \
    }

DEFINE_KERNELS(bf16, uint16_t, bf16_load, bf16_store, bf16_loadv)
DEFINE_KERNELS(f32, float, f32_load, f32_store, f32_loadv)

/* Element-wise steps of the torch forward (prefills and decode batches over the native
 * forward's limit), each one pass over memory instead of several torch operators. They round
 * where torch's model-dtype ops round, so bf16 results stay close to the torch path's. */
#define DEFINE_LAYER_OPS(SUFFIX, T, LOAD, STORE, LOADV, ROUNDV, STOREV)                                               \
                                                                                               \
    /* If `add` is given, x += add (in T, as `hidden + o` in torch); then                      \
     * out = weight * T(x * rsqrt(mean(x^2) + eps)), row by row. */                            \
    void add_rms_norm_##SUFFIX(T *x, const T *add, const T *weight, T *out, int64_t rows,      \
                               int64_t hidden, float eps, int64_t threads) {                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            T *xr = x + r * hidden;                                                            \
            float ss = 0.0f;                                                                   \
            for (int64_t j = 0; j < hidden; j++) {                                             \
                if (add) xr[j] = STORE(LOAD(xr[j]) + LOAD(add[r * hidden + j]));               \
                float v = LOAD(xr[j]);                                                         \
                ss += v * v;                                                                   \
            }                                                                                  \
            float inv = 1.0f / sqrtf(ss / (float)hidden + eps);                                \
            for (int64_t j = 0; j < hidden; j++)                                               \
                out[r * hidden + j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(xr[j]) * inv)));  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* Rotate-half rotary on the first `heads` head_dim-wide slices of each row of x (q and k  \
     * side by side in the merged qkv output; rows `stride` apart), in place. */               \
    void rotary_##SUFFIX(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,  \
                         const float *cos_table, const float *sin_table,                       \
                         const int64_t *positions, int64_t threads) {                          \
        const int64_t half = head_dim / 2;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            const float *c = cos_table + positions[r] * head_dim;                              \
            const float *s = sin_table + positions[r] * head_dim;                              \
            for (int64_t h = 0; h < heads; h++) {                                              \
                T *v = x + r * stride + h * head_dim;                                          \
                for (int64_t j = 0; j < half; j++) {                                           \
                    float x1 = LOAD(v[j]), x2 = LOAD(v[j + half]);                             \
                    v[j] = STORE(x1 * c[j] - x2 * s[j]);                                       \
                    v[j + half] = STORE(x2 * c[j + half] + x1 * s[j + half]);                  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], rounding silu's output to T    \
     * first, as torch's two ops do. */                                                        \
    void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter,              \
                           int64_t threads) {                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                              \
            T *o = out + r * inter;                                                            \
            int64_t i = 0;                                                                     \
            for (; i + VW <= inter; i += VW) {                                                 \
                vf gv = LOADV(g + i);                                                        \
                vf sv = ROUNDV(gv / (1.0f + exp_v(-gv)));                                  \
                STOREV(o + i, sv * LOADV(u + i));                                              \
            }                                                                                  \
            for (; i < inter; i++) o[i] = STORE(LOAD(STORE(silu(LOAD(g[i])))) * LOAD(u[i]));   \
        }                                                                                      \
    }

DEFINE_LAYER_OPS(bf16, uint16_t, bf16_load, bf16_store, bf16_loadv, bf16_roundv, bf16_storev)
DEFINE_LAYER_OPS(f32, float, f32_load, f32_store, f32_loadv, f32_roundv, f32_storev)
