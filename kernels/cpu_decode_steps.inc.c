/* Template (cpu_template.h; parameters SUFFIX and T): the steps of a decode layer between its
 * matrix products, which the 16-bit forward (cpu_decode.c) and the packed one (cpu_quant.c)
 * share: RMSNorm over the batch, rotary with the K/V store, and the decode attention over the
 * paged KV cache. Both instantiate it, once per weight dtype. */
#if !defined(SUFFIX) || !defined(T)
#error "define SUFFIX and T before including this template (cpu_template.h)"
#endif

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_decode_simd.h"
#include "cpu_template.h"

/* out = RMSNorm(x) * weight for the batch's rows, split across the team (inside a forward's
 * parallel region; its loop's barrier ends it). */
static void FN(rms_norm)(const float *x, const T *weight, float *out, int64_t batch,
                         int64_t hidden, float eps) {
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * hidden;
        float ss = 0.0f;
        for (int64_t j = 0; j < hidden; j++) ss += xb[j] * xb[j];
        float r = 1.0f / sqrtf(ss / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++) out[b * hidden + j] = LOAD(weight[j]) * xb[j] * r;
    }
}

/* One token's K and V rows (`span` bytes from element `at`) into L2. */
static inline void FN(prefetch_token)(const T *k_cache, const T *v_cache, int64_t at,
                                      int64_t span) {
    const char *kp = (const char *)(k_cache + at), *vp = (const char *)(v_cache + at);
    for (int64_t off = 0; off < span; off += 64) {
        __builtin_prefetch(kp + off, 0, 2);
        __builtin_prefetch(vp + off, 0, 2);
    }
}

/* Query heads [nkv * group, head_dim] of KV heads g0 .. g0+nkv-1 over one sequence's
 * context in the paged cache: each K/V row is read once for all of them; online softmax a
 * chunk at a time, float32 throughout; rows ahead are prefetched, the next chunk's during
 * this one's (the blocks are scattered, so the hardware prefetcher cannot follow). A chunk's
 * slots are looked up once (a division per token cost as much as its dot products); for up
 * to 4 query heads a KV head (SmolLM2 3, Llama-2 1) the products run in registers (QK_GROUP,
 * PV_GROUP), where the generic loop kept updating `out` in memory for every token; more query
 * heads a KV head take them 4 at a time, each K/V row then coming from L1. Same sums in the
 * same order either way. `limits` (NULL: none): query head h attends to tokens below
 * limits[h] only, for rows of one sequence read together (attend_runs); every head's limit is
 * past t_begin. */
static void FN(attend_heads_limited)(const float *q, const T *k_cache, const T *v_cache,
                                     const int32_t *table, int64_t t_begin, int64_t t_end,
                                     int64_t g0, int64_t nkv, int64_t group, const Shape *s,
                                     float scale, float *out, float *m_out, float *l_out,
                                     const int64_t *limits) {
    const int64_t d = s->head_dim, row = s->kv_heads * d, bs = s->block_size;
    const int64_t nq = nkv * group, span = nkv * d * (int64_t)sizeof(T);
    const int vec = d % VW == 0;
    float m[MAX_QUERY_HEADS], l[MAX_QUERY_HEADS];
    float scores[MAX_QUERY_HEADS][CHUNK];
    int64_t slot_of[2 * CHUNK];
    for (int64_t h = 0; h < nq; h++) {
        m[h] = -FLT_MAX;
        l[h] = 0.0f;
    }
    for (int64_t j = 0; j < nq * d; j++) out[j] = 0.0f;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += CHUNK) {
        int64_t n = t_end - t0 < CHUNK ? t_end - t0 : CHUNK;
        int64_t ahead = t_end - t0 < 2 * CHUNK ? t_end - t0 : 2 * CHUNK;
        for (int64_t t = 0, blk = t0 / bs, off = t0 % bs; t < ahead; t++) {
            slot_of[t] = (int64_t)table[blk] * bs + off;
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        /* Lanes past n of the last vector: exp_v reads them (results unused); zeros, not
         * stack garbage. */
        for (int64_t h = 0; h < nq; h++)
            for (int64_t t = n; t < CHUNK && t % VW; t++) scores[h][t] = 0.0f;
        /* Into L2, a token's K/V rows at a time (QK_PREFETCH): the first chunk's PREFETCH
         * tokens ahead of the first KV head's query-key pass (a whole chunk's rows at once
         * overflowed L1, and its loads waited on memory: 60% of the attention's time on their
         * first use); the next chunk's, one token's every nkv tokens of each KV head's pass,
         * so its reads spread over all the chunk's query-key passes (issued in the first pass
         * alone, the memory sat idle through the others and the value pass: measured in
         * docs/benchmarks.md, "Zen 4, half-layer pauses"). */
        const int first_chunk = t0 == t_begin;
        if (first_chunk)
            for (int64_t t = 0; t < (PREFETCH < n ? PREFETCH : n); t++)
                FN(prefetch_token)(k_cache, v_cache, slot_of[t] * row + g0 * d, span);
        int64_t pf_tick = 0, pf_next = CHUNK;
#define QK_PREFETCH(t)                                                                         \
    if (first_pass) {                                                                          \
        if (first_chunk && gi == 0 && (t) + PREFETCH < n)                                      \
            FN(prefetch_token)(k_cache, v_cache, slot_of[(t) + PREFETCH] * row + g0 * d, span); \
        if (++pf_tick == nkv) {                                                                \
            pf_tick = 0;                                                                       \
            if (pf_next < ahead)                                                               \
                FN(prefetch_token)(k_cache, v_cache, slot_of[pf_next] * row + g0 * d, span);   \
            pf_next++;                                                                         \
        }                                                                                      \
    }
        for (int64_t gi = 0; gi < nkv; gi++) {
            const T *kh = k_cache + (g0 + gi) * d;
            const float *qg = q + gi * group * d;
            float(*sc)[CHUNK] = scores + gi * group;
            if (vec) {
                for (int64_t h0 = 0; h0 < group; h0 += 4, qg += 4 * d, sc += 4) {
                    const int first_pass = h0 == 0;
                    switch (group - h0 < 4 ? group - h0 : 4) {
                    case 1: QK_BATCH(LOADV, 1); break;
                    case 2: QK_BATCH(LOADV, 2); break;
                    case 3: QK_BATCH(LOADV, 3); break;
                    default: QK_BATCH(LOADV, 4); break;
                    }
                }
                continue;
            }
            const int first_pass = 1;
            for (int64_t t = 0; t < n; t++) {
                QK_PREFETCH(t);
                const T *kr = kh + slot_of[t] * row;
                for (int64_t h = 0; h < group; h++) {
                    const float *qh = qg + h * d;
                    float dot = 0.0f;
                    if (vec) {
                        vf acc = (vf){0};
                        for (int64_t j = 0; j < d; j += VW) acc += f32_loadv(qh + j) * LOADV(kr + j);
                        dot = hsum(acc);
                    } else {
                        for (int64_t j = 0; j < d; j++) dot += qh[j] * LOAD(kr[j]);
                    }
                    sc[h][t] = dot * scale;
                }
            }
        }
        if (limits && t0 + n > limits[0]) /* rows' limits grow with h: the first is least */
            for (int64_t h = 0; h < nq; h++)
                for (int64_t t = limits[h] - t0 < 0 ? 0 : limits[h] - t0; t < n; t++)
                    scores[h][t] = -INFINITY;
        for (int64_t h = 0; h < nq; h++) {
            float cm = max_of(scores[h], n, m[h]);
            float correction = expf(m[h] - cm);
            l[h] *= correction;
            for (int64_t j = 0; j < d; j++) out[h * d + j] *= correction;
            /* Whole vectors: lanes past n are computed and never used. */
            for (int64_t t = 0; t < n; t += VW) {
                vf e = exp_v(f32_loadv(&scores[h][t]) - cm);
                memcpy(&scores[h][t], &e, sizeof e);
            }
            for (int64_t t = 0; t < n; t++) l[h] += scores[h][t];
            m[h] = cm;
        }
        for (int64_t gi = 0; gi < nkv; gi++) {
            const T *vh = v_cache + (g0 + gi) * d;
            float *og = out + gi * group * d;
            float(*sc)[CHUNK] = scores + gi * group;
            if (vec) {
                for (int64_t h0 = 0; h0 < group; h0 += 4, og += 4 * d, sc += 4) {
                    switch (group - h0 < 4 ? group - h0 : 4) {
                    case 1: PV_GROUP(LOADV, 1); break;
                    case 2: PV_GROUP(LOADV, 2); break;
                    case 3: PV_GROUP(LOADV, 3); break;
                    default: PV_GROUP(LOADV, 4); break;
                    }
                }
                continue;
            }
            for (int64_t t = 0; t < n; t++) {
                const T *vr = vh + slot_of[t] * row;
                for (int64_t h = 0; h < group; h++) {
                    float p = sc[h][t];
                    float *o = og + h * d;
                    if (vec) {
                        for (int64_t j = 0; j < d; j += VW) {
                            vf acc = f32_loadv(o + j) + p * LOADV(vr + j);
                            memcpy(o + j, &acc, sizeof acc);
                        }
                    } else {
                        for (int64_t j = 0; j < d; j++) o[j] += p * LOAD(vr[j]);
                    }
                }
            }
        }
    }
#undef QK_PREFETCH
    if (m_out) { /* a part of the context: the merge normalizes (merge_parts) */
        memcpy(m_out, m, nq * sizeof(float));
        memcpy(l_out, l, nq * sizeof(float));
        return;
    }
    for (int64_t h = 0; h < nq; h++) {
        float inv = 1.0f / l[h];
        for (int64_t j = 0; j < d; j++) out[h * d + j] *= inv;
    }
}

static inline void FN(attend_heads)(const float *q, const T *k_cache, const T *v_cache,
                                    const int32_t *table, int64_t t_begin, int64_t t_end,
                                    int64_t g0, int64_t nkv, int64_t group, const Shape *s,
                                    float scale, float *out, float *m_out, float *l_out) {
    FN(attend_heads_limited)(q, k_cache, v_cache, table, t_begin, t_end, g0, nkv, group, s,
                             scale, out, m_out, l_out, NULL);
}

/* Rotate (rotate-half) head h of sequence b's qkv row in place; a K head (h >= heads) is
 * stored with its V into the cache at the token's slot. */
static inline void FN(rotate_head)(float *qkv, int64_t b, int64_t h,
                                   const float *cos_table, const float *sin_table,
                                   const int64_t *positions, const int64_t *slots,
                                   T *k_cache, T *v_cache, const Shape *s) {
    const int64_t d = s->head_dim;
    const int64_t width = (s->heads + 2 * s->kv_heads) * d;
    float *x = qkv + b * width + h * d;
    rotate_half(x, x, cos_table + positions[b] * d, sin_table + positions[b] * d, d);
    if (h >= s->heads && slots[b] >= 0) {
        int64_t kv = h - s->heads;
        T *kd = k_cache + (slots[b] * s->kv_heads + kv) * d;
        T *vd = v_cache + (slots[b] * s->kv_heads + kv) * d;
        const float *v = qkv + b * width + (s->heads + s->kv_heads + kv) * d;
        for (int64_t j = 0; j < d; j++) {
            kd[j] = STORE(x[j]);
            vd[j] = STORE(v[j]);
        }
    }
}

/* Rotary and store of every row's new K/V, before any row attends (the omp for's barrier
 * orders them): for steps whose rows share a sequence (rows_share_sequence). */
static void FN(store_new_kv)(float *qkv, const float *cos_table, const float *sin_table,
                             const int64_t *positions, const int64_t *slots, T *k_cache,
                             T *v_cache, const Shape *s) {
    #pragma omp for schedule(static)
    for (int64_t w = 0; w < s->batch * s->kv_heads; w++)
        FN(rotate_head)(qkv, w / s->kv_heads, s->heads + w % s->kv_heads, cos_table,
                        sin_table, positions, slots, k_cache, v_cache, s);
}

/* Attention for a step whose rows share sequences (their new K/V already stored): the rows of
 * one sequence (a drafting request's last token and its drafts) attend in one pass over its
 * context, each row masked to its own length, instead of one pass a row. A work item is (run
 * of rows, KV head); its queries are the run's rows' heads of that KV head, gathered into one
 * group of up to MAX_QUERY_HEADS (longer runs are cut). At 2k tokens of context a row's pass
 * reads ~1.5 MB of K/V a layer (SmolLM2), which drafting rows no longer repeat. */
static void FN(attend_runs)(float *qkv, const float *cos_table, const float *sin_table,
                            const int64_t *positions, const int64_t *slots, T *k_cache,
                            T *v_cache, const int32_t *tables, const int32_t *seq_lens,
                            const Shape *s, float scale, float *out) {
    const int64_t group = s->heads / s->kv_heads, d = s->head_dim;
    const int64_t q_stride = (s->heads + 2 * s->kv_heads) * d;
    const int64_t max_rows = MAX_QUERY_HEADS / group;
    /* Every thread finds the same runs (a few comparisons a row). */
    int64_t run_start[s->batch + 1], runs = 0;
    for (int64_t b = 0; b < s->batch; b++)
        if (b == 0 || b - run_start[runs - 1] >= max_rows ||
            !row_continues(b, positions, slots, tables, seq_lens, s))
            run_start[runs++] = b;
    run_start[runs] = s->batch;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < runs * s->kv_heads; w++) {
        const int64_t b0 = run_start[w / s->kv_heads], rows = run_start[w / s->kv_heads + 1] - b0;
        const int64_t g = w % s->kv_heads, nq = rows * group;
        float q[nq * d], o[nq * d];
        int64_t limits[nq], t_end = 0;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t b = b0 + i;
            for (int64_t h = 0; h < group; h++) {
                FN(rotate_head)(qkv, b, g * group + h, cos_table, sin_table, positions, slots,
                                k_cache, v_cache, s);
                memcpy(q + (i * group + h) * d, qkv + b * q_stride + (g * group + h) * d,
                       d * sizeof(float));
                limits[i * group + h] = seq_lens[b];
            }
            t_end = seq_lens[b] > t_end ? seq_lens[b] : t_end;
        }
        /* The run's last row has the longest context; its table covers the others'. */
        FN(attend_heads_limited)(q, k_cache, v_cache, tables + (b0 + rows - 1) * s->table_stride,
                                 0, t_end, g, 1, nq, s, scale, o, NULL, NULL,
                                 rows > 1 ? limits : NULL);
        for (int64_t i = 0; i < rows; i++)
            memcpy(out + ((b0 + i) * s->heads + g * group) * d, o + i * group * d,
                   group * d * sizeof(float));
    }
}

/* rope_attention over token ranges: a work item is (sequence, token range, chunk of KV heads:
 * one for up to MAX_QUERY_HEADS query heads). Steps of fewer sequences than threads cut each
 * sequence into attention_parts ranges (flash-decoding's split); the others cut the step's
 * context as attention_range_tokens says. A sequence of one range is rotated in place and
 * attended straight into out. One of several: each item rotates its queries into its own slot
 * of `split`; the item holding the last range rotates and stores the new token's K/V before
 * reading it (no other range reaches that token), unless store_new_kv did (`stored`); the
 * sequence's last item to finish merges its ranges into out, so no barrier is added. Every
 * thread finds the same ranges. */
static void FN(rope_attention_ranges)(float *qkv, const float *cos_table,
                                      const float *sin_table, const int64_t *positions,
                                      const int64_t *slots, T *k_cache, T *v_cache,
                                      const int32_t *tables, const int32_t *seq_lens,
                                      const Shape *s, float scale, float *out, float *split,
                                      int stored) {
    const int64_t group = s->heads / s->kv_heads, d = s->head_dim, heads = s->heads;
    const int64_t q_stride = (heads + 2 * s->kv_heads) * d;
    int64_t per_item = MAX_QUERY_HEADS / group;
    if (per_item > s->kv_heads) per_item = s->kv_heads;
    const int64_t chunks = (s->kv_heads + per_item - 1) / per_item;
    const int64_t split_parts = attention_parts(s);
    const int64_t unit = split_parts > 1 ? 0 : attention_range_tokens(seq_lens, s);
    const int64_t stride = attention_part_floats(s);
    int64_t first[s->batch + 1]; /* sequence b's ranges: first[b] .. first[b + 1] - 1 */
    first[0] = 0;
    for (int64_t b = 0; b < s->batch; b++)
        first[b + 1] =
            first[b] + (split_parts > 1 ? split_parts : attention_seq_ranges(seq_lens[b], unit));
    /* After the slots: the same place in every layer of the forward (seq_lens do not change). */
    int32_t *done = (int32_t *)(split + first[s->batch] * stride);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < first[s->batch] * chunks; w++) {
        const int64_t r = w / chunks, c = w % chunks;
        int64_t b = 0;
        while (first[b + 1] <= r) b++;
        const int64_t parts = first[b + 1] - first[b], p = r - first[b];
        const int64_t g0 = c * per_item;
        const int64_t nkv = s->kv_heads - g0 < per_item ? s->kv_heads - g0 : per_item;
        const int64_t head = g0 * group, len = seq_lens[b];
        if (parts == 1) {
            for (int64_t h = head; h < head + nkv * group; h++)
                FN(rotate_head)(qkv, b, h, cos_table, sin_table, positions, slots, k_cache,
                                v_cache, s);
            for (int64_t kv = g0; kv < g0 + nkv && !stored; kv++)
                FN(rotate_head)(qkv, b, heads + kv, cos_table, sin_table, positions, slots,
                                k_cache, v_cache, s);
            FN(attend_heads)(qkv + b * q_stride + head * d, k_cache, v_cache,
                             tables + b * s->table_stride, 0, len, g0, nkv, group, s, scale,
                             out + (b * heads + head) * d, NULL, NULL);
            continue;
        }
        float *base = split + r * stride;
        float *qr = base, *o = base + heads * d, *m = base + 2 * heads * d, *l = m + heads;
        for (int64_t h = head; h < head + nkv * group; h++) /* qkv left as it is */
            rotate_half(qkv + b * q_stride + h * d, qr + h * d, cos_table + positions[b] * d,
                        sin_table + positions[b] * d, d);
        if (p == parts - 1 && !stored) /* the only range that reaches the new token */
            for (int64_t kv = g0; kv < g0 + nkv; kv++)
                FN(rotate_head)(qkv, b, heads + kv, cos_table, sin_table, positions, slots,
                                k_cache, v_cache, s);
        FN(attend_heads)(qr + head * d, k_cache, v_cache, tables + b * s->table_stride,
                         len * p / parts, len * (p + 1) / parts, g0, nkv, group, s, scale,
                         o + head * d, m + head, l + head);
        /* acq_rel: the last item sees every other item's partial results. */
        if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == parts * chunks) {
            done[b] = 0;
            merge_parts(split + first[b] * stride, parts, stride, heads, d, out + b * heads * d);
        }
    }
}

/* Rotary, K/V store and attention in one pass over attention's work items: an item
 * rotates its own query heads and KV heads, stores its K/V, then attends. Nothing it reads
 * is written by another item, so the barrier between the two phases goes (one of a
 * layer's few in the decode forwards, each costing a wake-up through the kernel under
 * OMP_WAIT_POLICY=PASSIVE). The same arithmetic as the two calls.
 *
 * Kept out of line (one call a layer) in both libraries, as it was in the packed one while
 * that one also held the 16-bit forward: inlined into the packed forward's parallel region
 * (now its only caller there), its float32 results moved by an ulp. Out of line, the 16-bit
 * forward's results stay bit for bit too. */
static NOINLINE void FN(rope_attention)(float *qkv, const float *cos_table,
                                        const float *sin_table, const int64_t *positions,
                                        const int64_t *slots, T *k_cache, T *v_cache,
                                        const int32_t *tables, const int32_t *seq_lens,
                                        const Shape *s, float scale, float *out, float *split) {
    /* Rows of one sequence (a speculative step's draft positions) read each other's new K/V:
     * then every row's is stored first, behind the omp for's barrier. Every thread reaches
     * the same answer, so all or none meet the worksharing loop. */
    const int stored = rows_share_sequence(positions, slots, tables, seq_lens, s);
    if (stored) FN(store_new_kv)(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, s);
    if (stored && attention_parts(s) == 1) {
        FN(attend_runs)(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache, tables,
                        seq_lens, s, scale, out);
        return;
    }
    FN(rope_attention_ranges)(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache,
                              tables, seq_lens, s, scale, out, split, stored);
}

#undef SUFFIX
#undef T
