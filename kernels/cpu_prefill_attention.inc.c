/* A prefill chunk's causal attention over its sequence's paged bf16 cache, in AVX-512-BF16
 * pair dot products (vdpbf16ps), flash style: the torch path's SDPA (torch's CPU flash kernel)
 * ran the 1,500-token prompts of the mixed load at ~0.8 us a query-key pair over the small
 * demo model's 30 layers on a 2-core Zen 4, about as long as the prompt's matmuls.
 *
 * The chunk's queries are tokens start .. start+n-1 of one sequence, attending to its tokens
 * 0 .. their own position. First the context's K and V of each KV head are packed once for
 * the call, 16 keys a tile: K as [d pair][16 keys][2] (a tile row is one d pair of 16 keys, so
 * a query's broadcast d pair against it adds that pair to 16 scores), V as [key pair][d][2]
 * (a row is one key pair of 16 d, so a probability pair broadcast against it adds to 16
 * outputs). Then each work item, one KV head and QUERY_TOKENS tokens (their query heads of the
 * group, rows token-major), streams the key tiles up to its last token: scores of PF_ROWS rows
 * at a time in registers, the causal mask on the tiles that reach past a row's position, an
 * online softmax in float32, and the probabilities rounded to bf16 for the PV products (as
 * the torch bf16 kernels round them). Output float32 accumulators, stored as bf16.
 *
 * Included by cpu_decode.c after the bf16 steps. Only where the build
 * targets AVX-512-BF16 (prefill_attention_compiled() says so); Python calls it for bf16 caches
 * and head sizes that are a multiple of 32. */
#include <float.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_decode_attention.h"
#include "cpu_decode_simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Query tokens of one work item, and query rows of one register block of scores. */
#define QUERY_TOKENS 16
#define PF_ROWS 6
#define PF_MAX_HEAD_DIM 256

/* A KV head's keys 0 .. len-1 packed as described above: tiles of 16 keys, K then V. */
static void pf_pack_head(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                         int64_t len, int64_t g, const Shape *s, uint16_t *kp, uint16_t *vp) {
    const int64_t d = s->head_dim, row = s->kv_heads * d, bs = s->block_size;
    const int64_t tiles = (len + 15) / 16;
    for (int64_t t = 0; t < tiles; t++) {
        uint16_t *kt = kp + t * 16 * d, *vt = vp + t * 16 * d;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t key = t * 16 + j;
            if (key >= len) { /* zeros past the context: masked scores, zero probabilities */
                for (int64_t e = 0; e < d; e++) {
                    kt[(e / 2) * 32 + j * 2 + e % 2] = 0;
                    vt[(j / 2) * d * 2 + e * 2 + j % 2] = 0;
                }
                continue;
            }
            const int64_t slot = (int64_t)table[key / bs] * bs + key % bs;
            const uint16_t *kr = k_cache + slot * row + g * d, *vr = v_cache + slot * row + g * d;
            for (int64_t e = 0; e < d; e++) {
                kt[(e / 2) * 32 + j * 2 + e % 2] = kr[e];
                vt[(j / 2) * d * 2 + e * 2 + j % 2] = vr[e];
            }
        }
    }
}

/* A work item's scratch: its rows' softmax sums (vectors of partial sums), output accumulators
 * and maxima, positions and query rows (bf16). */
typedef struct {
    __m512 *l;
    float *acc, *m;
    int64_t *pos;
    uint16_t *qrows;
} PfScratch;

static size_t pf_scratch_bytes(int64_t rows, int64_t d) {
    return (size_t)rows * (sizeof(__m512) + d * sizeof(float) + 2 * sizeof(float) +
                           sizeof(int64_t) + d * sizeof(uint16_t)) + 128;
}

/* base 64-byte aligned; the vectors first. */
static PfScratch pf_scratch(char *base, int64_t rows, int64_t d) {
    PfScratch w;
    w.l = (__m512 *)base;
    w.acc = (float *)(w.l + rows);
    w.m = w.acc + rows * d;
    w.pos = (int64_t *)(w.m + rows + (rows & 1)); /* 8-byte aligned */
    w.qrows = (uint16_t *)(w.pos + rows);
    return w;
}

/* Rows of one register block, and key tiles of one chunk (scores of PF_ROWS x PF_TILES tiles
 * in registers: 24 of the 32; the softmax's max, correction and the output rows' loads and
 * stores once a chunk of 64 keys, not once a tile). */
#define PF_TILES 4

/* R query rows (bf16, d apart, at positions pos[]) over key tiles t0 .. t0+PF_TILES-1 (kt,
 * vt: the packed tiles from t0 on; `live` of them within the context): scores in registers,
 * the causal mask where the chunk reaches past a row, the online softmax (m, l as a vector of
 * partial sums) and the PV products into acc (R rows of d floats). R is a constant at each
 * call. */
static ALWAYS_INLINE void pf_chunk(const uint16_t *qrows, const int64_t *pos, int64_t t0,
                                   int live, const uint16_t *kt, const uint16_t *vt, int64_t d,
                                   float scale, int R, float *m, __m512 *l, float *acc) {
    __m512 sc[PF_ROWS][PF_TILES];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < PF_TILES; c++) sc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p++) {
        __m512bh kv[PF_TILES];
        for (int c = 0; c < PF_TILES; c++)
            kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(kt + c * 16 * d + p * 32));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, qrows + r * d + 2 * p, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < PF_TILES; c++)
                if (c < live) sc[r][c] = _mm512_dpbf16_ps(sc[r][c], x, kv[c]);
        }
    }
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        __m512 best = minus_inf;
        for (int c = 0; c < PF_TILES; c++) {
            __m512 x = _mm512_mul_ps(sc[r][c], _mm512_set1_ps(scale));
            const int64_t first = (t0 + c) * 16;
            if (c >= live || first > pos[r]) {
                x = minus_inf;
            } else if (first + 15 > pos[r]) {
                const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)first));
                x = _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32((int)pos[r])),
                                       minus_inf);
            }
            sc[r][c] = x;
            best = _mm512_max_ps(best, x);
        }
        const float chunk_max = _mm512_reduce_max_ps(best);
        const float m_new = chunk_max > m[r] ? chunk_max : m[r];
        const float correction = expf(m[r] - m_new);
        m[r] = m_new;
        const __m512 corr = _mm512_set1_ps(correction);
        __m512 sum = _mm512_mul_ps(l[r], corr);
        __m512 o[PF_MAX_HEAD_DIM / 16];
        for (int64_t b = 0; b < d / 16; b++) o[b] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + b * 16), corr);
        for (int c = 0; c < PF_TILES && c < live; c++) {
            if ((t0 + c) * 16 > pos[r]) break;
            vf xv, pv;
            memcpy(&xv, &sc[r][c], sizeof xv);
            pv = exp_v(xv - m_new);
            __m512 prob;
            memcpy(&prob, &pv, sizeof prob);
            sum = _mm512_add_ps(sum, prob);
            /* PV: the 16 probabilities as 8 bf16 pairs, each broadcast against a V row. */
            const __m256bh pb = _mm512_cvtneps_pbh(prob);
            uint32_t pairs[8];
            memcpy(pairs, &pb, sizeof pairs);
            const uint16_t *vc = vt + c * 16 * d;
            for (int j = 0; j < 8; j++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pairs[j]);
                for (int64_t b = 0; b < d / 16; b++)
                    o[b] = _mm512_dpbf16_ps(
                        o[b], x, (__m512bh)_mm512_loadu_si512((const void *)(vc + j * d * 2 + b * 32)));
            }
        }
        l[r] = sum;
        for (int64_t b = 0; b < d / 16; b++) _mm512_storeu_ps(acc + r * d + b * 16, o[b]);
    }
}

/* One work item: query rows nq = tokens * group of KV head g, row (i, h) = token i's query head
 * g * group + h; token i at position pos0 + i. */
static void pf_item(const uint16_t *q, int64_t n_q_stride, const uint16_t *kp,
                    const uint16_t *vp, int64_t g, int64_t tok0, int64_t tokens, int64_t pos0,
                    const Shape *s, float scale, uint16_t *out, const PfScratch *w) {
    const int64_t d = s->head_dim, group = s->heads / s->kv_heads, nq = tokens * group;
    uint16_t *qrows = w->qrows;
    float *acc = w->acc, *m = w->m;
    int64_t *pos = w->pos;
    __m512 *l = w->l;
    for (int64_t r = 0; r < nq; r++) {
        const int64_t i = r / group, h = g * group + r % group;
        memcpy(qrows + r * d, q + (tok0 + i) * n_q_stride + h * d, d * sizeof(uint16_t));
        pos[r] = pos0 + i;
        m[r] = -FLT_MAX;
        l[r] = _mm512_setzero_ps();
    }
    memset(acc, 0, (size_t)nq * d * sizeof(float));
    for (int64_t r0 = 0; r0 < nq; r0 += PF_ROWS) {
        const int64_t rows = nq - r0 < PF_ROWS ? nq - r0 : PF_ROWS;
        const int64_t tiles = pos[r0 + rows - 1] / 16 + 1; /* rows are token-major */
        for (int64_t t0 = 0; t0 < tiles; t0 += PF_TILES) {
            const int live = tiles - t0 < PF_TILES ? (int)(tiles - t0) : PF_TILES;
            const uint16_t *kt = kp + t0 * 16 * d, *vt = vp + t0 * 16 * d;
            const uint16_t *qr = qrows + r0 * d;
            float *mr = m + r0, *ar = acc + r0 * d;
            const int64_t *pr = pos + r0;
            __m512 *lr = l + r0;
            switch (rows) {
            case 1: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, 1, mr, lr, ar); break;
            case 2: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, 2, mr, lr, ar); break;
            case 3: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, 3, mr, lr, ar); break;
            case 4: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, 4, mr, lr, ar); break;
            case 5: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, 5, mr, lr, ar); break;
            default: pf_chunk(qr, pr, t0, live, kt, vt, d, scale, PF_ROWS, mr, lr, ar); break;
            }
        }
    }
    for (int64_t r = 0; r < nq; r++) {
        const int64_t i = r / group, h = g * group + r % group;
        const float inv = 1.0f / _mm512_reduce_add_ps(l[r]);
        uint16_t *dst = out + (tok0 + i) * n_q_stride + h * d;
        for (int64_t e = 0; e < d; e += VW) bf16_storev(dst + e, f32_loadv(acc + r * d + e) * inv);
    }
}

int prefill_attention_compiled(void) { return 1; }

/* q/out [n, heads, head_dim] bf16: the chunk's queries at positions start .. start+n-1 of the
 * sequence whose blocks `table` lists (its K/V for those positions already in the cache).
 * Returns 0; -1 out of memory; -2 a head size this kernel does not take. */
int prefill_attention_bf16(const int64_t *shape, const uint16_t *q, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *table, int64_t start,
                           int64_t n, float scale, uint16_t *out) {
    const Shape *s = (const Shape *)shape;
    const int64_t d = s->head_dim, group = s->heads / s->kv_heads, len = start + n;
    if (d % 32 || d > PF_MAX_HEAD_DIM || group > MAX_QUERY_HEADS || n < 1) return -2;
    const int64_t tiles = (len + 15) / 16, head_bytes = tiles * 16 * d;
    const size_t bytes = (size_t)(2 * s->kv_heads * head_bytes * 2 + 63) / 64 * 64;
    uint16_t *packed = aligned_alloc(64, bytes);
    if (!packed) return -1;
    const int64_t blocks = (n + QUERY_TOKENS - 1) / QUERY_TOKENS;
    const size_t scratch_bytes = (pf_scratch_bytes(QUERY_TOKENS * group, d) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, scratch_bytes * (size_t)s->threads);
    if (!scratch) {
        free(packed);
        return -1;
    }
    #pragma omp parallel num_threads(s->threads)
    {
        const PfScratch work = pf_scratch(scratch + scratch_bytes * (size_t)omp_get_thread_num(),
                                       QUERY_TOKENS * group, d);
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < s->kv_heads; g++)
            pf_pack_head(k_cache, v_cache, table, len, g, s, packed + 2 * g * head_bytes,
                         packed + (2 * g + 1) * head_bytes);
        /* Later tokens attend over more keys: the largest items first. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < blocks * s->kv_heads; item++) {
            const int64_t block = blocks - 1 - item / s->kv_heads, g = item % s->kv_heads;
            const int64_t tok0 = block * QUERY_TOKENS;
            const int64_t tokens = n - tok0 < QUERY_TOKENS ? n - tok0 : QUERY_TOKENS;
            pf_item(q, s->heads * d, packed + 2 * g * head_bytes,
                    packed + (2 * g + 1) * head_bytes, g, tok0, tokens, start + tok0, s, scale,
                    out, &work);
        }
    }
    free(scratch);
    free(packed);
    return 0;
}

#else

int prefill_attention_compiled(void) { return 0; }
int prefill_attention_bf16(const int64_t *shape, const uint16_t *q, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *table, int64_t start,
                           int64_t n, float scale, uint16_t *out) {
    (void)shape, (void)q, (void)k_cache, (void)v_cache, (void)table, (void)start, (void)n;
    (void)scale, (void)out;
    return -2; /* not built for AVX-512-BF16: Python never calls it then */
}

#endif
