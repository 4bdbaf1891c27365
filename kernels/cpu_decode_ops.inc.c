/* Template (cpu_template.h; parameters SUFFIX and T): element-wise steps of the torch forward
 * (prefills and decode batches over the native forward's limit), each one pass over memory
 * instead of several torch operators. They round where torch's model-dtype ops round, so bf16
 * results stay close to the torch path's. */
#if !defined(SUFFIX) || !defined(T)
#error "define SUFFIX and T before including this template (cpu_template.h)"
#endif

#include <math.h>

#include "cpu_decode_simd.h"
#include "cpu_template.h"

/* If `add` is given, x += add (in T, as `hidden + o` in torch); then
 * out = weight * T(x * rsqrt(mean(x^2) + eps)), row by row. */
void FN(add_rms_norm)(T *x, const T *add, const T *weight, T *out, int64_t rows,
                      int64_t hidden, float eps, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        T *xr = x + r * hidden;
        float ss = 0.0f;
        for (int64_t j = 0; j < hidden; j++) {
            if (add) xr[j] = STORE(LOAD(xr[j]) + LOAD(add[r * hidden + j]));
            float v = LOAD(xr[j]);
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++)
            out[r * hidden + j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(xr[j]) * inv)));
    }
}

/* Rotate-half rotary on the first `heads` head_dim-wide slices of each row of x (q and k
 * side by side in the merged qkv output; rows `stride` apart), in place. */
void FN(rotary)(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,
                const float *cos_table, const float *sin_table,
                const int64_t *positions, int64_t threads) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_table + positions[r] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            T *v = x + r * stride + h * head_dim;
            for (int64_t j = 0; j < half; j++) {
                float x1 = LOAD(v[j]), x2 = LOAD(v[j + half]);
                v[j] = STORE(x1 * c[j] - x2 * s[j]);
                v[j + half] = STORE(x2 * c[j + half] + x1 * s[j + half]);
            }
        }
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], rounding silu's output to T
 * first, as torch's two ops do. */
void FN(silu_mul)(const T *gate_up, T *out, int64_t rows, int64_t inter,
                  int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gate_up + r * 2 * inter, *u = g + inter;
        T *o = out + r * inter;
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            vf gv = LOADV(g + i);
            vf sv = ROUNDV(gv / (1.0f + exp_v(-gv)));
            STOREV(o + i, sv * LOADV(u + i));
        }
        for (; i < inter; i++) o[i] = STORE(LOAD(STORE(silu(LOAD(g[i])))) * LOAD(u[i]));
    }
}

#undef SUFFIX
#undef T
