/* Template (cpu_template.h; parameters SUFFIX and T): cpu_decode.c's matrix-vector products
 * over T weights, the whole decode forward built on them and the steps of
 * cpu_decode_steps.inc.c, and the decode attention alone for the torch path
 * (paged_decode_attention_*). Instantiated after cpu_decode_steps.inc.c for the same SUFFIX. */
#if !defined(SUFFIX) || !defined(T)
#error "define SUFFIX and T before including this template (cpu_template.h)"
#endif

#include <stdlib.h>

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_decode_simd.h"
#include "cpu_lora.h"
#include "cpu_template.h"

/* out[b] = row . x[b, :] for nb <= XROWS rows of x: one weight load feeds nb independent
 * accumulator chains. */
static inline void FN(dot)(const T *row, const float *x, int64_t k, int64_t nb,
                           float *out) {
    switch (nb) {
    case 1: DOT_ROWS(LOADV, LOAD, 1); break;
    case 2: DOT_ROWS(LOADV, LOAD, 2); break;
    case 3: DOT_ROWS(LOADV, LOAD, 3); break;
    case 4: DOT_ROWS(LOADV, LOAD, 4); break;
    case 5: DOT_ROWS(LOADV, LOAD, 5); break;
    default: DOT_ROWS(LOADV, LOAD, XROWS); break;
    }
}

static inline void FN(dot2)(const T *r0, const T *r1, const float *x, int64_t k,
                            int64_t nb, float *out0, float *out1) {
    switch (nb) {
    case 1: DOT2_ROWS(LOADV, LOAD, 1); break;
    case 2: DOT2_ROWS(LOADV, LOAD, 2); break;
    case 3: DOT2_ROWS(LOADV, LOAD, 3); break;
    case 4: DOT2_ROWS(LOADV, LOAD, 4); break;
    case 5: DOT2_ROWS(LOADV, LOAD, 5); break;
    default: DOT2_ROWS(LOADV, LOAD, XROWS); break;
    }
}

/* y[b, n] (+)= x[b, :] . w[n, :] (+ bias[n]) for the rows n of this thread, two rows at
 * a time (the last one alone when n_out is odd). */
static void FN(matvec)(const float *x, const T *w, const T *bias, float *y,
                       int64_t batch, int64_t n_out, int64_t k, int accumulate) {
    #pragma omp for schedule(static)
    for (int64_t pair = 0; pair < (n_out + 1) / 2; pair++) {
        int64_t n = 2 * pair;
        int two = n + 1 < n_out;
        const T *r0 = w + n * k, *r1 = two ? r0 + k : r0;
        float bias0 = bias ? LOAD(bias[n]) : 0.0f;
        float bias1 = bias && two ? LOAD(bias[n + 1]) : 0.0f, d0[XROWS], d1[XROWS];
        for (int64_t b0i = 0; b0i < batch; b0i += XROWS) {
            int64_t nb = batch - b0i < XROWS ? batch - b0i : XROWS;
            if (two)
                FN(dot2)(r0, r1, x + b0i * k, k, nb, d0, d1);
            else
                FN(dot)(r0, x + b0i * k, k, nb, d0);
            for (int64_t i = 0; i < nb; i++) {
                float *dst = y + (b0i + i) * n_out + n;
                dst[0] = (accumulate ? dst[0] : 0.0f) + d0[i] + bias0;
                if (two) dst[1] = (accumulate ? dst[1] : 0.0f) + d1[i] + bias1;
            }
        }
    }
}

/* act[b, i] = silu(gate_i . x) * (up_i . x): both rows of output i on one thread. */
static void FN(gate_up)(const float *x, const T *w, float *act, int64_t batch,
                        int64_t inter, int64_t k) {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < inter; i++) {
        const T *g = w + i * k, *u = w + (inter + i) * k;
        float gd[XROWS], ud[XROWS];
        for (int64_t b0i = 0; b0i < batch; b0i += XROWS) {
            int64_t nb = batch - b0i < XROWS ? batch - b0i : XROWS;
            FN(dot2)(g, u, x + b0i * k, k, nb, gd, ud);
            for (int64_t j = 0; j < nb; j++) act[(b0i + j) * inter + i] = silu(gd[j]) * ud[j];
        }
    }
}

/* Layer `layer`'s LoRA update of one kind of linear (LK_*, descriptor `lora`, cpu_lora.h):
 * out[b] += x[b] A_s^T B_s^T for each row b of slot s >= 0 in the plan, over the team. */
static void FN(fused_lora)(const int64_t *lora, const int64_t *shapes, int64_t layer, int kind,
                           const float *x, float *out, const LoraPlan *plan) {
    const int64_t *factors = lora_factors(lora, layer, kind);
    TPL_CAT(lora_run_fused_, SUFFIX)(shapes + kind * L_FIELDS, x, out,
                                     (const T *)(intptr_t)factors[LP_A],
                                     (const T *)(intptr_t)factors[LP_B_T], plan,
                                     lora + kind * LORA_KIND_FIELDS + L_FIELDS);
}

/* The whole decode forward. hidden [batch, hidden] holds the token embeddings on entry;
 * logits [batch, vocab] receive the LM head's output. With `lora` (a descriptor, cpu_lora.h)
 * and `lora_slots` (each row's slot, -1: the base model) each projection adds its adapter
 * rows' low-rank updates; NULL: none, the forward unchanged. Returns 0, or -1 if out of
 * memory. */
int FN(decode_forward)(const int64_t *shape, const int64_t *layer_ptrs,
                       const T *final_norm, const T *lm_head, const float *cos_table,
                       const float *sin_table, const int64_t *positions,
                       const int64_t *slots, const int32_t *tables,
                       const int32_t *seq_lens, float eps, float scale, float *hidden,
                       float *logits, const int64_t *lora, const int32_t *lora_slots) {
    const Shape *s = (const Shape *)shape;
    const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t q_w = s->heads * s->head_dim;
    LoraPlan plan;
    int64_t lora_shapes[LK_COUNT * L_FIELDS];
    const int adapters = lora_fused_begin(lora, lora_slots, s->batch, s->threads, lora_shapes,
                                          &plan, LORA_ROWS);
    if (adapters < 0) return -1;
    /* With adapter rows, gate|up's pre-activations too: its update lands before the SiLU. */
    size_t floats = (size_t)s->batch * (hs + qkv_w + q_w + s->inter) + attention_scratch_floats(s);
    if (adapters) floats += (size_t)s->batch * 2 * s->inter;
    float *scratch = calloc(floats, sizeof(float)); /* zeros: the split's counters */
    if (!scratch) {
        if (adapters) lora_plan_free(&plan);
        return -1;
    }
    float *normed = scratch, *qkv = normed + s->batch * hs;
    float *attn = qkv + s->batch * qkv_w, *act = attn + s->batch * q_w;
    float *split = act + s->batch * s->inter;
    float *gate_up = split + attention_scratch_floats(s);
    #pragma omp parallel num_threads(s->threads)
    {
        for (int64_t layer = 0; layer < s->layers; layer++) {
            const int64_t *p = layer_ptrs + layer * P_COUNT;
            T *k_cache = (T *)(intptr_t)p[P_KCACHE], *v_cache = (T *)(intptr_t)p[P_VCACHE];
            FN(rms_norm)(hidden, (const T *)(intptr_t)p[P_LN1], normed, s->batch, hs,
                         eps);
            FN(matvec)(normed, (const T *)(intptr_t)p[P_WQKV],
                       (const T *)(intptr_t)p[P_BQKV], qkv, s->batch, qkv_w, hs, 0);
            if (adapters) FN(fused_lora)(lora, lora_shapes, layer, LK_QKV, normed, qkv, &plan);
            FN(rope_attention)(qkv, cos_table, sin_table, positions, slots, k_cache,
                               v_cache, tables, seq_lens, s, scale, attn, split);
            FN(matvec)(attn, (const T *)(intptr_t)p[P_WO], NULL, hidden, s->batch, hs,
                       q_w, 1);
            if (adapters) FN(fused_lora)(lora, lora_shapes, layer, LK_O, attn, hidden, &plan);
            FN(rms_norm)(hidden, (const T *)(intptr_t)p[P_LN2], normed, s->batch, hs,
                         eps);
            if (adapters) {
                /* gate|up's rows are gate's then up's: one matvec gives [gate | up]. */
                FN(matvec)(normed, (const T *)(intptr_t)p[P_WGU], NULL, gate_up, s->batch,
                           2 * s->inter, hs, 0);
                FN(fused_lora)(lora, lora_shapes, layer, LK_GATE_UP, normed, gate_up, &plan);
                lora_silu_mul(gate_up, act, s->batch, s->inter);
            } else {
                FN(gate_up)(normed, (const T *)(intptr_t)p[P_WGU], act, s->batch,
                            s->inter, hs);
            }
            FN(matvec)(act, (const T *)(intptr_t)p[P_WDOWN], NULL, hidden, s->batch,
                       hs, s->inter, 1);
            if (adapters) FN(fused_lora)(lora, lora_shapes, layer, LK_DOWN, act, hidden, &plan);
        }
        FN(rms_norm)(hidden, final_norm, normed, s->batch, hs, eps);
        FN(matvec)(normed, lm_head, NULL, logits, s->batch, s->vocab, hs, 0);
    }
    if (adapters) lora_plan_free(&plan);
    free(scratch);
    return 0;
}

/* Decode attention, one query per sequence: q rows of heads*head_dim floats, q_stride
 * apart (float32); out [batch, heads, head_dim]. With enough sequences to keep the threads
 * busy, one work item takes a sequence's KV heads together (each token's K/V row is then one
 * contiguous read); otherwise one KV head each. */
static void FN(attention)(const float *q, int64_t q_stride, const T *k_cache,
                          const T *v_cache, const int32_t *tables,
                          const int32_t *seq_lens, const Shape *s, float scale,
                          float *out) {
    const int64_t group = s->heads / s->kv_heads, d = s->head_dim;
    int64_t per_item = 1;
    if (s->batch >= 4 * s->threads) {
        per_item = MAX_QUERY_HEADS / group;
        if (per_item > s->kv_heads) per_item = s->kv_heads;
    }
    const int64_t items_per_seq = (s->kv_heads + per_item - 1) / per_item;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < s->batch * items_per_seq; w++) {
        int64_t b = w / items_per_seq, g0 = (w % items_per_seq) * per_item;
        int64_t nkv = s->kv_heads - g0 < per_item ? s->kv_heads - g0 : per_item;
        int64_t head = g0 * group;
        FN(attend_heads)(q + b * q_stride + head * d, k_cache, v_cache,
                         tables + b * s->table_stride, 0, seq_lens[b], g0, nkv,
                         group, s, scale, out + (b * s->heads + head) * d, NULL, NULL);
    }
}

/* Decode attention alone, for the torch path: q/out [batch, heads, head_dim] in T.
 * Returns 0, or -1 if out of memory. */
int FN(paged_decode_attention)(const int64_t *shape, const T *q, const T *k_cache,
                               const T *v_cache, const int32_t *tables,
                               const int32_t *seq_lens, float scale, T *out) {
    const Shape *s = (const Shape *)shape;
    const int64_t n = s->batch * s->heads * s->head_dim;
    float *qf = malloc(2 * (size_t)n * sizeof(float));
    if (!qf) return -1;
    float *of = qf + n;
    #pragma omp parallel num_threads(s->threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) qf[j] = LOAD(q[j]);
        FN(attention)(qf, s->heads * s->head_dim, k_cache, v_cache, tables, seq_lens,
                      s, scale, of);
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) out[j] = STORE(of[j]);
    }
    free(qf);
    return 0;
}

/* The same with float32 queries and output over a T cache: a float32 forward that keeps
 * its K/V in 16 bits (CPUs without bf16 arithmetic). Nothing to convert on the way. */
int FN(paged_decode_attention_f32q)(const int64_t *shape, const float *q,
                                    const T *k_cache, const T *v_cache,
                                    const int32_t *tables, const int32_t *seq_lens,
                                    float scale, float *out) {
    const Shape *s = (const Shape *)shape;
    #pragma omp parallel num_threads(s->threads)
    FN(attention)(q, s->heads * s->head_dim, k_cache, v_cache, tables, seq_lens, s,
                  scale, out);
    return 0;
}

#undef SUFFIX
#undef T
