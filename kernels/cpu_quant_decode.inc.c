/* Template (cpu_template.h; parameters SUFFIX and T): cpu_quant.c's decode forward over
 * packed linears, the model's norms and KV cache in T. Included at the end of cpu_quant.c, after
 * cpu_decode_steps.inc.c for the same SUFFIX and after the packed matmuls (qmatvec, qgate_up)
 * it calls. */
#if !defined(SUFFIX) || !defined(T)
#error "define SUFFIX and T before including this template (cpu_template.h)"
#endif

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_quant.h"
#include "cpu_template.h"

/* rms_norm (cpu_decode_steps.inc.c) over all rows on the calling thread (own_prep). */
static void FN(rms_norm_own)(const float *x, const T *weight, float *out, int64_t batch,
                             int64_t hidden, float eps) {
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * hidden;
        float ss = 0.0f;
        for (int64_t j = 0; j < hidden; j++) ss += xb[j] * xb[j];
        float r = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++) out[b * hidden + j] = LOAD(weight[j]) * xb[j] * r;
    }
}

/* normed = rms_norm(hidden): on this thread alone (own_prep, into its own buffer) or shared
 * by the team (its loop's barrier). */
static inline void FN(norm_for_matvec)(const float *hidden, const T *weight, float *normed,
                                       const Shape *s, float eps, int own_prep) {
    if (own_prep)
        FN(rms_norm_own)(hidden, weight, normed, s->batch, s->hidden, eps);
    else
        FN(rms_norm)(hidden, weight, normed, s->batch, s->hidden, eps);
}

/* The decode forward of cpu_decode.c's decode_forward_*, with every linear read packed.
 * hidden [batch, hidden] holds the embeddings on entry; logits [batch, vocab] out. */
int FN(qdecode_forward)(const int64_t *shape, const int64_t *layer_ptrs,
                        const T *final_norm, const int64_t *lm_head,
                        const float *cos_table, const float *sin_table,
                        const int64_t *positions, const int64_t *slots,
                        const int32_t *tables, const int32_t *seq_lens, float eps,
                        float scale, float *hidden, float *logits) {
    const Shape *s = (const Shape *)shape;
    const int64_t hs = s->hidden, qkv_w = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t q_w = s->heads * s->head_dim, widest = s->inter > q_w ? s->inter : q_w;
    const int own_prep = s->batch <= OWN_PREP_MAX_BATCH;
    /* Per thread (one set when shared): the normed rows and the matrices' prepared x. */
    const size_t per_thread =
        (size_t)s->batch * hs + scratch_floats(s->batch, widest > hs ? widest : hs);
    const int64_t sets = own_prep ? s->threads : 1;
    const size_t split_floats = attention_scratch_floats(s);
    size_t floats =
        (size_t)s->batch * (qkv_w + q_w + 3 * s->inter) + sets * per_thread + split_floats;
    float *scratch = malloc(floats * sizeof(float));
    if (!scratch) return -1;
    float *qkv = scratch, *attn = qkv + s->batch * qkv_w, *gu = attn + s->batch * q_w;
    float *act = gu + s->batch * 2 * s->inter, *prep = act + s->batch * s->inter;
    float *split = prep + sets * per_thread;
    memset(split, 0, split_floats * sizeof(float)); /* the split's counters */
    #pragma omp parallel num_threads(s->threads)
    {
        float *normed = prep + (own_prep ? omp_get_thread_num() : 0) * per_thread;
        float *xs = normed + s->batch * hs;
        for (int64_t layer = 0; layer < s->layers; layer++) {
            const int64_t *p = layer_ptrs + layer * Q_COUNT;
            T *k_cache = (T *)(intptr_t)p[Q_KCACHE], *v_cache = (T *)(intptr_t)p[Q_VCACHE];
            FN(norm_for_matvec)(hidden, (const T *)(intptr_t)p[Q_LN1], normed, s, eps, own_prep);
            qmatvec(normed, (const QW *)(intptr_t)p[Q_WQKV], (const float *)(intptr_t)p[Q_BQKV],
                    qkv, s->batch, 0, xs, own_prep);
            FN(rope_attention)(qkv, cos_table, sin_table, positions, slots, k_cache,
                               v_cache, tables, seq_lens, s, scale, attn, split);
            qmatvec(attn, (const QW *)(intptr_t)p[Q_WO], NULL, hidden, s->batch, 1, xs, own_prep);
            FN(norm_for_matvec)(hidden, (const T *)(intptr_t)p[Q_LN2], normed, s, eps, own_prep);
            qgate_up(normed, (const QW *)(intptr_t)p[Q_WGU], gu, act, s->batch, s->inter, xs,
                     own_prep);
            qmatvec(act, (const QW *)(intptr_t)p[Q_WDOWN], NULL, hidden, s->batch, 1, xs, own_prep);
        }
        FN(norm_for_matvec)(hidden, final_norm, normed, s, eps, own_prep);
        qmatvec(normed, (const QW *)lm_head, NULL, logits, s->batch, 0, xs, own_prep);
    }
    free(scratch);
    return 0;
}

#undef SUFFIX
#undef T
