/* The float32-activation dot products of a packed row against a few rows of x (qdot in
 * cpu_quant.c): q4_dot and q8_dot, hand-written AVX2 loops where the CPU has AVX2, FMA and F16C
 * but not AVX-512, the generic vector-extension loops (VW lanes) elsewhere. Both take
 * out[b] = row . x[b, :] for nb <= 4 rows of x (k apart), nb a constant once inlined (qdot's
 * switch), so their accumulator arrays stay in registers; q4's xs = group sums of x. */
#ifndef CPU_QUANT_DOT_H
#define CPU_QUANT_DOT_H

#include "cpu_decode_simd.h"
#include "cpu_quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>
/* AVX2 (Zen 3, most servers in service): GCC's generic byte -> float vector conversions
 * below go through scalar inserts, ~3x slower than the 16-bit decode. Here each 32-column run
 * is one 16-byte load, two masks, four zero-extends and conversions, and four FMAs per row of
 * x into two accumulator chains (FMA latency, not throughput, bounds one chain). */
static ALWAYS_INLINE void q4_dot(const QW *w, const uint8_t *qrow, const uint16_t *srow,
                                 const void *mrow, const float *x, const float *xs, const int nb,
                                 float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w);
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 tot[4];
    float mt[4];
    float sf[GCHUNK], mf[GCHUNK];
    for (int b = 0; b < nb; b++) {
        tot[b] = _mm256_setzero_ps();
        mt[b] = 0.0f;
    }
    for (int64_t g0 = 0; g0 < ng; g0 += GCHUNK) {
        int64_t gn = ng - g0 < GCHUNK ? ng - g0 : GCHUNK;
        h2f_row(srow + g0, gn, sf);
        if (w->mins_f32)
            memcpy(mf, (const float *)mrow + g0, gn * sizeof(float));
        else
            h2f_row((const uint16_t *)mrow + g0, gn, mf);
        /* sum_g min_g * (sum of x over g): one short dot per row of x. */
        for (int b = 0; b < nb; b++)
            for (int64_t g = 0; g < gn; g++) mt[b] += mf[g] * xs[b * ng + g0 + g];
        for (int64_t g = g0; g < g0 + gn; g++) {
            __m256 a0[4], a1[4];
            for (int b = 0; b < nb; b++) a0[b] = a1[b] = _mm256_setzero_ps();
            for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(qrow + c / 2));
                __m128i lo = _mm_and_si128(raw, mask);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                for (int b = 0; b < nb; b++) {
                    const float *xb = x + b * k + c;
                    a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), a0[b]);
                    a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), a1[b]);
                    a0[b] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), a0[b]);
                    a1[b] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), a1[b]);
                }
            }
            __m256 sv = _mm256_broadcast_ss(sf + (g - g0));
            for (int b = 0; b < nb; b++)
                tot[b] = _mm256_fmadd_ps(_mm256_add_ps(a0[b], a1[b]), sv, tot[b]);
        }
    }
    for (int b = 0; b < nb; b++) {
        vf t;
        memcpy(&t, &tot[b], sizeof t);
        out[b] = hsum(t) + mt[b];
    }
}

static ALWAYS_INLINE void q8_dot(const QW *w, const uint8_t *qrow, const uint16_t *srow,
                                 const float *x, const int nb, float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w);
    __m256 tot[4];
    float st[4];
    for (int b = 0; b < nb; b++) {
        tot[b] = _mm256_setzero_ps();
        st[b] = 0.0f;
    }
    const int8_t *qs = (const int8_t *)qrow;
    for (int64_t g = 0; g < ng; g++) {
        int64_t j = g * group, end = j + group < k ? j + group : k;
        __m256 a0[4], a1[4];
        float tail[4];
        for (int b = 0; b < nb; b++) {
            a0[b] = a1[b] = _mm256_setzero_ps();
            tail[b] = 0.0f;
        }
        for (; j + 16 <= end; j += 16) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(qs + j));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
            for (int b = 0; b < nb; b++) {
                a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * k + j), a0[b]);
                a1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * k + j + 8), a1[b]);
            }
        }
        for (; j + 8 <= end; j += 8) {
            __m128i raw = _mm_loadl_epi64((const __m128i *)(qs + j));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            for (int b = 0; b < nb; b++)
                a0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * k + j), a0[b]);
        }
        for (; j < end; j++)
            for (int b = 0; b < nb; b++) tail[b] += (float)qs[j] * x[b * k + j];
        float s = h2f(srow[g]);
        __m256 sv = _mm256_set1_ps(s); /* per-channel rows: one group; Q8_0: 18 a row */
        for (int b = 0; b < nb; b++) {
            tot[b] = _mm256_fmadd_ps(_mm256_add_ps(a0[b], a1[b]), sv, tot[b]);
            st[b] += tail[b] * s;
        }
    }
    for (int b = 0; b < nb; b++) {
        vf t;
        memcpy(&t, &tot[b], sizeof t);
        out[b] = hsum(t) + st[b];
    }
}
#else
/* AVX-512 and other ISAs: the generic vector-extension loops (VW lanes). */
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef int8_t vsb __attribute__((vector_size(VW)));

static ALWAYS_INLINE void q4_dot(const QW *w, const uint8_t *qrow, const uint16_t *srow,
                                 const void *mrow, const float *x, const float *xs, const int nb,
                                 float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w);
    vf tot[4];
    float mt[4];
    for (int b = 0; b < nb; b++) {
        tot[b] = (vf){0};
        mt[b] = 0.0f;
    }
    for (int64_t g = 0; g < ng; g++) {
        vf acc[4];
        for (int b = 0; b < nb; b++) acc[b] = (vf){0};
        for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
            const uint8_t *r = qrow + c / 2;
            for (int v = 0; v < 16; v += VW) {
                vb bytes;
                memcpy(&bytes, r + v, VW);
                vf lo = __builtin_convertvector(bytes & 0x0F, vf);
                vf hi = __builtin_convertvector(bytes >> 4, vf);
                for (int b = 0; b < nb; b++) {
                    const float *xb = x + b * k + c + v;
                    acc[b] += lo * f32_loadv(xb) + hi * f32_loadv(xb + 16);
                }
            }
        }
        float s = h2f(srow[g]), m = min_at(w, mrow, g);
        for (int b = 0; b < nb; b++) {
            tot[b] += acc[b] * s;
            mt[b] += m * xs[b * ng + g];
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum(tot[b]) + mt[b];
}

static ALWAYS_INLINE void q8_dot(const QW *w, const uint8_t *qrow, const uint16_t *srow,
                                 const float *x, const int nb, float *out) {
    const int64_t k = w->k, group = w->group, ng = groups_of(w);
    vf tot[4];
    float st[4];
    for (int b = 0; b < nb; b++) {
        tot[b] = (vf){0};
        st[b] = 0.0f;
    }
    const int8_t *qs = (const int8_t *)qrow;
    for (int64_t g = 0; g < ng; g++) {
        int64_t j = g * group, end = j + group < k ? j + group : k;
        vf acc[4];
        float tail[4];
        for (int b = 0; b < nb; b++) {
            acc[b] = (vf){0};
            tail[b] = 0.0f;
        }
        for (; j + VW <= end; j += VW) {
            vsb raw;
            memcpy(&raw, qs + j, VW);
            vf wv = __builtin_convertvector(raw, vf);
            for (int b = 0; b < nb; b++) acc[b] += wv * f32_loadv(x + b * k + j);
        }
        for (; j < end; j++)
            for (int b = 0; b < nb; b++) tail[b] += (float)qs[j] * x[b * k + j];
        float s = h2f(srow[g]);
        for (int b = 0; b < nb; b++) {
            tot[b] += acc[b] * s;
            st[b] += tail[b] * s;
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum(tot[b]) + st[b];
}
#endif

#endif
