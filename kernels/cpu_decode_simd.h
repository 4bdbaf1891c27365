/* The vector type of the build (VW float lanes: 16 on AVX-512, 8 on AVX2, 4 elsewhere) and the
 * scalar and vector helpers of every kernel: bfloat16 loads, stores and rounding, horizontal
 * sum, exp, silu, all static inline for the kernels' loops to inline; and the short loops the
 * 16-bit kernels expand with a constant row or head count (DOT_ROWS, DOT2_ROWS, QK_GROUP,
 * PV_GROUP). */
#ifndef CPU_DECODE_SIMD_H
#define CPU_DECODE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* For kernel helpers whose loop counts (rows of x) are constants at their call sites
 * (cpu_quant_*.h): inlined, the loops unroll and their accumulator arrays stay in registers. */
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))

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
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
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

/* VW bfloat16 -> float32: widen and shift. Where the ISA has it, one widening load
 * (vpmovzxwd) by intrinsic: GCC 12 built the generic form in DOT2_ROWS as two 128-bit halves
 * joined (5 instructions per 8 weights instead of 2). */
static inline vf bf16_loadv(const uint16_t *p) {
    vf v;
#if VW == 16 && defined(__AVX512F__)
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    memcpy(&v, &u, sizeof v);
#elif VW == 8 && defined(__AVX2__)
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    memcpy(&v, &u, sizeof v);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    memcpy(&v, &u, sizeof v);
#endif
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

/* The lanes' sum as a shuffle tree: GCC built the plain loop as VW scalar extracts and adds
 * (~30 instructions at VW 16), most of the decode attention's query-key time (one sum per
 * query head and token). */
static inline float hsum(vf v) {
#if VW == 16 && defined(__AVX512F__)
    __m512 x;
    memcpy(&x, &v, sizeof x);
    /* (the upper half through a double extract: AVX-512F, where extractf32x8 is DQ's) */
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), upper);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#elif VW == 8 && defined(__AVX2__)
    __m256 h;
    memcpy(&h, &v, sizeof h);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
#if (VW == 16 && defined(__AVX512F__)) || (VW == 8 && defined(__AVX2__))
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
#endif
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

/* The largest of start and p[0 .. n), a vector at a time: GCC keeps the plain loop scalar
 * (one vmaxss chain of 4-cycle steps a score: IEEE max is not a reduction it may reorder
 * without -ffinite-math-only), and the decode attention's softmax takes one per query head
 * and chunk. A maximum is exact in any order: the same value. */
static inline float max_of(const float *p, int64_t n, float start) {
    vf best = (vf){0} + start;
    int64_t t = 0;
    for (; t + VW <= n; t += VW) {
        vf x = f32_loadv(p + t);
        vi above = x > best;
        best = (vf)(((vi)x & above) | ((vi)best & ~above));
    }
    float top = start;
    for (int i = 0; i < VW; i++) top = best[i] > top ? best[i] : top;
    for (; t < n; t++) top = p[t] > top ? p[t] : top;
    return top;
}

/* Rows of x one pass of DOT_ROWS / DOT2_ROWS takes: 2 x 6 accumulators, 2 weight vectors and
 * an x vector fit AVX2's 16 registers (batch-32 decode step of the small demo shape, Zen 3:
 * 176 -> 162 ms with the widening load below, against 165 at 4 rows, interleaved). */
#ifndef XROWS
#define XROWS 6
#endif

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
 * load-bound otherwise). Each dot sums in the same order as DOT_ROWS: identical results. The
 * next pair of rows (2k on) is prefetched: the weights stream at the read bandwidth (a Zen 3
 * batch-1 step 28.9 -> 15.7 ms; the hardware prefetcher alone stops short). */
#define DOT2_ROWS(LOADV, LOAD, NB)                                                             \
    do {                                                                                       \
        vf acc0[NB], acc1[NB];                                                                 \
        for (int b = 0; b < NB; b++) acc0[b] = acc1[b] = (vf){0};                              \
        int64_t j = 0;                                                                         \
        for (; j + VW <= k; j += VW) {                                                         \
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
#define QK_GROUP(LOADV, G) QK_GROUP_FROM(LOADV, G, 0)
/* The same from token T0 of the chunk on. */
#define QK_GROUP_FROM(LOADV, G, T0)                                                            \
        for (int64_t t = (T0); t < n; t++) {                                                   \
            QK_PREFETCH(t);                                                                    \
            const __typeof__(*kh) *kr = kh + slot_of[t] * row;                                 \
            vf acc[G];                                                                         \
            for (int h = 0; h < G; h++) acc[h] = (vf){0};                                      \
            for (int64_t j = 0; j < d; j += VW) {                                              \
                vf kv = LOADV(kr + j);                                                         \
                for (int h = 0; h < G; h++) acc[h] += f32_loadv(qg + h * d + j) * kv;          \
            }                                                                                  \
            for (int h = 0; h < G; h++) sc[h][t] = hsum(acc[h]) * scale;                       \
        }

#if VW == 16 && defined(__AVX512F__)
/* Sixteen accumulators' lane sums in one vector: lane 4b + q holds accumulator 4q + b's sum.
 * Each sum pairs the same lanes in the same order as hsum's tree (i with i + 8, then i + 4,
 * i + 2, i + 1), so it is hsum's bit for bit, in 45 instructions for the sixteen instead of
 * ~9 each. */
static inline vf hsum16(const vf a[16]) {
    __m512 c[8], e[4], g[2];
    for (int k = 0; k < 8; k++) {
        __m512 x, y;
        memcpy(&x, &a[2 * k], sizeof x);
        memcpy(&y, &a[2 * k + 1], sizeof y);
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int k = 0; k < 4; k++)
        e[k] = _mm512_add_ps(
            _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; k++)
        g[k] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* QK_GROUP over NT tokens at a time (NT = 16 / G, 4 for G = 3): the G x NT dot products'
 * accumulators are summed together by hsum16, whose lane h * NT + u is head h's score of
 * token u (its accumulator is hsum16's transpose of that lane). The per-token sums were most
 * of the decode attention's instructions at VW 16 (three hsums a token for SmolLM's 3 query
 * heads a KV head), if only ~8% of its time at 2k tokens of context (docs/benchmarks.md).
 * The same sums as QK_GROUP's, bit for bit; the tokens past the last whole NT take
 * QK_GROUP's loop. */
#define QK_BATCH(LOADV, G)                                                                     \
        {                                                                                      \
            enum { NT = 16 / ((G) == 3 ? 4 : (G)) };                                           \
            int64_t t0b = 0;                                                                   \
            for (; t0b + NT <= n; t0b += NT) {                                                 \
                vf acc[16];                                                                    \
                _Pragma("GCC unroll 16") for (int a = 0; a < 16; a++) acc[a] = (vf){0};        \
                _Pragma("GCC unroll 16") for (int u = 0; u < NT; u++) {                        \
                    QK_PREFETCH(t0b + u);                                                      \
                    const __typeof__(*kh) *kr = kh + slot_of[t0b + u] * row;                   \
                    for (int64_t j = 0; j < d; j += VW) {                                      \
                        vf kv = LOADV(kr + j);                                                 \
                        _Pragma("GCC unroll 4") for (int h = 0; h < (G); h++) {                \
                            const int l = h * NT + u;                                          \
                            acc[4 * (l % 4) + l / 4] += f32_loadv(qg + h * d + j) * kv;        \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                float sums[16];                                                                \
                const vf scaled = hsum16(acc) * scale;                                         \
                memcpy(sums, &scaled, sizeof sums);                                            \
                for (int h = 0; h < (G); h++)                                                  \
                    memcpy(&sc[h][t0b], sums + h * NT, NT * sizeof(float));                    \
            }                                                                                  \
            QK_GROUP_FROM(LOADV, G, t0b)                                                       \
        }
#else
/* (narrower vectors: one hsum per score, as QK_GROUP) */
#define QK_BATCH(LOADV, G) QK_GROUP(LOADV, G)
#endif

/* Vectors of a head's output row PV_GROUP sums at once a head. Each accumulator is a chain of
 * one FMA a token (4 cycles of latency): one vector at a time, the G chains of a 3-head group
 * kept the FMA units idle 5 cycles in 8. G x PV_COLS chains fill them; AVX2's 16 registers hold
 * 4 x 2 accumulators with their V vectors. */
#if VW == 16
#define PV_COLS 4
#else
#define PV_COLS 2
#endif

/* out_h += sum_t p[h][t] v_t for G query heads over the chunk's V rows, C vectors of columns
 * from column j: one V load serves the G heads, the sums stay in registers, each column summed
 * over the tokens in order (the same sums whatever C is). */
#define PV_COLUMNS(LOADV, G, C)                                                                \
        {                                                                                      \
            vf acc[G][C];                                                                      \
            for (int h = 0; h < G; h++)                                                        \
                for (int c = 0; c < C; c++) acc[h][c] = f32_loadv(og + h * d + j + c * VW);    \
            for (int64_t t = 0; t < n; t++) {                                                  \
                const __typeof__(*vh) *vr = vh + slot_of[t] * row + j;                         \
                for (int c = 0; c < C; c++) {                                                  \
                    vf vv = LOADV(vr + c * VW);                                                \
                    for (int h = 0; h < G; h++) acc[h][c] += sc[h][t] * vv;                    \
                }                                                                              \
            }                                                                                  \
            for (int h = 0; h < G; h++)                                                        \
                for (int c = 0; c < C; c++)                                                    \
                    memcpy(og + h * d + j + c * VW, &acc[h][c], sizeof acc[h][c]);             \
        }

/* PV_COLUMNS over the head's row: PV_COLS vectors at a time, then one at a time. */
#define PV_GROUP(LOADV, G)                                                                     \
        {                                                                                      \
            int64_t j = 0;                                                                     \
            for (; j + PV_COLS * VW <= d; j += PV_COLS * VW) PV_COLUMNS(LOADV, G, PV_COLS)     \
            for (; j < d; j += VW) PV_COLUMNS(LOADV, G, 1)                                     \
        }

#endif
