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

#include "cpu_decode_simd.h"
#include "cpu_decode_attention.h"

DEFINE_ATTENTION(bf16, uint16_t, bf16_load, bf16_store, bf16_loadv)
DEFINE_ATTENTION(f32, float, f32_load, f32_store, f32_loadv)

#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE, LOADV)                                                   \
                                                                                                 \
    /* out[b] = row . x[b, :] for nb <= XROWS rows of x: one weight load feeds nb independent \
     * accumulator chains. */                                                                   \
    static inline void dot_##SUFFIX(const T *row, const float *x, int64_t k, int64_t nb,       \
                                    float *out) {                                              \
        switch (nb) {                                                                          \
        case 1: DOT_ROWS(LOADV, LOAD, 1); break;                                               \
        case 2: DOT_ROWS(LOADV, LOAD, 2); break;                                               \
        case 3: DOT_ROWS(LOADV, LOAD, 3); break;                                               \
        case 4: DOT_ROWS(LOADV, LOAD, 4); break;                                               \
        case 5: DOT_ROWS(LOADV, LOAD, 5); break;                                               \
        default: DOT_ROWS(LOADV, LOAD, XROWS); break;                                          \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static inline void dot2_##SUFFIX(const T *r0, const T *r1, const float *x, int64_t k,      \
                                     int64_t nb, float *out0, float *out1) {                   \
        switch (nb) {                                                                          \
        case 1: DOT2_ROWS(LOADV, LOAD, 1); break;                                              \
        case 2: DOT2_ROWS(LOADV, LOAD, 2); break;                                              \
        case 3: DOT2_ROWS(LOADV, LOAD, 3); break;                                              \
        case 4: DOT2_ROWS(LOADV, LOAD, 4); break;                                              \
        case 5: DOT2_ROWS(LOADV, LOAD, 5); break;                                              \
        default: DOT2_ROWS(LOADV, LOAD, XROWS); break;                                         \
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
            float bias1 = bias && two ? LOAD(bias[n + 1]) : 0.0f, d0[XROWS], d1[XROWS];        \
            for (int64_t b0i = 0; b0i < batch; b0i += XROWS) {                                 \
                int64_t nb = batch - b0i < XROWS ? batch - b0i : XROWS;                        \
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
            float gd[XROWS], ud[XROWS];                                                        \
            for (int64_t b0i = 0; b0i < batch; b0i += XROWS) {                                 \
                int64_t nb = batch - b0i < XROWS ? batch - b0i : XROWS;                        \
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
        size_t floats = (size_t)s->batch * (hs + qkv_w + q_w + s->inter) + attention_scratch_floats(s); \
        float *scratch = calloc(floats, sizeof(float)); /* zeros: the split's counters */       \
        if (!scratch) return -1;                                                                 \
        float *normed = scratch, *qkv = normed + s->batch * hs;                                  \
        float *attn = qkv + s->batch * qkv_w, *act = attn + s->batch * q_w;                      \
        float *split = act + s->batch * s->inter;                                                \
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
                                        v_cache, tables, seq_lens, s, scale, attn, split);       \
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
